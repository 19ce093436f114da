"""A gathered pass's missing experts shared with the host's cores: while the GPU computes the picks
resident in VRAM (and the misses the link brings), the host computes a share of the misses from
the pinned arena through ggml, and the GPU adds its sums.

Shape legend: T = rows of the pass, A = picks a row, D = hidden, E = experts a layer.

Per layer of a gathered pass of at most MAX_ROWS rows (`cuda_src/cpu_handover.cu`: the GPU's side):
1. `handover_send` marks each pick: a resident expert stays; a missing one goes to the host while
   a running carry of the share says so. The host's picks, weights and rows go into the `Mailbox`
   in mapped host memory and the request number is bumped; the GPU's picks come back, the host's -1.
2. The fused decode kernels compute the GPU's picks (a -1 adds nothing).
3. The host's `HandoverWorker`, polling the request number, writes the sums [T, D] fp32, then done.
4. `handover_add` waits until done equals the request and adds the host's sums.

No step waits on the host's side of CUDA, so a decode step with hand-overs is still one graph. A
worker that fails answers with zeros and sets the share to 0; a host that does not answer within
TIMEOUT_S sets the status word, and every later wait returns at once. The layer that met the
failure lacks the host's part: `silent_faults` counts it, the engine fails the steps in flight,
and the next `arm` detaches the hand-over.
"""

from __future__ import annotations

from typing import Protocol

import torch

from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.share_policy import AutoShare
from strata_mgpu.stage.host.arena import HostExpertArena

MAX_ROWS = 64  # rows a hand-over takes: decode batches and short prompts; a larger pass stays on the GPU
MAX_EXPERTS = 4096  # cpu_handover.cu's table of where each expert of a layer goes
TIMEOUT_S = 30.0  # a host that has not answered by then has failed (its first call may build ggml graphs)


class Handover(Protocol):
    """What a stage's experts hand a share of a gathered pass's missing experts to: `CpuHandover` on a
    CUDA stage, `HandoverTwin` on a CPU stage's twins. Per layer `send` before the GPU's own kernels
    and `add` after them; a few-row prompt pass's `send_prompt` and `collect`; `arm` before each
    decode step, False where the hand-over is to be detached."""

    @property
    def max_rows(self) -> int: ...

    @property
    def share_value(self) -> float:
        ...

    @property
    def auto(self) -> AutoShare | None:
        """`auto`'s rates (None: a fixed share)."""
        ...

    @property
    def arena(self) -> HostExpertArena: ...

    @property
    def cache(self) -> ExpertCache: ...

    def describe(self) -> str: ...

    def takes(self, rows: int) -> bool: ...

    def silent_faults(self) -> int:
        """Failures the layers went on past, without the host's part."""
        ...

    def set_share(self, share: float) -> None: ...

    def wake(self) -> None:
        """Before a pass that may hand over: the host's side listens."""
        ...

    def arm(self) -> bool: ...

    def send(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Local layer i's rows h [T, D], weights and picks experts [T, A] -> the GPU's picks [T, A]."""
        ...

    def add(self, out: torch.Tensor) -> torch.Tensor:
        """The GPU's sums out [T, D] plus the host's of the last `send`."""
        ...

    def send_prompt(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    host_of: torch.Tensor) -> None:
        """A prompt pass's picks of the experts host_of [E] marks go to the host."""
        ...

    def collect(self, rows: int, hidden: int) -> torch.Tensor:
        """The host's sums [rows, D] of the last `send_prompt`."""
        ...

    def close(self) -> None: ...
