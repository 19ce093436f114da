"""`HandoverTwin`: the hand-over's arithmetic on a CPU stage's device-path twins, and the oracle the
tests hold `CpuHandover` to.
"""

from __future__ import annotations

import numpy as np
import torch

from strata_mgpu.kernels.cpu_experts import CpuExperts
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.handover import MAX_ROWS
from strata_mgpu.stage.experts.mailbox import host_sums
from strata_mgpu.stage.experts.share_policy import AutoShare, assign_host
from strata_mgpu.stage.host.arena import HostExpertArena


class HandoverTwin:
    """The hand-over on a CPU stage's twins: the picks chosen as handover_send chooses them
    (`assign_host`), the host's sums computed at `send` and added at `add` in fp32."""

    def __init__(self, arena: HostExpertArena, cache: ExpertCache, executor: CpuExperts, layers: range,
                 share: float, max_rows: int = MAX_ROWS):
        self.arena, self.cache, self.executor, self.layers, self.max_rows = arena, cache, executor, layers, max_rows
        self.share_value, self.carry = share, 0.0
        self.auto: AutoShare | None = None  # a fixed share only
        self._pending: torch.Tensor | None = None
        self.host_picks = 0  # picks the host computed, over every call (tests read it)

    def describe(self) -> str:
        return f"{self.share_value:.2f} of the missing experts on the host's cores (twin, {self.executor.describe()})"

    def takes(self, rows: int) -> bool:
        return rows <= self.max_rows

    def silent_faults(self) -> int:
        return 0  # the host's sums are computed in the call: a failure raises

    def set_share(self, share: float) -> None:
        self.share_value = share

    def wake(self) -> None:
        pass

    def arm(self) -> bool:
        return True

    def send(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        resident = (self.cache.slot_of_host[i] >= 0).numpy()
        host, self.carry = assign_host(experts.reshape(-1).tolist(), resident, self.share_value, self.carry)
        is_host = torch.isin(experts, torch.tensor(sorted(host), dtype=experts.dtype))
        self._pending = None
        if host:
            picks = torch.where(is_host, experts, -1).numpy().astype(np.int32)
            sums, rows = host_sums(self.executor, self.arena, self.layers[i], h.float(), picks, weights.float().numpy())
            self._pending = torch.zeros(h.shape, dtype=torch.float32)
            self._pending[torch.from_numpy(rows)] = sums
            self.host_picks += int(is_host.sum())
        return torch.where(is_host, -1, experts)

    def add(self, out: torch.Tensor) -> torch.Tensor:
        if self._pending is None:
            return out
        return (out.float() + self._pending.to(out.device)).to(out.dtype)

    def send_prompt(self, i: int, h: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor,
                    host_of: torch.Tensor) -> None:
        is_host = host_of[experts].bool()
        self._pending = torch.zeros(h.shape, dtype=torch.float32)
        if bool(is_host.any()):
            picks = torch.where(is_host, experts, -1).numpy().astype(np.int32)
            sums, rows = host_sums(self.executor, self.arena, self.layers[i], h.float(), picks, weights.float().numpy())
            self._pending[torch.from_numpy(rows)] = sums
            self.host_picks += int(is_host.sum())

    def collect(self, rows: int, hidden: int) -> torch.Tensor:
        assert self._pending is not None and self._pending.shape == (rows, hidden)
        out, self._pending = self._pending, None
        return out

    def close(self) -> None:
        pass
