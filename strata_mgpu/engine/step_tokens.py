"""A step's drawn tokens on their way from the device to the host: the only per-step copy back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strata_mgpu.stage.device import HostCopy


@dataclass
class StepTokens:
    """Tokens [N] drawn by one engine step; token i belongs to rows[i].

    `send` starts the copy without waiting (`stage.device.HostCopy`: into pinned memory, ordered
    on the device's current stream, an event behind it); `wait` blocks until the ids are on the host.
    """

    rows: list[Any]  # the requests, in token order
    copy: HostCopy  # the ids [N] int64 on their way to the host
    n_decode_rows: int  # the last n rows came from the decode step
    t_decode: float  # perf_counter() when the decode step was launched

    @classmethod
    def send(cls, rows: list[Any], tokens: torch.Tensor, n_decode_rows: int, t_decode: float) -> StepTokens:
        assert tokens.dim() == 1 and tokens.shape[0] == len(rows)
        return cls(rows, HostCopy(tokens), n_decode_rows, t_decode)

    def wait(self) -> list[int]:
        """The token ids; blocks until the device has drawn them and the copy has landed."""
        return self.copy.wait().tolist()
