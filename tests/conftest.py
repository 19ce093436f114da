from __future__ import annotations

from pathlib import Path

import pytest

from strata_mgpu.model.synthetic import write_model


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny preset: Q4_K gate/up, Q6_K down, Q8_0 dense weights."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_model(path, "tiny", seed=7)
    return path


@pytest.fixture(scope="module")
def kernels():
    """The CUDA kernel set of cuda:0 (GPU tests only: it needs CUDA and CuPy)."""
    import torch

    from strata_mgpu.kernels.experts import select_kernels

    k = select_kernels(torch.device("cuda", 0))
    assert k.name == "cuda", "CuPy is needed for the GPU tests"
    return k


@pytest.fixture(autouse=True)
def _free_gpu_memory(request):
    """After a GPU test, collect what its stages left in reference cycles and return the cached
    blocks: VRAM budgets are per process, so the next test's budget must not count this one's
    leftovers (a split's stages and their helpers refer to each other)."""
    yield
    if "gpu" in request.keywords:
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
