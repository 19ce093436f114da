"""A step's drawn tokens on their way from the device to the host: the only per-step copy back."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StepTokens:
    """Tokens [N] drawn by one engine step; token i belongs to rows[i].

    `send` starts the copy without waiting (into pinned memory, ordered on the device's current
    stream, an event behind it); `wait` blocks until the ids are on the host.
    """

    rows: list[Any]  # the requests, in token order
    host: torch.Tensor  # [N] int64 on the host; filled once `ready` has passed
    ready: torch.cuda.Event | None  # None: `host` is filled already
    n_decode_rows: int  # the last n rows came from the decode step
    t_decode: float  # perf_counter() when the decode step was launched

    @classmethod
    def send(cls, rows: list[Any], tokens: torch.Tensor, n_decode_rows: int, t_decode: float) -> StepTokens:
        assert tokens.dim() == 1 and tokens.shape[0] == len(rows)
        if tokens.device.type == "cuda":
            host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            host.copy_(tokens, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(tokens.device))
            return cls(rows, host, ready, n_decode_rows, t_decode)
        return cls(rows, tokens.cpu(), None, n_decode_rows, t_decode)

    def wait(self) -> list[int]:
        """The token ids; blocks until the device has drawn them and the copy has landed."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()
