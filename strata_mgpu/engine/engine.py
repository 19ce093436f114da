"""The engine: a request queue, chunked prefill and batched decode over a `ModelRunner`.

Its steady state is one call, `step()`: schedule (`Scheduler`), launch (one prefill call and one
decode step, their tokens drawn on the device), and land (`OutputProcessor`: while the device
runs them, the previous step's tokens become text, stops and outputs). A decode step's input is
the previous step's drawn tokens, still on the device: launching never waits for the host.

So EOS and stop strings are known a step late: a request that stopped at step n has had step
n+1 launched too, and that token is dropped when it lands (its KV row stays within prompt +
max_tokens). A row under a grammar cannot wait: its mask needs the token drawn before it, so a
step with such a row lands the step in flight between its forward and its draw (`_decode`).

A model call that fails, or a step during which `ModelRunner.silent_faults` rose, ends its
requests with an error once the step in flight has landed; the engine goes on with the others.
A background thread calls `step()`; `submit` and `abort` may be called from any thread.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.device_sampler import BatchSampler, Draw
from strata_mgpu.engine.metrics import EngineMetrics
from strata_mgpu.engine.output import OutputProcessor
from strata_mgpu.engine.prefix_cache import PrefixCache
from strata_mgpu.engine.request import ContextOverflow, Failure, Phase, Request, RequestOutput, Timings
from strata_mgpu.engine.runner import KVPool, ModelRunner
from strata_mgpu.engine.sampler import SamplingParams, StopMatcher
from strata_mgpu.engine.scheduler import PrefillChunk, Scheduler, StepPlan
from strata_mgpu.engine.step_tokens import StepTokens
from strata_mgpu.model.tokenizer import Tokenizer

__all__ = ["ContextOverflow", "Engine", "Failure", "Phase", "Request", "RequestOutput", "Timings"]

log = logging.getLogger("strata.engine")
T = TypeVar("T")


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
        self.pool = runner.kv_pool(config.prefix_block_tokens, config.kv_cells(runner.spec.context_length))
        self.metrics.watch_pool(self.pool.blocks)
        b = self.pool.blocks
        log.info("KV pool: %d blocks of %d tokens (%.2f MiB each, %s)", b.n_blocks, b.block_tokens,
                 self.pool.block_bytes / (1 << 20), "on the device" if self.pool.host_tier else "in host RAM")
        self.prefix = make_prefix_cache(self.pool, config, stateful=runner.spec.hybrid)
        # a hybrid model's linear layers' state is snapshotted every `state_every` tokens of a prompt
        # (and at its last full block): a snapshot as large as the KV blocks between two of them
        self.state_every = (self.pool.blocks.block_tokens * max(1, -(-runner.spec.linear_state_bytes()
                                                                    // self.pool.block_bytes))
                            if runner.spec.hybrid else 0)
        if self.prefix is not None:
            self.metrics.watch_prefix_cache(self.prefix)
        self.output = OutputProcessor(tokenizer, self.sampler, self.metrics, self.prefix)
        self.scheduler = Scheduler(runner, self.pool, config, self.n_ctx, self.sampler, self.output, self.metrics,
                                   self.prefix)
        self._in_flight: StepTokens | None = None  # the last step's tokens, not yet on the host
        self._failed: list[tuple[list[Request], Failure]] = []  # this step's failed calls: their requests, why
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # -- API for any thread ------------------------------------------------------------------
    def submit(self, prompt: list[int], params: SamplingParams, on_output: Callable[[RequestOutput], object],
               request_id: str | None = None) -> str:
        """Queue a request. Raises ContextOverflow if prompt + max_tokens exceeds the context or the
        runner's KV budget."""
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) + params.max_tokens > self.n_ctx:
            raise ContextOverflow(len(prompt), params.max_tokens, self.n_ctx)
        vocab = self.runner.spec.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in 0..{vocab - 1}")
        if any(not 0 <= t < vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in 0..{vocab - 1}")
        if params.grammar is not None and params.grammar.vocab_size != vocab:
            raise ValueError(f"the grammar was compiled for {params.grammar.vocab_size} tokens, the model has {vocab}")
        rid = request_id or f"req-{next(self._ids)}"
        self.scheduler.add(Request(id=rid, prompt=list(prompt), params=params, on_output=on_output,
                                   detok=self.tokenizer.detokenizer(), stops=StopMatcher(params.stop)))
        return rid

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV cache at the next step."""
        self.scheduler.abort(request_id)

    def reset_prefix_cache(self) -> Future[int]:
        return self.scheduler.reset_prefix_cache()

    def start(self) -> None:
        assert self._thread is None, "engine already started"
        t0 = time.perf_counter()
        sizes = self.runner.warm_decode_graphs(self.n_ctx)
        if sizes:
            log.info("decode graphs for batches of %s rows captured in %.2f s", ", ".join(map(str, sizes)),
                     time.perf_counter() - t0)
        self._thread = threading.Thread(target=self._loop, name="strata-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self.scheduler.stop()
        if self._thread:
            # No timeout: a process that exits while this thread is inside torch aborts (SIGABRT).
            # A step ends in well under a second; a slow one is said, then waited for.
            self._thread.join(timeout=30)
            if self._thread.is_alive():
                log.warning("the engine's step is still running after 30 s; waiting for it before exiting")
                self._thread.join()

    @property
    def n_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def n_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def kv_bytes(self) -> int:
        return sum(r.kv.nbytes for r in self.scheduler.running if r.kv is not None)

    # -- the loop ----------------------------------------------------------------------------
    def _loop(self) -> None:
        while self.scheduler.wait_for_work(step_in_flight=self._in_flight is not None):
            self.step()

    def step(self) -> None:
        plan = self.scheduler.schedule()
        launched = self._launch(plan)
        landing, self._in_flight = self._in_flight, launched
        if landing is not None:
            self._land(landing)
        self._end_failed_calls()
        self.scheduler.retire_finished()

    def _land(self, step: StepTokens) -> None:
        self.output.land(step, self.runner.silent_faults)

    def _end_failed_calls(self) -> None:
        failed, self._failed = self._failed, []
        for reqs, why in failed:
            self.output.fail(reqs, why)

    def _guarded(self, reqs: list[Request], call: Callable[[], T]) -> T | None:
        try:
            return call()
        except Exception as e:  # a failed forward must not take down the other requests
            self._failed.append((reqs, Failure.of(e)))
            return None

    # -- launch: the model calls -------------------------------------------------------------
    def _launch(self, plan: StepPlan) -> StepTokens | None:
        """Queue the plan's prefill call and decode step with their draws. Waits for the device where a
        prompt ends (its first tokens are landed at once) and where the runner itself does."""
        faults = self.runner.silent_faults()  # before anything of this step is queued
        if plan.prefill:
            ended = self._guarded(plan.prefilling, lambda: self._prefill(plan.prefill, faults))
            if ended is not None:
                # The prompts' first tokens land now, before the decode step is launched: a time to
                # first token of the prompt alone (not of the next decode step too, a new sequence's
                # graph capture among it). One wait, at a prompt's end; the decode steps pipeline.
                done, first = ended
                since = min(r.faults_at_first_chunk for r in done)  # the counts only rise: the earliest
                firsts = self._guarded(done, lambda: StepTokens.send(done, first, 0, time.perf_counter(), since))
                if firsts is not None:
                    self._land(firsts)
                self._guarded(done, lambda: self._save_prompts(done))
        t_decode = time.perf_counter()
        decoding = [r for r in plan.decode if r.phase is Phase.DECODE]  # not failed, not ended by its first token
        if not decoding:
            return None
        tokens = self._guarded(decoding, lambda: self._decode(decoding))
        if tokens is None:
            return None
        return self._guarded(decoding, lambda: StepTokens.send(decoding, tokens, len(decoding), t_decode, faults))

    def _prefill(self, pack: list[PrefillChunk], faults: int) -> tuple[list[Request], Draw] | None:
        """The prompts now complete and their first tokens, drawn (None: none complete). `faults`: the
        runner's `silent_faults` before this step."""
        for chunk in pack:
            req = chunk.request
            if not req.t_first_chunk:  # (a preempted request keeps its first times)
                req.faults_at_first_chunk = faults
                req.t_first_chunk = time.perf_counter()
                req.timings.queue_ms = 1e3 * (req.t_first_chunk - req.t_submit)
        if self.state_every and self.prefix is not None:
            for chunk in pack:
                self.runner.mark_states(chunk.request.kv_state, self._state_marks(chunk))
        t0 = time.perf_counter()
        tensors = [torch.tensor(chunk.tokens, dtype=torch.long) for chunk in pack]
        logits: torch.Tensor | None
        if len(pack) == 1:
            (chunk,) = pack
            logits = self.runner.prefill(chunk.request.kv_state, tensors[0], whole_prompt=chunk.whole_prompt,
                                         want_logits=chunk.ends_prompt)
            logits = logits[None] if logits is not None else None
        else:
            logits = self.runner.prefill_many([chunk.request.kv_state for chunk in pack], tensors)
        self.metrics.prompt_tokens.inc(sum(len(chunk.tokens) for chunk in pack))
        self.metrics.prompt_seconds.inc(time.perf_counter() - t0)
        for chunk in pack:
            chunk.request.n_prefilled += len(chunk.tokens)
            if self.state_every and self.prefix is not None:
                chunk.request.states.update(self.runner.taken_states(chunk.request.kv_state))
        done = [chunk.request for chunk in pack if chunk.ends_prompt]
        if not done:
            return None

        assert all(chunk.ends_prompt for chunk in pack[1:]), "only a pack's first chunk may leave its prompt unfinished"
        assert logits is not None, "a prompt's last chunk returns its logits"
        drawn = self.sampler.draw(logits[len(pack) - len(done):], [r.draw_state for r in done])
        tokens = drawn.tokens  # [N]
        for i, req in enumerate(done):
            req.phase = Phase.DECODE
            req.last_token = tokens[i:i + 1]
        return done, drawn

    def _state_marks(self, chunk: PrefillChunk) -> list[int]:
        """Where a hybrid prompt's chunk snapshots its linear state: every `state_every` tokens, and the
        prompt's last full block (where its next turn continues)."""
        b, every = self.pool.blocks.block_tokens, self.state_every
        last = len(chunk.request.prefill_tokens) // b * b
        marks = list(range((chunk.start // every + 1) * every, chunk.end + 1, every))
        return [*marks, last] if chunk.start < last <= chunk.end and last not in marks else marks

    def _save_prompts(self, done: list[Request]) -> None:
        """The prefix cache indexes the full blocks of prompts just computed (after their first tokens went
        out)."""
        if self.prefix is None:
            return
        for req in done:
            table = req.cacheable_table  # None: ended by its first token, or a two-tier ring
            if table is not None:
                self.prefix.insert(table, req.prefill_tokens, len(req.prefill_tokens), req.states)

    def _decode(self, reqs: list[Request]) -> Draw:
        """Their next tokens [B] (device). With a grammar row in the batch, the step in flight lands here,
        after this step's forward is queued and before its draw (the matcher needs last step's token)."""
        kvs = [r.kv_state for r in reqs]
        fed = torch.cat([r.decode_input for r in reqs])  # [B], where the draws left them
        logits = self.runner.decode(kvs, fed)
        if self._in_flight is not None and any(r.draw_state.grammar is not None for r in reqs):
            landing, self._in_flight = self._in_flight, None
            self._land(landing)  # may end rows of this batch: their tokens are dropped as they land
        drawn = self.sampler.draw(logits, [r.draw_state for r in reqs])
        for i, r in enumerate(reqs):
            if r.phase is not Phase.DONE:
                r.last_token = drawn.tokens[i:i + 1]
        return drawn


def make_prefix_cache(pool: KVPool, config: EngineConfig, stateful: bool = False) -> PrefixCache | None:
    """The engine's prefix cache over the runner's pool (None where `config.prefix_cache` is off): a host
    tier of `--cache-ram` bounded by half the RAM free now, so a cache may not crowd out what the process
    needs."""
    if not config.prefix_cache:
        return None
    asked = int(config.cache_ram_gib * (1 << 30)) if pool.host_tier else 0
    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    host_bytes = min(asked, free // 2)
    if host_bytes < asked:
        log.warning("--cache-ram %.1f GiB: the host holds %.1f GiB free, so the prefix cache keeps at most %.1f GiB "
                    "there", config.cache_ram_gib, free / (1 << 30), host_bytes / (1 << 30))
    cache = PrefixCache(pool, host_bytes=host_bytes, stateful=stateful)
    log.info("prefix cache: an index over the KV pool's blocks; up to %d blocks moved out of it kept in host RAM",
             cache.host_blocks)
    return cache
