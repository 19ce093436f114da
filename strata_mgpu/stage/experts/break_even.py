"""Where a pass of few rows stops gathering its picked experts and streams whole layers: the
break-even row count, from measured rates.

Per layer, with E experts, K resident, A picks a row, b bytes an expert and a share m of the
picks missing from VRAM:

- streamed:  max((E - K) b / link, E * expert_s)   the missing experts over the link (DMA), the
                                                  whole layer dequantized; the rows' GEMMs ride under
- gathered:  n A (m b / mapped + pick_s)          each pick read where it lives (a miss through the
                                                  mapped arena, once a pick), computed pick by pick

so n rows gather while n < break-even = streamed / (A (m b / mapped + pick_s)). `link` is the link
probe's pinned bytes/s, `mapped` the copy kernel's reads of the mapped arena (`measure_mapped_rate`),
m the expert cache's expected miss share under its pick counts. The compute terms are one H200's
kernel figures (docs/BENCHMARKS.md); the link terms bind at few rows wherever experts stream.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.stage.device import DeviceContext

# a gathered pick's compute from VRAM, one layer, pick by pick (tools.bench_kernels, 8-512 rows of 30B-A3B)
PICK_S = 1.7e-6
# dequantizing one expert of a whole-layer pass to bf16 (the same bench: a layer of 128 experts)
EXPERT_DEQUANT_S = 6.0e-6


@dataclass(frozen=True)
class PassRates:
    """What a layer's pass costs either way: the link's DMA and the kernels' mapped reads in bytes/s,
    a gathered pick's and a streamed expert's compute in seconds."""

    link_bytes_per_s: float
    mapped_bytes_per_s: float
    pick_s: float = PICK_S
    expert_s: float = EXPERT_DEQUANT_S

    def __post_init__(self) -> None:
        if not (self.link_bytes_per_s > 0 and self.mapped_bytes_per_s > 0 and self.pick_s >= 0
                and self.expert_s >= 0):
            raise ValueError(f"pass rates must be positive: {self}")

    def streamed_s(self, n_experts: int, missing: int, expert_bytes: float) -> float:
        """One layer streamed: its missing experts' upload, or its dequantization where that is longer."""
        return max(missing * expert_bytes / self.link_bytes_per_s, n_experts * self.expert_s)

    def gathered_row_s(self, n_used: int, miss_share: float, expert_bytes: float) -> float:
        """One row's picks of one layer gathered."""
        return n_used * (miss_share * expert_bytes / self.mapped_bytes_per_s + self.pick_s)

    def break_even_rows(self, n_experts: int, n_used: int, missing: int, expert_bytes: float,
                        miss_share: float) -> float:
        """The rows from which streaming a layer costs no more than gathering it (inf: never)."""
        per_row = self.gathered_row_s(n_used, miss_share, expert_bytes)
        if missing <= 0 or per_row <= 0:
            return float("inf")
        return self.streamed_s(n_experts, missing, expert_bytes) / per_row


def gather_rows(rates: PassRates | None, *, n_experts: int, n_used: int, missing: int, expert_bytes: float,
                miss_share: float, floor_rows: int, cap_rows: int) -> int:
    """Rows from which a pass streams: the break-even rounded up, at least `floor_rows` (what decode's
    graphs replay, which must gather) and at most `cap_rows` (what the gathered kernels take). Without
    measured rates (a CPU stage): E picks, where a layer's every expert would be read anyway."""
    if rates is None:
        rows = -(-n_experts // n_used)
    else:
        even = rates.break_even_rows(n_experts, n_used, missing, expert_bytes, miss_share)
        rows = cap_rows if even == float("inf") else int(-(-even // 1))
    return max(min(rows, cap_rows), min(floor_rows, cap_rows), 1)


def measure_mapped_rate(ctx: DeviceContext, kernels: TorchKernels, host: torch.Tensor, dst: torch.Tensor,
                        repeats: int = 3) -> float | None:
    """Bytes/s of the copy kernel's 16-byte reads of mapped host memory `host` (the arena) into `dst`
    (VRAM the stage owns, a ring slot): the median of `repeats` after a warm-up; None on the CPU."""
    if not ctx.is_cuda:
        return None
    nbytes = min(host.numel(), dst.numel()) // 16 * 16
    if nbytes == 0:
        return None
    src, out = host[:nbytes], dst[:nbytes]
    seconds = []
    with ctx.on_compute():
        for _ in range(repeats + 1):
            start = ctx.mark()
            kernels.copy_wide(out, src)
            seconds.append(ctx.mark().seconds_since(start))
    return nbytes / statistics.median(seconds[1:])
