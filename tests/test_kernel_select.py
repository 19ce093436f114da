"""Which kernel set a stage gets, without a GPU: CuPy missing on a CUDA device means the torch
twins and one warning, not a crash."""

from __future__ import annotations

import logging
import sys

import torch

from strata_mgpu.kernels import experts as K
from strata_mgpu.kernels import paths


def test_without_cupy_a_cuda_device_gets_the_twins_and_one_warning(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "cupy", None)  # `import cupy` raises ImportError
    monkeypatch.setattr(paths, "_warned", set())
    # What a CUDA device would answer, so the selection gets as far as it would on a GPU.
    monkeypatch.setattr(K, "_grouped_mm_works", lambda device: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        chosen = [K.select_kernels(torch.device("cuda", 0)) for _ in range(3)]
    assert all(type(k) is K.TorchKernels for k in chosen)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "CuPy is not installed" in warnings[0] and "strata-mgpu[cuda12]" in warnings[0]
    assert "cupy-cuda13x" in warnings[0] and "torch twins" in warnings[0]


def test_cpu_gets_the_twins_silently(caplog):
    with caplog.at_level(logging.WARNING, logger="strata.kernels"):
        k = K.select_kernels(torch.device("cpu"))
    assert type(k) is K.TorchKernels and not caplog.records
