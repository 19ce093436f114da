"""The engine: a request queue, chunked prefill and batched decode over a `ModelRunner`.

Its steady state is one call, `step()`: free what was aborted, admit waiting requests, launch one
prefill call (a chunk of one prompt, short prompts packed beside it) and one decode step for
every request past its prompt, their tokens drawn on the device (`BatchSampler`) and sent to the
host; then, while the device runs them, turn the previous step's tokens into text, stops and
outputs. A decode step's input is the previous step's drawn tokens, still on the device:
launching never waits for the host's text work.

The host learns a token one step after it was drawn. EOS and stop strings are therefore known a
step late: a request that stopped at step n has had its step n+1 launched too, and that token is
dropped when it lands (its KV row is written, within prompt + max_tokens). The length limit is
known from the count alone and costs no extra step.

A background thread calls `step()` while there is work; `submit` and `abort` may be called from
any thread.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.device_sampler import BatchSampler, DrawState
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.runner import ModelRunner, SequenceState
from strata_mgpu.engine.sampler import SamplingParams, StopMatcher
from strata_mgpu.engine.step_tokens import StepTokens
from strata_mgpu.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("strata.engine")
T = TypeVar("T")
ARRIVAL_WINDOW_TURNS = 8  # an idle engine's wait for a burst: at most this many arrival gaps


class ContextOverflow(ValueError):
    """The prompt plus the tokens asked for do not fit the context."""

    def __init__(self, n_prompt_tokens: int, max_tokens: int, n_ctx: int):
        self.n_prompt_tokens, self.max_tokens, self.n_ctx = n_prompt_tokens, max_tokens, n_ctx
        super().__init__(f"the request needs {n_prompt_tokens} prompt tokens + {max_tokens} to generate, "
                         f"more than the context of {n_ctx} tokens")


@dataclass
class Timings:
    """llama.cpp's `timings` fields, and `queue_ms`: from the request's submission to its first prompt
    chunk's launch (admission and the steps before it), which prompt_ms does not count. A client's
    time to first token is queue_ms + prompt_ms + the HTTP around them."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0
    queue_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "queue_ms": self.queue_ms, "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
            "prompt_per_token_ms": self.prompt_ms / self.prompt_n if self.prompt_n else 0.0,
            "prompt_per_second": 1e3 * self.prompt_n / self.prompt_ms if self.prompt_ms else 0.0,
            "predicted_n": self.predicted_n, "predicted_ms": self.predicted_ms,
            "predicted_per_token_ms": self.predicted_ms / self.predicted_n if self.predicted_n else 0.0,
            "predicted_per_second": 1e3 * self.predicted_n / self.predicted_ms if self.predicted_ms else 0.0,
        }


@dataclass
class RequestOutput:
    """New text of one request since its last output; the last one has `finished` set."""

    request_id: str
    text: str
    token_ids: list[int]
    n_prompt_tokens: int
    n_generated: int
    finished: bool = False
    finish_reason: str | None = None  # 'stop', 'length', 'abort' or 'error'
    error: str | None = None
    error_status: int = 500  # the HTTP status an error maps to: 503 where the device ran out of memory
    timings: Timings | None = None


@dataclass(frozen=True)
class Failure:
    """Why a model call failed, as the requests in it are told."""

    message: str
    status: int  # HTTP: 503 when the device ran out of memory (try again later), else 500

    @classmethod
    def of(cls, e: Exception) -> Failure:
        """Logged once: one line for an out-of-memory error (its requests' memory is freed as they
        end, and the other requests go on), the traceback for anything else."""
        if isinstance(e, torch.OutOfMemoryError):
            log.error("the device ran out of memory in a model call; its requests end with 503, the rest go on")
            torch.cuda.empty_cache()  # hand what the failed call held back to the allocator's pool
            return cls("the device ran out of memory while running this request; it was dropped and its memory "
                       "freed: retry it, or send a shorter one", 503)
        log.exception("model call failed")
        return cls(f"{type(e).__name__}: {e}", 500)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass
class Request:
    id: str
    prompt: list[int]
    params: SamplingParams
    on_output: Callable[[RequestOutput], None]
    detok: IncrementalDetokenizer
    stops: StopMatcher
    phase: Phase = Phase.WAITING
    draw: DrawState | None = None  # the sampler's state of the request, from admission on
    kv: SequenceState | None = None  # the runner's state of the sequence, from its first chunk
    n_prefilled: int = 0  # prompt tokens in the KV cache
    last_token: torch.Tensor | None = None  # [1] on the device: the newest drawn token, the next decode input
    generated: list[int] = field(default_factory=list)  # tokens landed on the host and accepted
    timings: Timings = field(default_factory=Timings)
    t_submit: float = field(default_factory=time.perf_counter)
    t_first_chunk: float = 0.0
    t_prompt_done: float = 0.0

    @property
    def kv_tokens(self) -> int:
        """The KV cells the request may come to hold (the one-step-late stop stays within it)."""
        return len(self.prompt) + self.params.max_tokens


class Engine:
    def __init__(self, runner: ModelRunner[Any], tokenizer: Tokenizer, config: EngineConfig,
                 metrics: EngineMetrics | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        # no sequence longer than the runner can hold
        self.n_ctx = min(config.n_ctx(runner.spec.context_length), runner.max_context)
        self.metrics = metrics or EngineMetrics()
        self.sampler = BatchSampler()
        self._in_flight: StepTokens | None = None  # the last step's tokens, not yet on the host
        self._t_landed = 0.0  # when the last step's tokens reached the host
        self._failed: list[tuple[list[Request], Failure]] = []  # this step's failed calls: their requests, why
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []
        self._aborts: set[str] = set()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = False

    # -- API for any thread ------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], None],
               request_id: str | None = None) -> str:
        """Queue a request. Raises ContextOverflow if prompt + max_tokens exceeds the context (or the
        runner's KV budget: a request that could never be admitted)."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise ContextOverflow(len(prompt), params.max_tokens, self.n_ctx)
        if any(not 0 <= t < self.runner.spec.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in 0..{self.runner.spec.vocab_size - 1}")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(id=rid, prompt=list(prompt), params=params, on_output=on_output,
                      detok=self.tokenizer.detokenizer(), stops=StopMatcher(params.stop))
        with self._cv:
            self._waiting.append(req)
            self.metrics.waiting.set(len(self._waiting))
            self._cv.notify()
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV cache at the next step (within one step's time)."""
        with self._cv:
            self._aborts.add(request_id)
            self._cv.notify()

    def start(self) -> None:
        """Capture the runner's decode graphs (where it has them), then serve from a thread."""
        assert self._thread is None, "engine already started"
        t0 = time.perf_counter()
        sizes = self.runner.warm_decode_graphs(self.n_ctx)
        if sizes:
            log.info("decode graphs for batches of %s rows captured in %.2f s", ", ".join(map(str, sizes)),
                     time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            # No timeout: a process that exits while this thread is inside torch aborts (SIGABRT).
            # A step ends in well under a second; a slow one is said, then waited for.
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.warning("the engine's step is still running after 30 s; waiting for it before exiting")
                self._thread.join()

    @property
    def n_running(self) -> int:
        return len(self._running)

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_bytes(self) -> int:
        return sum(r.kv.nbytes for r in self._running if r.kv is not None)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                idle = False
                while (not self._stop and not self._waiting and not self._running and not self._aborts
                       and self._in_flight is None):
                    idle = True
                    self._cv.wait()
                if self._stop:
                    return
                if idle and not self._running:
                    self._gather_arrivals()
                    if self._stop:
                        return
            self.step()

    def _gather_arrivals(self) -> None:
        """An idle engine woken by an arrival: wait while more requests come in, each within
        `arrival_gap_ms` of the last (at most ARRIVAL_WINDOW_TURNS gaps), so a burst of short
        prompts packs into one prefill. On the H200, 8 chats sent at once reached the engine a
        few ms apart: the first ran alone (50 ms) while the other 7 queued behind it and then
        packed (103 ms), first tokens 149 ms mean. A lone request pays one gap. Holds _cv."""
        gap = self.config.arrival_gap_ms / 1e3
        seen = len(self._waiting)
        for _ in range(ARRIVAL_WINDOW_TURNS):
            if gap <= 0 or self._stop or len(self._waiting) >= self.config.max_running:
                return
            self._cv.wait(gap)
            if len(self._waiting) == seen:
                return
            seen = len(self._waiting)

    def step(self) -> None:
        """Launch this step's forwards, then land the previous step's tokens while they run."""
        self._take_aborts_and_admit()
        launched = self._launch()
        landing, self._in_flight = self._in_flight, launched
        if landing is not None:
            self._land(landing)
        failed, self._failed = self._failed, []
        for reqs, why in failed:
            for r in reqs:
                if r.phase is not Phase.DONE:
                    self._finish(r, "error", error=why.message, error_status=why.status)
        self._running = [r for r in self._running if r.phase is not Phase.DONE]
        self.metrics.running.set(len(self._running))

    def _take_aborts_and_admit(self) -> None:
        with self._cv:
            aborts, self._aborts = self._aborts, set()
            queued = [r for r in self._waiting if r.id in aborts]
            if queued:
                self._waiting = deque(r for r in self._waiting if r.id not in aborts)
        for r in [*queued, *self._running]:
            if r.id in aborts:
                self._finish(r, "abort", notify=False)
        self._running = [r for r in self._running if r.phase is not Phase.DONE]
        with self._cv:
            rejected = self._admit()
            self.metrics.waiting.set(len(self._waiting))
        for r in rejected:
            self._finish(r, "error", error=str(ContextOverflow(len(r.prompt), r.params.max_tokens,
                                                                 self._kv_budget() or self.n_ctx)))

    def _admit(self) -> list[Request]:
        """Move waiting requests to running, in order, while there are slots and KV room: every
        running request keeps room for its prompt + max_tokens. Returns the requests that can
        never fit (the runner's budget shrank below them after they were queued). Holds _cv."""
        budget = self._kv_budget()
        held = sum(self._kv_cells(r.kv_tokens) for r in self._running)
        rejected = []
        while self._waiting and len(self._running) < self.config.max_running:
            req = self._waiting[0]
            cells = self._kv_cells(req.kv_tokens)
            if budget is not None and held + cells > budget:
                if cells <= budget:
                    break  # it waits for room
                rejected.append(self._waiting.popleft())
                continue
            self._waiting.popleft()
            req.phase = Phase.PREFILL
            req.draw = self.sampler.open(req.params)
            self._running.append(req)
            held += cells
        return rejected

    def _kv_cells(self, tokens: int) -> int:
        """KV cells a sequence of `tokens` holds against the budget (in VRAM: a runner whose longer
        sequences spill their older KV to host RAM says how many stay)."""
        return self.runner.kv_cells(tokens)

    def _kv_budget(self) -> int | None:
        """KV cells the runner can hold for all sequences together; None: no limit."""
        return self.runner.kv_token_budget

    def _guarded(self, reqs: list[Request], fn: Callable[..., T], *args: object) -> T | None:
        """Run a model call; if it fails, the requests in it will end with an error once the step
        in flight has landed (the tokens drawn before the failure are theirs), the engine goes on."""
        try:
            return fn(*args)
        except Exception as e:  # a failed forward must not take down the other requests
            self._failed.append((reqs, Failure.of(e)))
            return None

    def _launch(self) -> StepTokens | None:
        """Queue this step's prefill call and decode step with their draws; start the tokens'
        copy to the host. Waits for the device where a prompt ends (its first tokens are landed
        at once) and where the runner itself does."""
        rows: list[Request] = []
        drawn: list[torch.Tensor] = []
        pack = self._prefill_pack()
        if pack:
            out = self._guarded([r for r, _ in pack], self._prefill, pack)
            if out is not None and out[0]:
                # The prompts' first tokens land now, before the decode step is launched: a time to
                # first token of the prompt alone (not of the next decode step too, a new sequence's
                # graph capture among it). One wait, at a prompt's end; the decode steps pipeline.
                done, first = out
                firsts = self._guarded(done, lambda: StepTokens.send(done, first, 0, time.perf_counter()))
                if firsts is not None:
                    self._land(firsts)
        t_decode = time.perf_counter()
        decoding = [r for r in self._running
                    if r.phase is Phase.DECODE and r.draw.n_drawn < r.params.max_tokens]
        if decoding:
            tokens = self._guarded(decoding, self._decode, decoding)
            if tokens is not None:
                rows += decoding
                drawn.append(tokens)
            else:
                decoding = []
        if not rows:
            return None
        return self._guarded(rows, lambda: StepTokens.send(rows, torch.cat(drawn) if len(drawn) > 1 else drawn[0],
                                                           len(decoding), t_decode))

    def _prefill_pack(self) -> list[tuple[Request, list[int]]]:
        """This step's prompt chunks: the next chunk of the first prompt in prefill, then every
        later prompt whose rest fits the chunk's remaining room, whole (`prefill_many`). Short
        prompts arriving together so reach their first token in one call instead of one step each."""
        prefilling = [r for r in self._running if r.phase is Phase.PREFILL]
        if not prefilling:
            return []
        first = prefilling[0]
        pack = [(first, first.prompt[first.n_prefilled:first.n_prefilled + self.config.chunk_size])]
        room = self.config.chunk_size - len(pack[0][1])
        for r in prefilling[1:]:
            rest = len(r.prompt) - r.n_prefilled
            if rest <= room:
                pack.append((r, r.prompt[r.n_prefilled:]))
                room -= rest
        return pack

    def _prefill(self, pack: list[tuple[Request, list[int]]]) -> tuple[list[Request], torch.Tensor | None]:
        """Run the pack's chunks; the first token of each prompt that is now complete, drawn."""
        for req, _ in pack:
            if req.kv is None:
                req.kv = self.runner.new_sequence(req.kv_tokens)  # never more than admission counted
                req.t_first_chunk = time.perf_counter()
                req.timings.queue_ms = 1e3 * (req.t_first_chunk - req.t_submit)
        t0 = time.perf_counter()
        chunks = [torch.tensor(chunk, dtype=torch.long) for _, chunk in pack]
        if len(pack) == 1:
            req, chunk = pack[0]
            last = req.n_prefilled + len(chunk) == len(req.prompt)
            logits = self.runner.prefill(req.kv, chunks[0], whole_prompt=len(chunk) == len(req.prompt),
                                         want_logits=last)
            logits = logits[None] if logits is not None else None
        else:
            logits = self.runner.prefill_many([req.kv for req, _ in pack], chunks)
        n_tokens = sum(len(chunk) for _, chunk in pack)
        self.metrics.prompt_tokens.inc(n_tokens)
        self.metrics.prompt_seconds.inc(time.perf_counter() - t0)
        for req, chunk in pack:
            req.n_prefilled += len(chunk)
        done = [req for req, _ in pack if req.n_prefilled == len(req.prompt)]
        if not done:
            return [], None
        assert all(r in done for r, _ in pack[1:]), "only the first chunk of a pack may leave a prompt unfinished"
        tokens = self.sampler.sample(logits[len(pack) - len(done):], [r.draw for r in done])  # [N]
        for i, req in enumerate(done):
            req.phase = Phase.DECODE
            req.last_token = tokens[i:i + 1]
        return done, tokens

    def _decode(self, reqs: list[Request]) -> torch.Tensor:
        """One decode step for reqs, fed their last drawn tokens; their next tokens [B] (device)."""
        kvs = [r.kv for r in reqs]
        assert all(kv is not None for kv in kvs) and all(r.last_token is not None for r in reqs)
        fed = torch.cat([r.last_token for r in reqs])  # [B], where the draws left them
        logits = self.runner.decode(kvs, fed)
        tokens = self.sampler.sample(logits, [r.draw for r in reqs])
        for i, r in enumerate(reqs):
            r.last_token = tokens[i:i + 1]
        return tokens

    def _land(self, step: StepTokens) -> None:
        """The host's part of a step: wait for its tokens, then text, stops and outputs."""
        try:
            ids = step.wait()
        except Exception as e:  # an error of the device work surfaces here
            why = Failure.of(e)
            for r in step.rows:
                if r.phase is not Phase.DONE:
                    self._finish(r, "error", error=why.message, error_status=why.status)
            return
        now = time.perf_counter()
        n_decoded = 0
        first_decode_row = len(step.rows) - step.n_decode_rows
        for i, (req, token) in enumerate(zip(step.rows, ids, strict=True)):
            if req.phase is Phase.DONE:  # stopped or aborted after this step was launched
                continue
            if not req.t_prompt_done:
                self._prompt_done(req, now)
            n_decoded += i >= first_decode_row
            self._accept(req, token)
        if step.n_decode_rows:
            dt = max(now - max(step.t_decode, self._t_landed), 1e-9)
            self.metrics.decode_seconds.inc(dt)
            self.metrics.decode_tps.set(n_decoded / dt)
        self._t_landed = now

    def _prompt_done(self, req: Request, now: float) -> None:
        """The prompt's first token has reached the host: the prompt's timings end here."""
        req.t_prompt_done = now
        req.timings.prompt_n = len(req.prompt)
        req.timings.prompt_ms = 1e3 * (now - req.t_first_chunk)
        self.metrics.prefill_tps.set(len(req.prompt) / max(now - req.t_first_chunk, 1e-9))

    def _accept(self, req: Request, token: int) -> None:
        """A new token for `req`: emit its text, or finish on EOS, a stop string or the limit."""
        req.generated.append(token)
        self.metrics.generated_tokens.inc()
        if token in self.tokenizer.eot_ids and not req.params.ignore_eos:
            self._finish(req, "stop", tail=req.stops.flush())
            return
        text, stopped = req.stops.feed(req.detok.push(token))
        if stopped:
            self._finish(req, "stop", text=text, token=token)
        elif len(req.generated) >= req.params.max_tokens:
            text += req.stops.feed(req.detok.flush())[0] + req.stops.flush()
            self._finish(req, "length", text=text, token=token)
        else:  # also with no text (mid-character): every token is reported once
            req.on_output(self._output(req, text, [token]))

    def _finish(self, req: Request, reason: str, *, text: str = "", token: int | None = None, tail: str = "",
                error: str | None = None, error_status: int = 500, notify: bool = True) -> None:
        was_queued = req.phase is Phase.WAITING
        req.phase = Phase.DONE
        req.kv = None  # frees the cache now
        req.last_token = None
        if req.draw is not None:
            self.sampler.close(req.draw)
        end = time.perf_counter()
        if req.t_prompt_done:
            req.timings.predicted_n = len(req.generated)
            req.timings.predicted_ms = 1e3 * (end - req.t_prompt_done)
        self.metrics.requests.labels(finish_reason=reason).inc()
        t = req.timings
        if was_queued:
            log.info("%s: prompt %d tok, queued %.1f ms, finish %s before it started", req.id, len(req.prompt),
                     1e3 * (end - req.t_submit), reason)
        else:
            log.info("%s: queued %.1f ms, prompt %d tok %.1f ms (%.1f tok/s), decode %d tok %.1f ms (%.1f tok/s), "
                     "finish %s", req.id, t.queue_ms, t.prompt_n, t.prompt_ms, t.as_dict()["prompt_per_second"],
                     t.predicted_n, t.predicted_ms, t.as_dict()["predicted_per_second"], reason)
        if notify:
            out = self._output(req, text + tail, [token] if token is not None else [])
            out.finished, out.finish_reason, out.error, out.timings = True, reason, error, req.timings
            out.error_status = error_status
            req.on_output(out)

    @staticmethod
    def _output(req: Request, text: str, tokens: list[int]) -> RequestOutput:
        return RequestOutput(request_id=req.id, text=text, token_ids=tokens, n_prompt_tokens=len(req.prompt),
                             n_generated=len(req.generated))
