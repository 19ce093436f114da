"""`--layer-split`: layers across stages, one device each, chained by exchanges.

A prompt chunk runs stage after stage; nothing waits on the host between them, so while stage 2
still computes chunk c, stage 1 already runs chunk c+1 (the engine's next prefill call).
Decode steps pass through the stages in turn.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Protocol

import torch

from strata_mgpu.config import LayerSplit
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_pool import DEFAULT_BLOCK_TOKENS, BlockPool, BlockTable, free_with
from strata_mgpu.model.spec import ModelSpec
from strata_mgpu.split.exchange import Exchange
from strata_mgpu.split.help_rule import HelpPolicy
from strata_mgpu.split.kv_blocks import SplitKV, SplitPool
from strata_mgpu.split.peer_prefill import MESSAGES_PER_LAYER, PeerPrefill
from strata_mgpu.split.rate_model import stage_load
from strata_mgpu.split.workers import StageWorkers, wait_all
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.link import measure_link_rate
from strata_mgpu.stage.stage import Stage, StageOptions
from strata_mgpu.stage.streams import Mark

log = logging.getLogger("strata.split")
# A prompt's chunks queued but not waited for: the stages pipeline across two chunks; more would
# only delay an abort or an error (each waits behind what is queued) and hold their activations.
MAX_CHUNKS_AHEAD = 2


class SplitError(ValueError):
    """A --layer-split that cannot be used; the message says why."""


def plan_layers(n_layers: int, n_stages: int, layer_split: LayerSplit, weights: Sequence[float | None]
                ) -> list[range]:
    """Stage layer ranges from an auto split (proportional to `weights`, e.g. VRAM budgets; equal
    when unknown) or the first layer of each later stage."""
    if n_stages < 1:
        raise SplitError("no devices")
    if layer_split.auto:
        w = [x if x else 1.0 for x in weights] if all(weights) else [1.0] * n_stages
        if n_layers < n_stages:
            raise SplitError(f"{n_stages} stages need at least {n_stages} layers, the model has {n_layers}")
        total, acc = sum(w), 0.0
        starts = []
        for x in w[:-1]:
            acc += x
            starts.append(round(n_layers * acc / total))
        starts = [min(max(s, i + 1), n_layers - (n_stages - 1 - i)) for i, s in enumerate(starts)]
    else:
        starts = list(layer_split.starts)
        if len(starts) != n_stages - 1:
            raise SplitError(f"--layer-split '{layer_split}' makes {len(starts) + 1} stages, but {n_stages} "
                             f"device(s) were given")
    bounds = [0, *starts, n_layers]
    for a, b in zip(bounds, bounds[1:], strict=False):
        if not a < b:
            raise SplitError(f"--layer-split '{layer_split}': stage boundaries must increase within "
                             f"1..{n_layers - 1}")
    return [range(a, b) for a, b in zip(bounds, bounds[1:], strict=False)]


class SplitRunner:
    """A `ModelRunner` over stages chained by exchanges."""

    def __init__(self, stages: list[Stage], exchanges: list[Exchange], *, stage_threads: bool = True):
        assert len(exchanges) == len(stages) - 1 and stages[0].is_first and stages[-1].is_last
        self.stages = stages
        self.exchanges = exchanges
        self.spec = stages[0].spec
        self.on_stage: Callable[[int, str], None] | None = None  # timing hook: (stage, 'start'|'end')
        self.helpers: list[PeerPrefill] = []
        self.policy = HelpPolicy(enabled=False)
        # the last whole prompt: per busy stage, how many of a layer's streamed experts its helper took
        self.last_help: list[int] = []
        self.prompt_clock: PromptTimer = PromptClock(stages[-1].ctx)  # one-chunk prompts, for the policy's rates
        self.kv_token_budget = min(s.kv_token_budget for s in stages)  # every stage holds every sequence's KV
        self._pool: SplitPool | None = None
        threaded = stage_threads and all(s.ctx.is_cuda for s in stages)  # CPU work runs as it is queued
        self.workers = StageWorkers([s.ctx for s in stages], threaded)

    @property
    def max_context(self) -> int:
        return min(s.max_context for s in self.stages)

    def set_stage_helper(self, policy: HelpPolicy, max_rows: int, halves_from: int = 0) -> None:
        """Each stage gets the next stage's helper (the last the first's), host buffers for up to `max_rows`
        tokens; prompts of `halves_from` tokens or more run in two halves (0: never)."""
        n = len(self.stages)
        self.helpers = []
        for k, busy in enumerate(self.stages):
            idle = self.stages[(k + 1) % n]
            elem = busy.model.w.dtype.itemsize
            max_bytes = max_rows * max(self.spec.hidden * elem, self.spec.n_experts_used * 8)
            helper = PeerPrefill(Exchange(busy.ctx, idle.ctx, busy.kernels, idle.kernels, max_bytes,
                                          n_buffers=2 * MESSAGES_PER_LAYER, name="helper input"),
                                 Exchange(idle.ctx, busy.ctx, idle.kernels, busy.kernels, max_bytes,
                                          name="helper output"), halves_from=halves_from)
            busy.attach_helper(helper)
            self.helpers.append(helper)
        self.policy = policy

    @staticmethod
    def helper_experts(busy: Stage, idle: Stage, share: float) -> int:
        """How many of each layer's streamed experts the idle stage's helper takes for `share`: resident
        experts stay, the busy stage keeps at least one streamed expert, and the helper's bytes must fit
        a slot of the ring it borrows."""
        streamed = busy.experts.streamed_per_layer()
        lent = idle.lend().ring
        if share <= 0 or streamed < 2 or lent is None:
            return 0
        fits = lent.slot_bytes // busy.arena.max_expert_bytes
        return max(0, min(streamed - 1, round(share * streamed), fits))

    def warm_decode_graphs(self, context: int) -> list[int]:
        sizes = [set(stage.warm_decode_graphs(context)) for stage in self.stages]
        return sorted(set.intersection(*sizes))

    def silent_faults(self) -> int:
        return sum(stage.silent_faults() for stage in self.stages)

    def describe(self) -> str:
        return f"{len(self.stages)} stages: " + " | ".join(s.describe(with_layers=True) for s in self.stages)

    def kv_pool(self, block_tokens: int, cells: int) -> SplitPool:
        """Blocks as many as the smallest stage's plan holds, every stage's cells of them."""
        blocks = BlockPool(min(s.kv.blocks_for(block_tokens) for s in self.stages), block_tokens)
        self._pool = SplitPool([s.kv.make_pool(block_tokens, blocks) for s in self.stages])
        return self._pool

    def mark_states(self, kv: SplitKV, boundaries: Sequence[int]) -> None:
        """No linear layers (a split of a hybrid model is refused, `check_layers_served`): nothing to snapshot."""

    def taken_states(self, kv: SplitKV) -> dict[int, object]:
        return {}

    def new_sequence(self, max_length: int, table: BlockTable | None = None, length: int = 0,
                     state: object = None) -> SplitKV:
        assert state is None, "a split serves no linear layers (`check_layers_served`)"
        pool = self._pool or self.kv_pool(DEFAULT_BLOCK_TOKENS, 0)
        own = table is None
        if table is None:
            blocks = pool.blocks
            pool_tokens = blocks.n_blocks * blocks.block_tokens
            table = BlockTable(blocks, min(max_length, pool_tokens))
            if max_length > pool_tokens:
                table.ensure(pool_tokens)
        # each stage's own KV (in its pool, or two-tier on all of it), made on its own stream; no DeltaNet
        # state beside it: a split of a hybrid model is refused (`check_layers_served`)
        kv = SplitKV([s.kv.new_sequence(max_length, table, length) for s in self.stages])
        if own:
            free_with(kv, table)
        return kv

    @torch.inference_mode()
    def prefill(self, kv: SplitKV, tokens: torch.Tensor, whole_prompt: bool = False,
                want_logits: bool = True) -> torch.Tensor | None:
        """With `want_logits=False` the chunk is queued on the stages' threads and not waited for, so the
        next chunk's stage 0 work queues while stage 1 runs this one. A whole prompt: the idle stage helps."""
        n = tokens.shape[0]
        self._observe_finished_prompt()
        rows = self._prompt_rows([[Segment(0, n, part)] for part in kv.parts], [n])
        if not whole_prompt:
            kv.pending.append(self._submit(tokens, rows))
            if not want_logits:
                while len(kv.pending) > MAX_CHUNKS_AHEAD:  # an abort or an error waits for few chunks
                    wait_all(kv.pending.pop(0))
                return None
            return self._result(kv.take_pending())[0]
        self.workers.idle()  # the helper works on both stages from this thread: nothing else may be queued
        self.last_help = [0] * len(self.stages)
        for k, (busy, helper) in enumerate(zip(self.stages, self.helpers, strict=False)):
            idle = self.stages[(k + 1) % len(self.stages)]
            share = self.policy.share(n, across_cards=idle.ctx.device != busy.ctx.device,
                                      load=stage_load(busy, idle))
            streams = busy.experts.should_stream(n)  # a prompt that gathers its experts streams none
            n_help = self.last_help[k] = self.helper_experts(busy, idle, share) if streams else 0
            if n_help > 0:
                helper.bind_stage_helper(idle.lend(), busy.arena, n_help)
        try:
            self.prompt_clock.start(n)
            logits = self._result(self._submit(tokens, rows, inline=True))[0]
            self.prompt_clock.stop()
            return logits
        finally:
            for helper in self.helpers:
                helper.abort()  # a pass that ended normally holds nothing: a no-op then
                helper.unbind()

    @torch.inference_mode()
    def prefill_many(self, kvs: Sequence[SplitKV], chunks: Sequence[torch.Tensor]) -> torch.Tensor:
        assert len(kvs) == len(chunks) > 0 and len({id(kv) for kv in kvs}) == len(kvs)
        self._observe_finished_prompt()
        ends = list(itertools.accumulate(c.shape[0] for c in chunks))
        segments = [[Segment(end - c.shape[0], end, kv.parts[k]) for kv, c, end in zip(kvs, chunks, ends, strict=True)]
                    for k in range(len(self.stages))]
        in_flight = [f for kv in kvs for f in kv.take_pending()]  # the pack's first prompt's earlier chunks
        return self._result(in_flight + self._submit(torch.cat(list(chunks)), self._prompt_rows(segments, ends)))

    def _observe_finished_prompt(self) -> None:
        """Feed the last one-chunk prompt's time to the helper policy once it has finished (no wait)."""
        timed = self.prompt_clock.read()
        if timed is not None:
            tokens, seconds = timed
            self.policy.observe(tokens, None, seconds)

    @torch.inference_mode()
    def decode(self, kvs: Sequence[SplitKV], tokens: torch.Tensor) -> torch.Tensor:
        """Each stage runs its layers (a graph replay where its path allows), the hand-overs queued between them."""
        self._observe_finished_prompt()

        def rows(k: int, stage: Stage, x: torch.Tensor) -> torch.Tensor:
            parts = [kv.parts[k] for kv in kvs]
            stage.refill_cache(parts)
            return stage.decode_rows(parts, x)

        return self._result(self._submit(tokens, rows))

    def _prompt_rows(self, segments: list[list[Segment]], ends: list[int]
                     ) -> Callable[[int, Stage, torch.Tensor], torch.Tensor]:
        """Stage k's part of prompt chunks packed as `segments[k]`; on the last stage the logits of each
        chunk's last row (`ends`: where each chunk's rows end)."""
        def work(k: int, stage: Stage, x: torch.Tensor) -> torch.Tensor:
            x = stage.model.run(stage.model.embed(x) if stage.is_first else x, segments[k])
            if not stage.is_last:
                return x
            last_rows = x[ends[0] - 1:ends[0]] if len(ends) == 1 else torch.cat([x[e - 1:e] for e in ends])
            return stage.model.logits(last_rows)
        return work

    def _submit(self, tokens: torch.Tensor, work: Callable[[int, Stage, torch.Tensor], torch.Tensor],
                inline: bool = False) -> list[Future]:
        """tokens [T] through the stages, one task each on its stage's thread: `work(k, stage, x)` maps
        stage k's input to what it hands on; the last task's result is the output."""
        last = len(self.stages) - 1
        job: list[Future] = []
        # Device tokens (a decode step's, drawn by the sampler on the caller's stream) are ready when
        # the caller's stream gets here: stage 0 waits for that point, since on its own card
        # `tokens.to` copies nothing and would read them unordered (two stages on one card read
        # half-drawn ids and failed an index assert in the embedding).
        tokens_ready = None
        if tokens.is_cuda:
            caller = self.stages[-1].ctx  # the sampler drew them from the last stage's logits, on its card
            assert caller.device == tokens.device
            tokens_ready = caller.event("tokens drawn")
            caller.record(tokens_ready)
        for k, stage in enumerate(self.stages):
            def task(k: int = k, stage: Stage = stage) -> torch.Tensor | None:
                # Stage k waits only for its inputs (tokens are copied on its own stream; hidden rows
                # come through the exchange's events); only the logits go back to the caller's stream.
                with stage.ctx.on_compute(after_caller=False, join_caller=k == last):
                    if k == 0 and tokens_ready is not None:
                        # a first stage on the CPU (`--devices cpu,0`): the host waits for the draw
                        stage.ctx.wait(tokens_ready)
                        stage.ctx.record_stream(tokens)  # not reused by the caller's stream before read here
                    x = tokens.to(stage.ctx.device) if k == 0 else self.exchanges[k - 1].receive()
                    if k > 0 and x.dtype != stage.model.w.dtype:  # a CPU stage (fp32) before a bf16 one
                        x = x.to(stage.model.w.dtype)
                    if self.on_stage:  # after the hand-over's wait: the stage's own work starts here
                        self.on_stage(k, "start")
                    x = work(k, stage, x)
                    if k == last:
                        stage.ctx.access(x, "w")
                    if self.on_stage:
                        self.on_stage(k, "end")
                    if k < last:  # the send last: a task that sent has nothing left that can fail,
                        self.exchanges[k].send(x)  # so the next stage's task always takes its rows
                    return x if k == last else None
            job.append(self.workers.submit(k, task, job[-1] if job else None, inline=inline))
        return job

    def _result(self, job: list[Future]) -> torch.Tensor:
        """Wait for a call's tasks (raising the first error) and give its output."""
        wait_all(job)
        out = job[-1].result()
        self.stages[-1].ctx.access(out, "r")  # on the caller's stream, which joined the last stage's
        return out


class PromptTimer(Protocol):
    """Times one-chunk prompts: `start(tokens)` and `stop()` around a prompt, `read()` its
    (tokens, seconds) once it has finished, else None."""

    def start(self, tokens: int) -> None: ...

    def stop(self) -> None: ...

    def read(self) -> tuple[int, float] | None: ...


class PromptClock:
    """A `PromptTimer` on the last stage's stream, without a host wait; `read()` is None while the
    prompt runs, for the first prompt (it carries warm-up), and when nothing was timed."""

    def __init__(self, ctx: DeviceContext):
        self.ctx = ctx
        self._timed: tuple[int, Mark, Mark] | None = None
        self._started: tuple[int, Mark] | None = None
        self.seen = 0  # prompts timed so far

    def start(self, tokens: int) -> None:
        self._started = (tokens, self.ctx.mark())

    def stop(self) -> None:
        assert self._started is not None
        tokens, begin = self._started
        self._started = None
        self.seen += 1
        self._timed = (tokens, begin, self.ctx.mark()) if self.seen > 1 else None

    def read(self) -> tuple[int, float] | None:
        if self._timed is None:
            return None
        tokens, begin, end = self._timed
        if not end.done():
            return None
        self._timed = None
        return tokens, end.seconds_since(begin)


def build_split(f: GGUFFile, spec: ModelSpec, options: list[StageOptions], layer_split: LayerSplit,
                on_progress: Callable[[str, int, int], None] | None = None,
                help_policy: HelpPolicy | None = None, *, help_halves: int = 0,
                stage_threads: bool = True) -> SplitRunner:
    """Stages on `options`' devices, layers by `layer_split`; the one-chunk helper where `help_policy`
    is on (halves from `help_halves` tokens, 0: never); `stage_threads`: a thread per GPU stage."""
    ranges = plan_layers(spec.n_layers, len(options), layer_split, [o.max_vram_gib for o in options])
    log.info("layer split %s: %s", layer_split, "; ".join(f"stage {i}: layers {r.start}-{r.stop - 1} on {o.device}"
                                                         for i, (o, r) in enumerate(zip(options, ranges, strict=True))))
    stages = [build_stage(f, spec, o, r, on_progress=on_progress) for o, r in zip(options, ranges, strict=True)]
    for s in stages:  # each link's rate for the helper's share, now rather than inside the first prompt
        measure_link_rate(s.ctx)
    chunk = max(o.chunk_size for o in options)
    max_bytes = chunk * spec.hidden * 4  # fp32 rows at most: bf16 needs half
    exchanges = [Exchange(a.ctx, b.ctx, a.kernels, b.kernels, max_bytes, bounded=True)  # stages: two threads
                 for a, b in zip(stages, stages[1:], strict=False)]
    runner = SplitRunner(stages, exchanges, stage_threads=stage_threads)
    if help_policy is not None and help_policy.enabled:
        runner.set_stage_helper(help_policy, chunk, halves_from=help_halves)
    return runner
