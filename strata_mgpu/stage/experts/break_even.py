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
m the expert cache's expected miss share under its pick counts, pick_s and expert_s the card's own
(`measure_compute`: a gathered pass of resident picks and a dequantization of the resident experts,
timed when the stage is built); the link terms bind at few rows wherever experts stream.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.expert_layout import ExpertLayout
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.cache import ExpertCache

# where unmeasured: one H200's (tools.bench_kernels, 30B-A3B): a gathered pick from VRAM, one layer,
# pick by pick, and one expert of a whole-layer pass dequantized to bf16
PICK_S = 1.7e-6
EXPERT_DEQUANT_S = 6.0e-6
MEASURE_ROWS = 8  # rows of the timed gathered pass


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


def measure_compute(kernels: TorchKernels, cache: ExpertCache, lay: ExpertLayout, w_gate_up: torch.Tensor,
                    w_down: torch.Tensor, hidden: int, n_used: int, repeats: int = 3) -> tuple[float, float] | None:
    """(pick_s, expert_s) on the stage's card: local layer 0's gathered pass of MEASURE_ROWS rows (fewer
    where the workspace holds fewer picks) picking resident experts (the decode kernels), and its
    resident experts dequantized into the workspace `w_gate_up` / `w_down` (a whole-layer pass's first
    step), medians of `repeats` after a warm-up. None on the CPU, or with fewer resident experts a layer
    than a row picks."""
    ctx = cache.ctx
    if not ctx.is_cuda or cache.per_layer < n_used:
        return None
    resident = (cache.slot_of_host[0] >= 0).nonzero().flatten()
    n = resident.numel()
    rows = max(1, min(MEASURE_ROWS, w_gate_up.shape[0] // n_used))  # the twins' fallback gathers into the workspace
    g = torch.Generator().manual_seed(0)
    ids = resident[torch.arange(rows * n_used) % n].view(rows, n_used).to(ctx.device)
    h = torch.randn(rows, hidden, generator=g).to(w_gate_up.dtype).to(ctx.device)
    weights = torch.full((rows, n_used), 1.0 / n_used, device=ctx.device)
    on_device = resident.to(ctx.device)
    picks, experts = [], []
    with ctx.on_compute():
        for _ in range(repeats + 1):
            start = ctx.mark()
            kernels.moe_gathered(cache, 0, lay, h, weights, ids, w_gate_up, w_down)
            gathered = ctx.mark()
            kernels.dequant_addressed(cache.addresses(0, on_device),
                                      lambda: [cache.source(0, e) for e in resident.tolist()], lay, n, w_gate_up,
                                      w_down)
            done = ctx.mark()
            picks.append(gathered.seconds_since(start))
            experts.append(done.seconds_since(gathered))
    return statistics.median(picks[1:]) / (rows * n_used), statistics.median(experts[1:]) / n
