"""Our dequantization against gguf.quants, block by block, for every supported format."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.synthetic import TensorPlan, make_tensor
from strata_mgpu.quant import SUPPORTED_TYPES, block_format, dequantize, dequantize_rows, parse_type
from strata_mgpu.quant.dequant import has_torch_kernel


def random_blocks(ggml_type: Q, n_blocks: int, seed: int) -> np.ndarray:
    """Random, valid blocks: random bits with finite fp16 scales (the synthetic writer's recipe)."""
    fmt = block_format(ggml_type)
    plan = TensorPlan(f"probe.{seed}", (n_blocks * fmt.block_size,), ggml_type, std=0.02)
    return np.ascontiguousarray(make_tensor(plan, seed)).view(np.uint8).reshape(1, -1)


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf_quants(ggml_type):
    fmt = block_format(ggml_type)
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs each run; printed on failure
    raw = random_blocks(ggml_type, 97, seed)
    ref = gguf_quants.dequantize(raw, ggml_type).reshape(97, fmt.block_size)
    got = dequantize(raw, ggml_type, (97 * fmt.block_size,)).numpy().reshape(97, fmt.block_size)
    assert np.isfinite(ref).all()
    bad = np.abs(got - ref).max(axis=1)
    worst = int(bad.argmax())
    assert bad[worst] == 0.0, f"seed {seed}: block {worst} differs by {bad[worst]} ({fmt.name})"


@pytest.mark.parametrize("ggml_type", [t for t in SUPPORTED_TYPES if has_torch_kernel(t)], ids=lambda t: t.name)
def test_rows_path_runs_on_torch_tensors(ggml_type):
    fmt = block_format(ggml_type)
    raw = random_blocks(ggml_type, 4 * 3, 1).reshape(3, 4 * fmt.type_size)
    got = dequantize_rows(torch.from_numpy(raw.copy()), ggml_type, 4 * fmt.block_size)
    ref = gguf_quants.dequantize(raw, ggml_type)
    assert got.shape == (3, 4 * fmt.block_size)
    assert torch.equal(got, torch.from_numpy(ref.astype(np.float32)))


def test_expert_slice_of_3d_tensor(tiny_gguf):
    from strata_mgpu.model.gguf_reader import GGUFFile

    f = GGUFFile(tiny_gguf)
    info = f.tensor("blk.1.ffn_down_exps.weight")
    whole = dequantize(f.tensor_data(info.name), info.ggml_type, info.shape)
    for e in (0, 5):
        one = dequantize(f.tensor_data(info.name)[e], info.ggml_type, info.shape[1:])
        assert torch.equal(one, whole[e])


def test_parse_type():
    assert parse_type("q4_k") == Q.Q4_K
    with pytest.raises(ValueError, match="unknown tensor type"):
        parse_type("Q9_K")
    with pytest.raises(ValueError, match="not supported"):
        parse_type("IQ2_XXS")
