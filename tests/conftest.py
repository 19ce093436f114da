from __future__ import annotations

from pathlib import Path

import pytest

from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.vocab import DEFAULT_FAMILY, family_of_template


def pytest_collection_modifyitems(config, items):
    """GPU tests skip cleanly where torch sees no CUDA device."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def set_env(monkeypatch):
    """set_env(name, raw): the variable set to raw, or unset where raw is None (for this test)."""
    def set_or_unset(name: str, raw: str | None) -> None:
        if raw is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, raw)
    return set_or_unset


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory) -> Path:
    """The tiny preset: Q4_K gate/up, Q6_K down, Q8_0 dense weights."""
    path = tmp_path_factory.mktemp("models") / "tiny.gguf"
    write_model(path, "tiny", seed=7)
    return path


@pytest.fixture(scope="session")
def tiny_hybrid_gguf(tmp_path_factory) -> Path:
    """The tiny-hybrid preset (qwen35moe): Q4_K gate/up, Q6_K down, Q8_0 dense weights."""
    path = tmp_path_factory.mktemp("models") / "tiny-hybrid.gguf"
    write_model(path, "tiny-hybrid", seed=7)
    return path


TEMPLATES = Path(__file__).parent / "data" / "templates"
PACKAGED_TEMPLATES = Path(__file__).parent.parent / "strata_mgpu" / "data" / "templates"
REAL_TEMPLATES = ("qwen3", "qwen3-coder", "qwen3-thinking-2507")  # tests/data/templates/NAME.jinja
OTHER_FAMILY_TEMPLATES = ("gpt-oss", "glm-4.5")  # their own vocabulary families (harmony, glm)


def template_text(name: str) -> str:
    """A real chat template's text: tests/data/templates/NAME.jinja, or one the package ships (the other
    vocabulary families', strata_mgpu/data/templates)."""
    here = TEMPLATES / f"{name}.jinja"
    return (here if here.exists() else PACKAGED_TEMPLATES / f"{name}.jinja").read_text("utf-8")


@pytest.fixture(scope="session")
def template_gguf(tmp_path_factory):
    """template_gguf(name): the tiny preset (tiny_gguf's weights) carrying the real chat template
    tests/data/templates/NAME.jinja, as a user's file does, in the vocabulary family the template
    writes (gpt-oss's: harmony, GLM's: glm, Qwen's: qwen); written once a session."""
    made: dict[str, Path] = {}

    def path(name: str) -> Path:
        if name not in made:
            made[name] = tmp_path_factory.mktemp("models") / f"tiny-{name}.gguf"
            template = template_text(name)
            write_model(made[name], "tiny", seed=7, chat_template=template,
                        vocab_family=family_of_template(template) or DEFAULT_FAMILY)
        return made[name]
    return path


@pytest.fixture(scope="session")
def q4_k_m_gguf(tmp_path_factory) -> Path:
    """The tiny preset with the dense types of a Q4_K_M file: attn_v and the head Q6_K, q, k, o and
    the embedding Q4_K (so q, k and v are three matrices where a stage keeps blocks)."""
    from dataclasses import replace

    from gguf.constants import GGMLQuantizationType as Q

    from strata_mgpu.model import synthetic

    plain_plans = synthetic.plan_tensors

    def q4_k_m(*args, **kwargs):
        def kind(p: synthetic.TensorPlan) -> Q:
            if ".attn_v." in p.name or p.name.startswith("output."):
                return Q.Q6_K
            return Q.Q4_K if p.ggml_type == Q.Q8_0 else p.ggml_type
        return [replace(p, ggml_type=kind(p)) for p in plain_plans(*args, **kwargs)]

    path = tmp_path_factory.mktemp("models") / "q4_k_m.gguf"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(synthetic, "plan_tensors", q4_k_m)
        write_model(path, "tiny", seed=11)
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
    leftovers (a split's stages and their helpers refer to each other). With STRATA_TEST_MEMLOG
    set to a file, each GPU test's leftovers are written there (what is still allocated, which
    runners are still alive and what refers to them)."""
    yield
    if "gpu" not in request.keywords:
        return
    import gc
    import os
    import threading

    import torch

    gc.collect()
    if not torch.cuda.is_available():
        return
    torch.cuda.empty_cache()
    from strata_mgpu.stage.device import _LIVE

    for d in range(torch.cuda.device_count()):  # a budget whose stages are gone caps nobody
        device = torch.device("cuda", d)
        if not _LIVE.get(device):
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    path = os.environ.get("STRATA_TEST_MEMLOG")
    if path:
        from strata_mgpu.split.runner import SplitRunner
        from strata_mgpu.stage.stage import Stage

        live = [o for o in gc.get_objects() if isinstance(o, Stage | SplitRunner)]
        with open(path, "a") as log:
            mib = [torch.cuda.memory_allocated(d) >> 20 for d in range(torch.cuda.device_count())]
            log.write(f"{request.node.nodeid}: allocated MiB {mib}, threads {threading.active_count()}, "
                      f"live {[type(o).__name__ for o in live]}\n")
            for o in live[:2]:
                refs = [type(r).__name__ + (f" {getattr(r, '__qualname__', '')}" if callable(r) else "")
                        for r in gc.get_referrers(o) if r is not live]
                log.write(f"    {type(o).__name__} referred to by {refs[:8]}\n")
