"""The scheduler: which requests run, and what each step runs of them.

`add`, `abort` and `stop` may be called from any thread (they take the condition variable the
engine's thread waits on while idle); everything else is called by the engine's thread.

Admission is in order, while there is a slot and KV room: every running request keeps room for
its prompt + max_tokens, and so do the prefix cache's device blocks, which move to host RAM when
a request needs their room. A request the budget can never hold ends with `ContextOverflow`; one
that does not fit yet waits, and so do all behind it.
"""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.device_sampler import BatchSampler
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.output import OutputProcessor
from strata_mgpu.engine.prefix_cache import PrefixCache
from strata_mgpu.engine.request import ContextOverflow, Phase, Request
from strata_mgpu.engine.runner import ModelRunner

ARRIVAL_WINDOW_TURNS = 8  # an idle engine's wait for a burst: at most this many arrival gaps
# the share of a step's chunk that later prompts' whole rests may take ahead of the first prompt's
# next chunk: short requests do not wait behind a long prompt, which keeps at least the rest
SHORT_SHARE = 0.5


@dataclass(frozen=True)
class PrefillChunk:
    """One request's part of a prefill call: `tokens` = its prompt[start:start + len(tokens)]."""

    request: Request
    start: int  # prompt tokens in its KV cache before this chunk
    tokens: list[int]

    @property
    def ends_prompt(self) -> bool:
        return self.start + len(self.tokens) == len(self.request.prompt)

    @property
    def whole_prompt(self) -> bool:
        """The prompt in one chunk, or all of it past its cached prefix."""
        return self.start == self.request.n_cached and self.ends_prompt


@dataclass
class StepPlan:
    """What one step launches.

    prefill: the prefill call's chunks, in call order: the next chunk of the first prompt still in
        prefill, then later prompts' rests, whole (empty: no prefill call).
    decode: the decode step's rows, in running order: every request past its prompt with a token
        left to draw, and every prompt this prefill ends with more than its first token to draw.
        A row whose prefill call failed, or whose first token ended it, is left out at launch.
    """

    prefill: list[PrefillChunk]
    decode: list[Request]

    @property
    def prefilling(self) -> list[Request]:
        return [chunk.request for chunk in self.prefill]


class Scheduler:
    """The waiting queue, the running list and the aborts asked for; each step's plan."""

    def __init__(self, runner: ModelRunner[Any], config: EngineConfig, n_ctx: int,
                 sampler: BatchSampler, output: OutputProcessor, metrics: EngineMetrics,
                 prefix: PrefixCache | None = None):
        self.runner = runner
        self.prefix = prefix
        self.config = config
        self.n_ctx = n_ctx
        self.sampler = sampler
        self.output = output
        self.metrics = metrics
        self.cv = threading.Condition()  # guards waiting, aborts and stopped
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admitted, in admission order; only the engine's thread changes it
        self._aborts: set[str] = set()  # request ids asked to stop since the last step
        self._resets: list[Future[int]] = []  # prefix cache clears asked for: each gets the blocks dropped
        self._stopped = False

    # -- any thread ---------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        with self.cv:
            self.waiting.append(req)
            self.metrics.waiting.set(len(self.waiting))
            self.cv.notify()

    def abort(self, request_id: str) -> None:
        with self.cv:
            self._aborts.add(request_id)
            self.cv.notify()

    def reset_prefix_cache(self) -> Future[int]:
        """Drop the prefix cache's blocks at the next step (blocks pinned by a request about to copy them
        stay); the future gets how many were dropped."""
        done: Future[int] = Future()
        with self.cv:
            self._resets.append(done)
            self.cv.notify()
        return done

    def stop(self) -> None:
        with self.cv:
            self._stopped = True
            self.cv.notify()

    # -- the engine's thread ------------------------------------------------------------------
    def wait_for_work(self, step_in_flight: bool) -> bool:
        """Block while there is nothing to do; False once stopped. An idle engine woken by an arrival
        first gathers the burst it begins."""
        with self.cv:
            idle = False
            while not self._stopped and not (self.waiting or self.running or self._aborts or self._resets
                                             or step_in_flight):
                idle = True
                self.cv.wait()
            if self._stopped:
                return False
            if idle and not self.running:
                self._gather_arrivals()
            return not self._stopped

    def _gather_arrivals(self) -> None:
        """Wait while requests keep coming within `arrival_gap_ms` of the last (at most ARRIVAL_WINDOW_TURNS
        gaps), so a burst sent together, arriving ms apart, packs into one prefill. Holds cv."""
        gap = self.config.arrival_gap_ms / 1e3
        seen = len(self.waiting)
        for _ in range(ARRIVAL_WINDOW_TURNS):
            if gap <= 0 or self._stopped or len(self.waiting) >= self.config.max_running:
                return
            self.cv.wait(gap)
            if len(self.waiting) == seen:
                return
            seen = len(self.waiting)

    def schedule(self) -> StepPlan:
        self._take_aborts()
        self._take_resets()
        with self.cv:
            rejected = self._admit()
            self.metrics.waiting.set(len(self.waiting))
        for r in rejected:
            self.output.finish(r, "error", error=str(ContextOverflow(len(r.prompt), r.params.max_tokens,
                                                                      self.runner.kv_token_budget or self.n_ctx)))
        return self.plan()

    def _take_aborts(self) -> None:
        """Aborted requests end without an answer, before admission, so the KV room and sampler slots
        they held go to the requests admitted now."""
        with self.cv:
            aborts, self._aborts = self._aborts, set()
            queued = [r for r in self.waiting if r.id in aborts]
            if queued:
                self.waiting = deque(r for r in self.waiting if r.id not in aborts)
        for r in [*queued, *self.running]:
            if r.id in aborts:
                self.output.finish(r, "abort", notify=False)
        self.running = [r for r in self.running if r.phase is not Phase.DONE]

    def _take_resets(self) -> None:
        with self.cv:
            resets, self._resets = self._resets, []
        if resets:
            dropped = self.prefix.clear() if self.prefix is not None else 0
            for done in resets:
                done.set_result(dropped)

    def _admit(self) -> list[Request]:
        """Returns the requests that can never fit. Holds cv."""
        budget = self.runner.kv_token_budget
        held = self.running_cells()
        rejected = []
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            cells = self.runner.kv_cells(req.kv_tokens)
            if budget is not None and held + cells + self.cached_cells() > budget:
                if self.prefix is not None:
                    self.prefix.shrink_device(budget - held - cells)
                if held + cells + self.cached_cells() > budget:
                    if cells <= budget:
                        break  # it waits for room
                    rejected.append(self.waiting.popleft())
                    continue
            self.waiting.popleft()
            assert req.phase is Phase.WAITING and req.draw is None, f"{req.id} admitted twice"
            req.phase = Phase.PREFILL
            req.draw = self.sampler.open(req.params)
            if self.prefix is not None:
                req.prefix = self.prefix.match(req.prompt)
                req.n_cached = req.n_prefilled = req.prefix.n_tokens if req.prefix is not None else 0
            self.running.append(req)
            held += cells
        return rejected

    def running_cells(self) -> int:
        return sum(self.runner.kv_cells(r.kv_tokens) for r in self.running)

    def cached_cells(self) -> int:
        return self.prefix.device_cells if self.prefix is not None else 0

    def fit_prefix_cache(self) -> None:
        """Keep the prefix cache's device blocks within what the running requests leave of the KV budget."""
        budget = self.runner.kv_token_budget
        if self.prefix is not None and budget is not None:
            self.prefix.shrink_device(budget - self.running_cells())

    def plan(self) -> StepPlan:
        prefill = self._prefill_pack()
        ending = {id(chunk.request) for chunk in prefill if chunk.ends_prompt}
        decode = [r for r in self.running
                  if (r.phase is Phase.DECODE and r.draw_state.n_drawn < r.params.max_tokens)
                  or (id(r) in ending and r.params.max_tokens > 1)]  # the prefill draws its first token
        return StepPlan(prefill=prefill, decode=decode)

    def _prefill_pack(self) -> list[PrefillChunk]:
        """The step's prompt tokens, at most a chunk: later prompts whose rest fits within SHORT_SHARE of
        the chunk, the first prompt's next chunk in the room they leave, then every later prompt whose
        rest fits what is left. A short request sent while a long prompt computes so gets its first
        token a step after admission. Only the first chunk may leave its prompt unfinished."""
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        if not prefilling:
            return []
        first, later = prefilling[0], prefilling[1:]
        assert first.n_prefilled < len(first.prompt), f"{first.id} is in prefill with its prompt prefilled"

        def whole(r: Request) -> PrefillChunk:
            return PrefillChunk(r, r.n_prefilled, r.prompt[r.n_prefilled:])

        shorts, short_room = [], int(self.config.chunk_size * SHORT_SHARE)
        for r in later:
            rest = len(r.prompt) - r.n_prefilled
            if rest <= short_room:
                shorts.append(whole(r))
                short_room -= rest
        room = self.config.chunk_size - sum(len(c.tokens) for c in shorts)
        start = first.n_prefilled
        pack = [PrefillChunk(first, start, first.prompt[start:start + room]), *shorts]
        room -= len(pack[0].tokens)
        packed = {id(c.request) for c in shorts}
        for r in later:
            rest = len(r.prompt) - r.n_prefilled
            if id(r) not in packed and rest <= room:
                pack.append(whole(r))
                room -= rest
        return pack

    def retire_finished(self) -> None:
        self.running = [r for r in self.running if r.phase is not Phase.DONE]
        self.metrics.running.set(len(self.running))
