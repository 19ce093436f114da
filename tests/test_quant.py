"""Our dequantization (quant/dequant.py, torch) against `gguf.quants.dequantize`, block by block,
for every format: bit-exact fp32, on blocks `gguf.quants.quantize` made from random floats and on
random raw bytes (every bit pattern of a block is valid once its fp16 scales are finite)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.quant import SUPPORTED_TYPES, block_format, dequantize, dequantize_rows, parse_type
from strata_mgpu.quant.formats import (
    CUDA_DEQUANT_TYPES,
    FORMATS,
    FUSED_DECODE_TYPES,
    f16_scale_bits,
    set_f16_scale_bits,
)

# The types `gen-model` writes (strata_mgpu.cli gen-model's choices): all of them must be served.
GEN_MODEL_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K,
                   Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.MXFP4, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.IQ1_S,
                   Q.IQ1_M, Q.TQ1_0, Q.TQ2_0)


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs each run; printed on failure


# MXFP4's E8M0 scale bytes raw_blocks draws: 2^-24 .. 2^15 (d = 2^(e - 128)), fp16's magnitudes, so
# that every path's sums stay finite (an integer dot's d * sum q x overflows fp32 from e ~ 240 on,
# where the weights themselves do not). Every byte, the edges included: tests/test_quant_mxfp4.py.
E8M0_DRAWN = (104, 143)


def raw_blocks(ggml_type: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[N, type_size] random bytes, fp16 scale words made finite (any of them: tiny, huge, negative),
    E8M0 scale bytes within E8M0_DRAWN."""
    fmt = block_format(ggml_type)
    blocks = rng.integers(0, 256, size=(n_blocks, fmt.type_size), dtype=np.uint8)
    bits = f16_scale_bits(fmt, blocks)  # [N, scales]
    bits[(bits & 0x7C00) == 0x7C00] &= 0xBFFF  # inf/NaN exponent -> a finite one
    set_f16_scale_bits(fmt, blocks, bits)
    for at in fmt.e8m0_fields:
        blocks[:, at] = rng.integers(E8M0_DRAWN[0], E8M0_DRAWN[1] + 1, size=n_blocks)
    return blocks


def quantized_blocks(ggml_type: Q, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """[N, type_size] blocks gguf.quants made from random floats of random magnitudes."""
    fmt = block_format(ggml_type)
    x = (rng.standard_normal((n_blocks, fmt.block_size)) * rng.uniform(1e-3, 10, (n_blocks, 1))).astype(np.float32)
    q = gguf_quants.quantize(x, ggml_type)
    return np.ascontiguousarray(q).view(np.uint8).reshape(n_blocks, fmt.type_size)


def _gguf_quantizes(ggml_type: Q) -> bool:
    try:
        quantized_blocks(ggml_type, 1, np.random.default_rng(0))
    except NotImplementedError:  # gguf-py has no quantizer for the K- and IQ-quants
        return False
    return True


def assert_same_bits(got: np.ndarray, ref: np.ndarray, what: str) -> None:
    """[N, W] float32 each: equal bit patterns (any NaN matches any NaN); names the worst block."""
    nan = np.isnan(got) & np.isnan(ref)
    bad = (got.view(np.uint32) != ref.view(np.uint32)) & ~nan
    if bad.any():
        per_block = bad.sum(axis=1)
        worst = int(per_block.argmax())
        col = int(bad[worst].argmax())
        raise AssertionError(f"{what}: {int((per_block > 0).sum())} blocks differ; worst block {worst} "
                             f"({per_block[worst]} weights), weight {col}: ours {got[worst, col]!r} "
                             f"gguf {ref[worst, col]!r}")


def check_against_gguf(ggml_type: Q, blocks: np.ndarray, what: str) -> None:
    fmt = block_format(ggml_type)
    n = blocks.shape[0]
    with np.errstate(over="ignore"):  # MXFP4's largest exponents overflow to inf (test_quant_mxfp4.py)
        ref = gguf_quants.dequantize(blocks.reshape(1, -1), ggml_type).reshape(n, fmt.block_size)
    got = dequantize(blocks.reshape(1, -1), ggml_type, (n * fmt.block_size,)).numpy().reshape(n, fmt.block_size)
    assert got.dtype == np.float32
    assert_same_bits(got, ref, what)


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_dequantize_random_bytes_matches_gguf_quants(ggml_type):
    seed = fresh_seed()
    blocks = raw_blocks(ggml_type, 2048 // block_format(ggml_type).block_size * 16, np.random.default_rng(seed))
    check_against_gguf(ggml_type, blocks, f"{ggml_type.name} random bytes, seed {seed}")


@pytest.mark.parametrize("ggml_type", [t for t in SUPPORTED_TYPES if _gguf_quantizes(t)], ids=lambda t: t.name)
def test_dequantize_quantized_floats_matches_gguf_quants(ggml_type):
    seed = fresh_seed()
    blocks = quantized_blocks(ggml_type, 64, np.random.default_rng(seed))
    check_against_gguf(ggml_type, blocks, f"{ggml_type.name} quantized, seed {seed}")


def test_every_gen_model_type_is_served_on_every_path():
    assert set(GEN_MODEL_TYPES) == set(SUPPORTED_TYPES) == set(CUDA_DEQUANT_TYPES) == set(FUSED_DECODE_TYPES)
    assert all(f.torch_dequant for f in FORMATS.values())


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_rows_path_runs_on_torch_tensors(ggml_type):
    fmt = block_format(ggml_type)
    raw = raw_blocks(ggml_type, 4 * 3, np.random.default_rng(1)).reshape(3, 4 * fmt.type_size)
    got = dequantize_rows(torch.from_numpy(raw.copy()), ggml_type, 4 * fmt.block_size)
    with np.errstate(over="ignore"):
        ref = gguf_quants.dequantize(raw, ggml_type)
    assert got.shape == (3, 4 * fmt.block_size)
    assert_same_bits(got.numpy().reshape(12, -1), ref.astype(np.float32).reshape(12, -1), ggml_type.name)


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
    assert parse_type("iq4_xs") == Q.IQ4_XS
    with pytest.raises(ValueError, match="unknown tensor type"):
        parse_type("Q9_K")
    assert parse_type("iq2_xxs") == Q.IQ2_XXS
    with pytest.raises(ValueError, match="not supported"):
        parse_type("Q8_1")  # ggml's activation type: never a weight


def test_a_type_without_the_twin_fails_at_load_in_one_line(tiny_gguf, monkeypatch):
    """A format the table cannot serve is refused where a stage lays out its experts."""
    from dataclasses import replace

    from strata_mgpu.model.expert_layout import layer_layout
    from strata_mgpu.model.gguf_reader import GGUFFile
    from strata_mgpu.model.spec import spec_from_gguf
    from strata_mgpu.quant import formats

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    monkeypatch.setitem(formats.FORMATS, Q.Q6_K, replace(formats.FORMATS[Q.Q6_K], torch_dequant=False))
    with pytest.raises(ValueError, match=r"^tensor type Q6_K is not supported \(supported: [^\n]*\)$"):
        layer_layout(f, spec, 0)  # the tiny preset's experts: Q4_K gate/up, Q6_K down
