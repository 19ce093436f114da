"""Pinned, device-mapped host buffers of exactly the size asked for.

torch's pinned allocator rounds every request up to a power of two; here one anonymous
allocation is pinned in place with cudaHostRegister, portable (every device) and mapped (kernels
read and write it at its host address, through UVA).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

CUDA_HOST_REGISTER_PORTABLE = 1
CUDA_HOST_REGISTER_MAPPED = 2


class PinError(RuntimeError):
    """A host buffer could not be pinned."""


def pin_in_place(array: np.ndarray) -> None:
    """Page-lock `array`'s memory for every device, mapped; unpinned when the array is collected."""
    if not torch.cuda.is_available():
        raise PinError("pinning host memory needs CUDA")
    ptr, size = array.ctypes.data, array.nbytes
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, CUDA_HOST_REGISTER_PORTABLE | CUDA_HOST_REGISTER_MAPPED)
    if int(err) != 0:
        raise PinError(f"cudaHostRegister of {size / 1e9:.2f} GB failed (error {int(err)}): raise the "
                       f"locked-memory limit (ulimit -l) or free host RAM")
    weakref.finalize(array, torch.cuda.cudart().cudaHostUnregister, ptr)


def host_buffer(nbytes: int, *, pin: bool) -> torch.Tensor:
    array = np.zeros(nbytes, dtype=np.uint8)
    if pin:
        pin_in_place(array)
    return torch.from_numpy(array)
