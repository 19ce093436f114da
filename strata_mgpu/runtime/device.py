"""One compute device: its torch device, the compute and upload streams, and its VRAM budget.

On the CPU the streams are None and every "asynchronous" step runs in order; the same stage code
runs on both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class DeviceError(RuntimeError):
    """The requested device cannot be used (no CUDA, bad index, budget too small)."""


@dataclass
class DeviceContext:
    device: torch.device
    max_vram_bytes: int | None = None  # None: no cap beyond the card
    compute: torch.cuda.Stream | None = field(default=None, init=False)
    upload: torch.cuda.Stream | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise DeviceError("CUDA was asked for, but torch sees no CUDA device")
            if (self.device.index or 0) >= torch.cuda.device_count():
                raise DeviceError(f"{self.device} does not exist ({torch.cuda.device_count()} CUDA device(s))")
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            self.compute = torch.cuda.current_stream(self.device)
            self.upload = torch.cuda.Stream(self.device)
            total = torch.cuda.get_device_properties(self.device).total_memory
            if self.max_vram_bytes is not None and self.max_vram_bytes > total:
                raise DeviceError(f"--max-vram {self.max_vram_bytes / 2**30:.1f} GiB exceeds {self.device}'s "
                                  f"{total / 2**30:.1f} GiB")
            # The caching allocator refuses to grow past this fraction: the budget is enforced, not
            # hoped for. It is per process and device, so a stage without a budget lifts it again.
            torch.cuda.empty_cache()
            torch.cuda.set_per_process_memory_fraction((self.max_vram_bytes or total) / total, self.device)
        elif self.device.type != "cpu":
            raise DeviceError(f"device {self.device} is not supported (cpu or cuda:N)")

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event() if self.is_cuda else None

    def vram_in_use(self) -> int:
        return torch.cuda.memory_reserved(self.device) if self.is_cuda else 0

    def vram_free_in_budget(self) -> int:
        """Bytes the stage may still allocate under its budget (or on the card)."""
        if not self.is_cuda:
            return 2**62
        free, total = torch.cuda.mem_get_info(self.device)
        cap = self.max_vram_bytes if self.max_vram_bytes is not None else total
        return max(0, min(free, cap - torch.cuda.memory_reserved(self.device)))


def parse_device(name: str) -> torch.device:
    """'cpu', 'cuda', 'cuda:1' or '1' -> torch.device."""
    name = name.strip()
    if name.isdigit():
        return torch.device("cuda", int(name))
    try:
        return torch.device(name)
    except RuntimeError:
        raise DeviceError(f"unknown device {name!r} (cpu, cuda, cuda:N or N)") from None
