"""The engine: a request queue, chunked prefill and batched decode over a `ModelRunner`.

Its steady state is one call, `step()`: free what was aborted, admit waiting requests, run one
prefill chunk, run one decode step for every request past its prompt, hand each request its new
text. A background thread calls `step()` while there is work; `submit` and `abort` may be called
from any thread.
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

import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.runner import ModelRunner
from strata_mgpu.engine.sampler import Sampler, SamplingParams, StopMatcher
from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.tokenizer import IncrementalDetokenizer, Tokenizer

log = logging.getLogger("strata.engine")


class ContextOverflow(ValueError):
    """The prompt plus the tokens asked for do not fit the context."""

    def __init__(self, n_prompt_tokens: int, max_tokens: int, n_ctx: int):
        self.n_prompt_tokens, self.max_tokens, self.n_ctx = n_prompt_tokens, max_tokens, n_ctx
        super().__init__(f"the request needs {n_prompt_tokens} prompt tokens + {max_tokens} to generate, "
                         f"more than the context of {n_ctx} tokens")


@dataclass
class Timings:
    """llama.cpp's `timings` fields."""

    prompt_n: int = 0
    prompt_ms: float = 0.0
    predicted_n: int = 0
    predicted_ms: float = 0.0

    def as_dict(self) -> dict[str, float]:
        return {
            "prompt_n": self.prompt_n, "prompt_ms": self.prompt_ms,
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
    timings: Timings | None = None


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
    sampler: Sampler
    detok: IncrementalDetokenizer
    stops: StopMatcher
    phase: Phase = Phase.WAITING
    kv: KVCache | None = None
    n_prefilled: int = 0  # prompt tokens in the KV cache
    generated: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    t_first_chunk: float = 0.0
    t_prompt_done: float = 0.0


class Engine:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 metrics: EngineMetrics | None = None):
        self.runner = runner
        self.tokenizer = tokenizer
        self.config = config
        self.n_ctx = config.n_ctx(runner.spec.context_length)
        self.metrics = metrics or EngineMetrics()
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
        """Queue a request. Raises ContextOverflow if prompt + max_tokens exceeds the context."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise ContextOverflow(len(prompt), params.max_tokens, self.n_ctx)
        if any(not 0 <= t < self.runner.spec.vocab_size for t in prompt):
            raise ValueError(f"prompt token ids must be in 0..{self.runner.spec.vocab_size - 1}")
        rid = request_id or f"req-{next(self._ids)}"
        req = Request(id=rid, prompt=list(prompt), params=params, on_output=on_output, sampler=Sampler(params),
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
        assert self._thread is None, "engine already started"
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread:
            self._thread.join(timeout=30)

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
                while not self._stop and not self._waiting and not self._running and not self._aborts:
                    self._cv.wait()
                if self._stop:
                    return
            self.step()

    def step(self) -> None:
        self._take_aborts_and_admit()
        prefilling = next((r for r in self._running if r.phase is Phase.PREFILL), None)
        if prefilling is not None:
            self._guarded([prefilling], self._prefill_chunk, prefilling)
        decoding = [r for r in self._running if r.phase is Phase.DECODE]
        if decoding:
            self._guarded(decoding, self._decode, decoding)
        self._running = [r for r in self._running if r.phase is not Phase.DONE]
        self.metrics.running.set(len(self._running))

    def _take_aborts_and_admit(self) -> None:
        with self._cv:
            aborts, self._aborts = self._aborts, set()
            if aborts:
                self._waiting = deque(r for r in self._waiting if r.id not in aborts)
            while self._waiting and len(self._running) < self.config.max_running:
                req = self._waiting.popleft()
                req.phase = Phase.PREFILL
                self._running.append(req)
            self.metrics.waiting.set(len(self._waiting))
        for r in self._running:
            if r.id in aborts:
                self._finish(r, "abort", notify=False)
        self._running = [r for r in self._running if r.phase is not Phase.DONE]

    def _guarded(self, reqs: list[Request], fn: Callable[..., None], *args: object) -> None:
        """Run a model call; if it fails, the requests in it end with an error, the engine goes on."""
        try:
            fn(*args)
        except Exception as e:  # a failed forward must not take down the other requests
            log.exception("model call failed")
            for r in reqs:
                if r.phase is not Phase.DONE:
                    self._finish(r, "error", error=f"{type(e).__name__}: {e}")

    def _prefill_chunk(self, req: Request) -> None:
        if req.kv is None:
            req.kv = self.runner.new_sequence(self.n_ctx)
            req.t_first_chunk = time.perf_counter()
        chunk = req.prompt[req.n_prefilled:req.n_prefilled + self.config.chunk_size]
        t0 = time.perf_counter()
        logits = self.runner.prefill(req.kv, torch.tensor(chunk, dtype=torch.long),
                                     whole_prompt=len(chunk) == len(req.prompt))
        req.n_prefilled += len(chunk)
        self.metrics.prompt_tokens.inc(len(chunk))
        self.metrics.prompt_seconds.inc(time.perf_counter() - t0)
        if req.n_prefilled < len(req.prompt):
            return
        req.t_prompt_done = time.perf_counter()
        req.timings.prompt_n = len(req.prompt)
        req.timings.prompt_ms = 1e3 * (req.t_prompt_done - req.t_first_chunk)
        self.metrics.prefill_tps.set(len(req.prompt) / max(req.t_prompt_done - req.t_first_chunk, 1e-9))
        req.phase = Phase.DECODE
        self._accept(req, req.sampler.sample(logits))

    def _decode(self, reqs: list[Request]) -> None:
        t0 = time.perf_counter()
        kvs = [r.kv for r in reqs]
        assert all(kv is not None for kv in kvs)
        logits = self.runner.decode(kvs, torch.tensor([r.generated[-1] for r in reqs], dtype=torch.long))
        dt = time.perf_counter() - t0
        self.metrics.decode_seconds.inc(dt)
        self.metrics.decode_tps.set(len(reqs) / max(dt, 1e-9))
        for i, r in enumerate(reqs):
            self._accept(r, r.sampler.sample(logits[i]))

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
                error: str | None = None, notify: bool = True) -> None:
        req.phase = Phase.DONE
        req.kv = None  # frees the cache now
        end = time.perf_counter()
        if req.t_prompt_done:
            req.timings.predicted_n = len(req.generated)
            req.timings.predicted_ms = 1e3 * (end - req.t_prompt_done)
        self.metrics.requests.labels(finish_reason=reason).inc()
        t = req.timings
        log.info("%s: prompt %d tok %.1f ms (%.1f tok/s), decode %d tok %.1f ms (%.1f tok/s), finish %s",
                 req.id, t.prompt_n, t.prompt_ms, t.as_dict()["prompt_per_second"], t.predicted_n, t.predicted_ms,
                 t.as_dict()["predicted_per_second"], reason)
        if notify:
            out = self._output(req, text + tail, [token] if token is not None else [])
            out.finished, out.finish_reason, out.error, out.timings = True, reason, error, req.timings
            req.on_output(out)

    @staticmethod
    def _output(req: Request, text: str, tokens: list[int]) -> RequestOutput:
        return RequestOutput(request_id=req.id, text=text, token_ids=tokens, n_prompt_tokens=len(req.prompt),
                             n_generated=len(req.generated))
