"""`CpuHandover`: a CUDA stage's hand-over (`handover`): the device's share and carry, the kernels
of `cuda_src/cpu_handover.cu`, the mailbox and its worker, and `auto`'s share.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

import numpy as np
import torch

from strata_mgpu.kernels import nvrtc
from strata_mgpu.kernels.cpu_experts import CpuExperts
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.handover import MAX_EXPERTS, MAX_ROWS, TIMEOUT_S
from strata_mgpu.stage.experts.mailbox import HandoverWorker, Mailbox
from strata_mgpu.stage.experts.share_policy import (
    RETUNE_STEPS,
    TRIAL_EVERY_STEPS,
    AutoShare,
    ShareTrial,
    probe_host_rate,
)
from strata_mgpu.stage.host.arena import HostExpertArena

log = logging.getLogger("strata.stage")
HANDOVER_FILE = "cpu_handover.cu"
KERNELS = ("handover_send", "handover_add", "handover_rows", "handover_send_fixed")
SEND_THREADS = 512
ADD_BLOCKS, ADD_THREADS = 16, 256  # handover_add: few blocks, each polling the done number once
ROWS_BLOCKS = 64  # handover_rows: a prompt's rows into the mailbox
HANDOVER_POLL = 50  # ggml's polling level for the hand-over's pool: requests come a layer (~0.1 ms) apart
# The worker is a Python thread: while the engine's thread runs Python (queuing the next step), a
# request waits for the GIL up to the interpreter's switch interval (5 ms by default, the length of
# a whole decode step). A stage with a hand-over lowers it for the process to this.
SWITCH_INTERVAL_S = 5e-5
# handover_send's one argument, cpu_handover.cu's HandoverSend field by field (C's layout: align=True):
# a layer's tensors and sizes, the mailbox's and the device state's addresses between them
_PTR = np.uint64
SEND_ARGS = np.dtype([("experts", _PTR), ("weights", _PTR), ("h", _PTR), ("slot_of", _PTR), ("gpu_picks", _PTR),
                      ("share", _PTR), ("carry", _PTR), ("counter", _PTR), ("n_host", _PTR), ("h_host", _PTR),
                      ("picks_host", _PTR), ("w_host", _PTR), ("meta", _PTR), ("request", _PTR),
                      ("T", np.int32), ("A", np.int32), ("D", np.int32), ("E", np.int32), ("layer", np.int32)],
                     align=True)
SEND_LAYER_PTRS = ("experts", "weights", "h", "slot_of", "gpu_picks")  # a layer's, first
SEND_SIZES = ("T", "A", "D", "E", "layer")
SEND_OFFSETS = {name: field[1] for name, field in (SEND_ARGS.fields or {}).items()}  # field -> its byte offset


class SendArgs:
    """`handover_send`'s argument as CuPy passes it by value (a numpy array of one SEND_ARGS record):
    the fixed addresses written once, a layer's at each `fill` (a launch copies its arguments, so
    the one record is filled again for the next)."""

    def __init__(self, **fixed: int):
        assert set(fixed) == set(SEND_OFFSETS) - set(SEND_LAYER_PTRS) - set(SEND_SIZES)
        self.value = np.zeros(1, dtype=SEND_ARGS)
        for name, address in fixed.items():
            self.value[name] = address
        raw = self.value.view(np.uint8)
        offsets = [SEND_OFFSETS[n] for n in (*SEND_LAYER_PTRS, *SEND_SIZES)]
        ptrs_at, sizes_at = offsets[0], offsets[len(SEND_LAYER_PTRS)]
        # each group of fields lies packed, in order: one slice assignment writes it
        assert offsets[:len(SEND_LAYER_PTRS)] == list(range(ptrs_at, ptrs_at + 8 * len(SEND_LAYER_PTRS), 8))
        assert offsets[len(SEND_LAYER_PTRS):] == list(range(sizes_at, sizes_at + 4 * len(SEND_SIZES), 4))
        self._ptrs = raw[ptrs_at:ptrs_at + 8 * len(SEND_LAYER_PTRS)].view(np.uint64)
        self._sizes = raw[sizes_at:sizes_at + 4 * len(SEND_SIZES)].view(np.int32)

    def fill(self, experts: int, weights: int, h: int, slot_of: int, gpu_picks: int, t: int, a: int, d: int,
             e: int, layer: int) -> np.ndarray:
        self._ptrs[:] = (experts, weights, h, slot_of, gpu_picks)
        self._sizes[:] = (t, a, d, e, layer)
        return self.value


class CpuHandover:
    """A CUDA stage's `handover.Handover`: `send` before the GPU's fused kernels, `add` after them,
    `arm` before each step."""

    def __init__(self, ctx: DeviceContext, arena: HostExpertArena, cache: ExpertCache, executor: CpuExperts,
                 layers: range, share: float, max_rows: int = MAX_ROWS, auto: AutoShare | None = None):
        spec = arena.spec
        assert spec.n_experts <= MAX_EXPERTS and 0 <= share <= 1
        self.ctx, self.cache, self.executor, self.max_rows, self.auto = ctx, cache, executor, max_rows, auto
        self.arena, self.layers = arena, layers
        self._steps = 0  # arms: decode steps
        self._trial: ShareTrial | None = None  # `auto`'s check by the clock, while it runs
        device = ctx.device
        self.carry = torch.zeros(1, dtype=torch.float32, device=device)
        self.counter = torch.zeros(1, dtype=torch.int64, device=device)
        self.n_host = torch.zeros(1, dtype=torch.int32, device=device)
        self.mailbox = Mailbox(max_rows, spec.n_experts_used, spec.hidden, pin=True)
        self.mailbox.share_np[0] = share
        self.worker = HandoverWorker(self.mailbox, executor, arena, layers)
        if sys.getswitchinterval() > SWITCH_INTERVAL_S:
            sys.setswitchinterval(SWITCH_INTERVAL_S)
        self._fn = {name: nvrtc.kernel(HANDOVER_FILE, name, (), device) for name in KERNELS}
        box = self.mailbox
        self._send_args = SendArgs(share=box.share.data_ptr(), carry=self.carry.data_ptr(),
                                   counter=self.counter.data_ptr(), n_host=self.n_host.data_ptr(),
                                   h_host=box.h.data_ptr(), picks_host=box.picks.data_ptr(),
                                   w_host=box.weights.data_ptr(), meta=box.meta.data_ptr(), request=box.request_at)
        self.share_value = share

    def describe(self) -> str:
        how = "auto" if self.auto is not None else "fixed"
        return f"{self.share_value:.2f} ({how}) of the missing experts to the host's cores ({self.executor.describe()})"

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def silent_faults(self) -> int:
        """Failures the GPU's layers went on past (they stay set until the hand-over is closed): a host
        that did not answer in time, and a worker that failed (it answered zeros)."""
        return int(self.mailbox.status != 0) + int(self.worker.error is not None)

    def set_share(self, share: float) -> None:
        """A new share for the layers not yet sent (written into the mailbox: graphs read it there)."""
        assert 0 <= share <= 1
        self.mailbox.share_np[0] = share
        self.share_value = share

    def calibrate(self, link_bytes_per_s: float) -> float:
        """`auto`: the host's rate probed on the worker's thread; the share at the uniform hit rate set and
        returned."""
        spec, first = self.arena.spec, self.layers.start
        host = self.worker.call(lambda: probe_host_rate(self.executor, self.arena, first, spec.n_experts_used,
                                                        spec.hidden))
        self.auto = AutoShare(host, link_bytes_per_s, self.arena.layouts[first].expert_bytes, spec.n_experts_used)
        self.set_share(self.auto.share(self.cache.hit_rate_uniform))
        return self.share_value

    def retune(self) -> None:
        """`auto`: the share again, at the expert cache's expected hit rate (its residency under the
        decayed pick counts) and the host's refitted rate; a fixed share stays. A share that falls to 0
        stays there: no request comes to measure again."""
        if self.auto is None:
            return
        hit = self.cache.expected_hit
        samples = list(self.worker.samples)
        if len(samples) >= 32:
            self.auto = replace(self.auto, host=self.auto.host.refit(samples))
        share = self.auto.share(hit)
        if abs(share - self.share_value) > 0.02:
            log.info("--cpu-experts auto: %.2f of the missing experts on the host's cores (a hit rate of %.2f; "
                     "the host %.1f GB/s after %.0f us a request)", share, hit, self.auto.host.bytes_per_s / 1e9,
                     1e6 * self.auto.host.overhead_s)
            self.set_share(share)

    def wake(self) -> None:
        self.worker.arm()

    def arm(self) -> bool:
        """False where the hand-over should go (the worker failed, the host did not answer in time, or
        `auto` declined): the stage then detaches it and captures its graphs again. Inside a graph
        capture it only wakes the worker: nothing else may be recorded there."""
        self.worker.arm()
        if torch.cuda.is_current_stream_capturing():
            return True
        if self.worker.error is not None:
            log.error("the host's cores failed an expert hand-over (%s): decode goes on over the link alone",
                      self.worker.error)
            return False
        if self.mailbox.status != 0:
            log.error("the host's cores did not answer an expert hand-over within %.0f s: decode goes on over the "
                      "link alone", TIMEOUT_S)
            return False
        self._steps += 1
        if self.auto is not None:
            self._tune(time.perf_counter())
        return self.auto is None or self.share_value > 0

    def _tune(self, now: float) -> None:
        """`auto` at a decode step's arm: every RETUNE_STEPS `retune`; after the first and every
        TRIAL_EVERY_STEPS, a `ShareTrial`, whose verdict stands."""
        if self._trial is not None:
            share = self._trial.step(now)
            if share is not None:
                self.mailbox.share_np[0] = share
                return
            trial, self._trial = self._trial, None
            with_host, without = trial.medians
            log.info("--cpu-experts auto: decode steps took %.2f ms with %.2f of the missing experts on the host's "
                     "cores, %.2f ms without: %s", 1e3 * with_host, trial.share, 1e3 * without,
                     "kept" if trial.verdict else "the link alone from now on")
            self.set_share(trial.verdict or 0.0)
            return
        if self._steps % RETUNE_STEPS == 0:
            self.retune()
            if self.share_value > 0 and self._steps % TRIAL_EVERY_STEPS == RETUNE_STEPS:
                self._trial = ShareTrial(self.share_value)
                self._tune(now)  # the trial's first step

    def send(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        t, a = experts.shape
        h, weights, experts = h.contiguous(), weights.float().contiguous(), experts.contiguous()
        gpu = torch.empty_like(experts)
        slot_of = self.cache.slot_of[i]  # [E] on the device
        args = self._send_args.fill(experts.data_ptr(), weights.data_ptr(), h.data_ptr(), slot_of.data_ptr(),
                                    gpu.data_ptr(), t, a, h.shape[1], slot_of.shape[0], i)
        nvrtc.launch(self._fn["handover_send"], 1, SEND_THREADS, (args,), self.ctx.device)
        return gpu

    def send_prompt(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    host_of: torch.Tensor) -> None:
        t, a = experts.shape
        box = self.mailbox
        h, weights, experts = h.contiguous(), weights.float().contiguous(), experts.contiguous()
        nvrtc.launch(self._fn["handover_rows"], min(ROWS_BLOCKS, -(-h.numel() // ADD_THREADS)), ADD_THREADS,
                     (h.data_ptr(), box.h.data_ptr(), np.int64(h.numel())), self.ctx.device)
        nvrtc.launch(self._fn["handover_send_fixed"], 1, SEND_THREADS,
                     (experts.data_ptr(), weights.data_ptr(), host_of.data_ptr(), np.int32(t), np.int32(a),
                      np.int32(i), self.counter.data_ptr(), self.n_host.data_ptr(), box.picks.data_ptr(),
                      box.weights.data_ptr(), box.meta.data_ptr(), box.request_at), self.ctx.device)

    def collect(self, rows: int, hidden: int) -> torch.Tensor:
        """Once the host answered (zeros where it had no picks)."""
        return self.add(torch.zeros(rows, hidden, dtype=torch.bfloat16, device=self.ctx.device))

    def add(self, out: torch.Tensor) -> torch.Tensor:
        """In place, once the host answered."""
        assert out.dtype == torch.bfloat16 and out.is_contiguous()
        n = out.numel()
        blocks = min(ADD_BLOCKS, -(-n // ADD_THREADS))
        nvrtc.launch(self._fn["handover_add"], blocks, ADD_THREADS,
                     (out.data_ptr(), self.mailbox.out.data_ptr(), self.mailbox.done_at,
                      self.counter.data_ptr(), self.n_host.data_ptr(), self.mailbox.status_at,
                      np.int64(int(TIMEOUT_S * 1e9)), np.int64(n)), self.ctx.device)
        return out

    def close(self) -> None:
        """Stop the worker and free its pool. The caller has waited for every step that used it: a kernel
        still in flight would write into freed pinned memory."""
        self.set_share(0.0)
        self.worker.close()
        self.executor.close()
