"""The scheduler: which requests run, and what each step runs of them.

`add`, `abort` and `stop` may be called from any thread (they take the condition variable the
engine's thread waits on while idle); everything else is called by the engine's thread.

KV is the runner's pool of blocks (model/kv_pool.py). Admission is in order, while there is a
slot and the pool (its free blocks, and those only the prefix cache holds) has room for the
request's prompt past its cached prefix and its first token; one that does not fit yet waits,
and so do all behind it. Sequences then grow block by block as each step plans their rows; where
the pool runs dry the youngest running request is preempted: its blocks go back (its indexed
prefix stays in the cache), it waits at the head of the queue, and when admitted again it
computes its prompt and the tokens it had drawn, mostly from the cache. A request longer than
the whole pool (its older cells in host RAM) runs alone, on every block, used as a two-tier cache's
VRAM ring: such a request's blocks are never cached (`Request.cacheable_table`).
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
from strata_mgpu.engine.request import Phase, Request
from strata_mgpu.engine.runner import KVPool, ModelRunner
from strata_mgpu.model.kv_pool import BlockTable, PoolExhausted

ARRIVAL_WINDOW_TURNS = 8  # an idle engine's wait for a burst: at most this many arrival gaps
# the share of a step's chunk that later prompts' whole rests may take ahead of the first prompt's
# next chunk: short requests do not wait behind a long prompt, which keeps at least the rest
SHORT_SHARE = 0.5


@dataclass(frozen=True)
class PrefillChunk:
    """One request's part of a prefill call: `tokens` = its prefill_tokens[start:start + len(tokens)]."""

    request: Request
    start: int  # its tokens in its KV cache before this chunk
    tokens: list[int]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def ends_prompt(self) -> bool:
        return self.end == len(self.request.prefill_tokens)

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

    def __init__(self, runner: ModelRunner[Any], pool: KVPool, config: EngineConfig, n_ctx: int,
                 sampler: BatchSampler, output: OutputProcessor, metrics: EngineMetrics,
                 prefix: PrefixCache | None = None):
        self.runner = runner
        self.pool, self.blocks = pool, pool.blocks
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
            self._admit()
            self.metrics.waiting.set(len(self.waiting))
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

    @property
    def pool_tokens(self) -> int:
        return self.blocks.n_blocks * self.blocks.block_tokens

    def _admit(self) -> None:
        """Holds cv."""
        while self.waiting and len(self.running) < self.config.max_running:
            req = self.waiting[0]
            if req.phase is Phase.DONE:  # preempted, then ended by a token that landed while it waited
                self.waiting.popleft()
                continue
            if not self._take_blocks(req):
                break  # it waits for room
            self.waiting.popleft()
            assert req.phase is Phase.WAITING, f"{req.id} admitted twice"
            req.phase = Phase.PREFILL
            if req.draw is None:  # a preempted request keeps its draw state
                req.draw = self.sampler.open(req.params)
            self.running.append(req)

    def _take_blocks(self, req: Request) -> bool:
        """The request's table and sequence: the prefix cache's blocks, and room for the rest of its prompt
        and its first token. False (nothing taken) where the pool cannot give that now."""
        if req.n_preempted:  # every token it drew has landed by now (it was preempted a step before)
            req.resumed = list(req.generated)
        tokens = req.prefill_tokens
        if req.kv_tokens > self.pool_tokens:  # its older cells spill to host RAM: the whole pool, alone
            if self.running:
                return False
            table = BlockTable(self.blocks, self.pool_tokens)
            try:
                table.ensure(self.pool_tokens)
            except PoolExhausted:
                return False
            req.table, req.n_prefilled = table, 0
            req.kv = self.runner.new_sequence(req.kv_tokens, table)
            return True
        found = self.prefix.match(tokens) if self.prefix is not None else None
        n_cached = found.n_tokens if found is not None else 0
        table = BlockTable(self.blocks, req.kv_tokens, found.blocks if found is not None else ())  # refs: the match's
        partial = n_cached % self.blocks.block_tokens != 0  # its last block is written to: a copy of its own
        need = table.missing(len(tokens) + 1) + partial
        if need > self.blocks.available(self.prefix.reclaimable if self.prefix is not None else 0):
            self._give_back(table)
            return False
        try:
            if partial:
                (own,) = self.blocks.allocate(1)
                self.pool.copy_block(table.ids[-1], own)
                shared = table.replace_last(own)
                if self.prefix is not None:
                    self.prefix.released([shared])
            table.ensure(len(tokens) + 1)
        except PoolExhausted:
            self._give_back(table)
            return False
        req.table = table
        if not req.resumed:
            req.n_cached = n_cached
        req.n_prefilled = n_cached
        req.kv = self.runner.new_sequence(req.kv_tokens, table, n_cached,
                                          state=found.state if found is not None else None)
        return True

    def _give_back(self, table: BlockTable) -> None:
        self.output.give_back(table)

    def preempt(self, req: Request) -> None:
        """Out of the running list, its blocks back to the pool; at the head of the queue, to compute its
        prompt and the tokens it drew again (the prefix cache keeps what it indexed of them)."""
        self.output.release(req)
        req.n_prefilled = 0
        req.n_preempted += 1
        req.last_token = None
        req.phase = Phase.WAITING
        self.running.remove(req)
        with self.cv:
            self.waiting.appendleft(req)
        self.metrics.preemptions.inc()

    def plan(self) -> StepPlan:
        """The step's chunks and rows, their blocks taken; where the pool runs dry, the youngest running
        request is preempted and the step planned again without it."""
        while True:
            plan = self._plan()
            if self._grow(plan):
                return plan
            self.preempt(self.running[-1])

    def _plan(self) -> StepPlan:
        prefill = self._prefill_pack()
        ending = {id(chunk.request) for chunk in prefill if chunk.ends_prompt}
        decode = [r for r in self.running
                  if (r.phase is Phase.DECODE and r.draw_state.n_drawn < r.params.max_tokens)
                  or (id(r) in ending and r.params.max_tokens > 1)]  # the prefill draws its first token
        return StepPlan(prefill=prefill, decode=decode)

    def _grow(self, plan: StepPlan) -> bool:
        """Blocks for every position the plan writes, oldest request first; False where the pool ran dry."""
        ends: dict[int, int] = {id(chunk.request): chunk.end for chunk in plan.prefill}
        for r in plan.decode:
            ends[id(r)] = ends.get(id(r), r.kv_state.length) + 1
        try:
            for r in self.running:
                if id(r) in ends and r.table is not None:
                    r.table.ensure(min(ends[id(r)], r.table.max_blocks * self.blocks.block_tokens))
        except PoolExhausted:
            return False
        return True

    def _prefill_pack(self) -> list[PrefillChunk]:
        """The step's prompt tokens, at most a chunk: later prompts whose rest fits within SHORT_SHARE of
        the chunk, the first prompt's next chunk in the room they leave, then every later prompt whose
        rest fits what is left. A short request sent while a long prompt computes so gets its first
        token a step after admission. Only the first chunk may leave its prompt unfinished."""
        prefilling = [r for r in self.running if r.phase is Phase.PREFILL]
        if not prefilling:
            return []
        first, later = prefilling[0], prefilling[1:]
        assert first.n_prefilled < len(first.prefill_tokens), f"{first.id} is in prefill with its prompt prefilled"

        def whole(r: Request) -> PrefillChunk:
            return PrefillChunk(r, r.n_prefilled, r.prefill_tokens[r.n_prefilled:])

        shorts, short_room = [], int(self.config.chunk_size * SHORT_SHARE)
        for r in later:
            rest = len(r.prefill_tokens) - r.n_prefilled
            if rest <= short_room:
                shorts.append(whole(r))
                short_room -= rest
        room = self.config.chunk_size - sum(len(c.tokens) for c in shorts)
        start = first.n_prefilled
        pack = [PrefillChunk(first, start, first.prefill_tokens[start:start + room]), *shorts]
        room -= len(pack[0].tokens)
        packed = {id(c.request) for c in shorts}
        for r in later:
            rest = len(r.prefill_tokens) - r.n_prefilled
            if id(r) not in packed and rest <= room:
                pack.append(whole(r))
                room -= rest
        return pack

    def retire_finished(self) -> None:
        self.running = [r for r in self.running if r.phase is not Phase.DONE]
        self.metrics.running.set(len(self.running))
