"""The IQ grid types and the ternary ones (issue #30: IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S,
IQ3_XXS, IQ3_S, TQ1_0, TQ2_0) against ggml's own C: the torch twins (quant/dequant.py) equal
ggml-python's `to_float` (ggml's dequantize_row_*, built from source on install) bit for bit, NaN
for NaN, on random blocks with sensible scales, on blocks whose scales are fp16's edge values
and whose codes are all zeros or all ones, and on the blocks gen-model writes. The grids
(quant/grids.py) hold ggml's rows, and the CUDA header the block decoders read is the one they
generate."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.kernels import nvrtc
from strata_mgpu.model.synthetic import TensorPlan, make_tensor
from strata_mgpu.quant import block_format, dequantize, dequantize_rows, grids
from strata_mgpu.quant.formats import f16_scale_bits, set_f16_scale_bits
from tests.test_blocks_host import HARNESS, build_host_lib
from tests.test_quant import assert_same_bits, fresh_seed

IQ_TYPES = (Q.IQ1_S, Q.IQ1_M, Q.IQ2_XXS, Q.IQ2_XS, Q.IQ2_S, Q.IQ3_XXS, Q.IQ3_S, Q.TQ1_0, Q.TQ2_0)
# fp16 bit patterns at the edges: zeros, subnormals, the normal range's ends, infinities, NaNs
EDGE_F16 = (0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x3C00, 0xBC00, 0x7BFF, 0xFBFF, 0x7C00, 0xFC00, 0x7E00, 0xFE01)


def ggml_to_float(blocks: np.ndarray, ggml_type: Q) -> np.ndarray:
    """ggml's dequantization of [N, type_size] blocks: [N, block_size] float32."""
    ggml = pytest.importorskip("ggml", reason="ggml-python (the dev extra) is not installed")
    fmt = block_format(ggml_type)
    traits = ggml.ggml_get_type_traits(int(ggml_type)).contents
    assert (traits.type_name.decode(), traits.blck_size, traits.type_size) == \
        (ggml_type.name.lower(), fmt.block_size, fmt.type_size), "ggml numbers its types as gguf does"
    src = np.ascontiguousarray(blocks, dtype=np.uint8)
    out = np.full(src.shape[0] * fmt.block_size, np.nan, dtype=np.float32)
    traits.to_float(src.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                    out.size)
    return out.reshape(-1, fmt.block_size)


def ours(blocks: np.ndarray, ggml_type: Q) -> np.ndarray:
    n, fmt = blocks.shape[0], block_format(ggml_type)
    return dequantize_rows(torch.from_numpy(blocks.copy()), ggml_type, fmt.block_size).numpy().reshape(n, -1)


def with_scales(blocks: np.ndarray, ggml_type: Q, bits: np.ndarray) -> np.ndarray:
    """`blocks` with every fp16 scale of block i set to bits[i]."""
    fmt = block_format(ggml_type)
    out = blocks.copy()
    set_f16_scale_bits(fmt, out, np.repeat(bits.astype(np.uint16)[:, None], fmt.f16_scales, axis=1))
    return out


def sensible_f16(n: int, rng: np.random.Generator) -> np.ndarray:
    """[n] fp16 bit patterns of random sign and magnitude 1e-4 .. 10."""
    values = rng.choice([-1.0, 1.0], n) * 10.0 ** rng.uniform(-4, 1, n)
    return values.astype(np.float16).view(np.uint16)


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_twin_equals_ggml_on_random_blocks(ggml_type):
    """4,096 blocks of random codes: each grid's rows (2,048 at most) are drawn ~64 times or more."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fmt = block_format(ggml_type)
    codes = rng.integers(0, 256, size=(4096, fmt.type_size), dtype=np.uint8)
    blocks = with_scales(codes, ggml_type, sensible_f16(len(codes), rng))
    want = ggml_to_float(blocks, ggml_type)
    assert np.isfinite(want).all() and (want != 0).any()
    assert_same_bits(ours(blocks, ggml_type), want, f"{ggml_type.name}, seed {seed}")


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_twin_equals_ggml_at_the_edges(ggml_type):
    """Scales at fp16's edges (signed zeros, subnormals, 65504, infinities, NaNs: inf times a zero
    grid value is NaN in both) on random codes and on codes of all zeros and all ones (the
    smallest and largest sub-block scales, first and last grid rows, no and all signs)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fmt = block_format(ggml_type)
    codes = np.concatenate([np.zeros((1, fmt.type_size), np.uint8), np.full((1, fmt.type_size), 255, np.uint8),
                            rng.integers(0, 256, size=(6, fmt.type_size), dtype=np.uint8)])
    blocks = np.concatenate([with_scales(codes, ggml_type, np.full(len(codes), e)) for e in EDGE_F16])
    want = ggml_to_float(blocks, ggml_type)
    assert np.isnan(want).any() and np.isinf(want).any()  # the edges reached the weights
    assert_same_bits(ours(blocks, ggml_type), want, f"{ggml_type.name} at the edges, seed {seed}")


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_gen_model_blocks_decode_as_ggml_with_the_intended_spread(ggml_type):
    """The synthetic writer's blocks: ggml reads them as we do, finite, at the spread asked for,
    zero-mean; the ternary types' weights are -d, 0 or d, each about a third of them."""
    plan = TensorPlan("blk.0.ffn_gate_exps.weight", (4, 256, 512), ggml_type, std=1 / np.sqrt(512))
    raw = make_tensor(plan, seed=11)
    blocks = raw.reshape(-1, block_format(ggml_type).type_size)
    want = ggml_to_float(blocks, ggml_type)
    assert_same_bits(ours(blocks, ggml_type), want, f"{ggml_type.name} as gen-model writes it")
    w = want.astype(np.float64)
    assert np.isfinite(w).all() and 0.7 * plan.std < w.std() < 1.4 * plan.std, w.std()
    assert abs(w.mean()) < 0.02 * w.std()
    if ggml_type in (Q.TQ1_0, Q.TQ2_0):
        d = np.abs(w).max(axis=1, keepdims=True)  # a block's |d|: some weight of 256 is non-zero
        digits = np.rint(w / d).astype(int)
        assert np.array_equal(digits * d, w)
        assert all(0.3 < (digits == v).mean() < 0.37 for v in (-1, 0, 1))


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_scale_bits_are_where_ggml_reads_them(ggml_type):
    """set_f16_scale_bits writes the scale ggml reads (IQ1_M: its nibbles, the rest of those words
    kept): doubling it doubles every weight, and reading it back gives what was written."""
    rng = np.random.default_rng(fresh_seed())
    fmt = block_format(ggml_type)
    codes = rng.integers(0, 256, size=(64, fmt.type_size), dtype=np.uint8)
    one, two = (with_scales(codes, ggml_type, np.full(64, np.float16(v).view(np.uint16))) for v in (1.0, 2.0))
    assert np.array_equal(f16_scale_bits(fmt, two), np.full((64, fmt.f16_scales), 0x4000))
    scale_bytes = {at + k for at in fmt.scale_fields for k in (0, 1)} | {at + 1 for at in fmt.nibble_f16_fields}
    assert set(np.flatnonzero((one != codes).any(axis=0)).tolist()) <= scale_bytes
    for at in fmt.nibble_f16_fields:  # IQ1_M: the low 12 bits of each scale word are its 3-bit scales
        assert np.array_equal(one[:, at + 1] & 0x0F, codes[:, at + 1] & 0x0F)
    assert np.array_equal(ggml_to_float(two, ggml_type), 2 * ggml_to_float(one, ggml_type))


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    """cuda_src/ggml_blocks.cuh's decoders built for the host (tests/test_blocks_host.py says how)."""
    so = build_host_lib(tmp_path_factory.mktemp("iq_blocks"), HARNESS)
    so.decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    return so


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_cuda_decoders_on_the_host_equal_ggml_at_the_edges(host_decoders, ggml_type):
    """The CUDA block decoders (built for the host, rounding as the device does) against ggml's C
    on the edge blocks and random ones, one byte past an aligned address."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    fmt = block_format(ggml_type)
    codes = np.concatenate([np.zeros((1, fmt.type_size), np.uint8), np.full((1, fmt.type_size), 255, np.uint8),
                            rng.integers(0, 256, size=(30, fmt.type_size), dtype=np.uint8)])
    blocks = np.concatenate([with_scales(codes, ggml_type, sensible_f16(len(codes), rng)),
                             *(with_scales(codes[:8], ggml_type, np.full(8, e)) for e in EDGE_F16)])
    room = np.zeros(blocks.nbytes + 8, dtype=np.uint8)
    room[1:1 + blocks.nbytes] = blocks.reshape(-1)
    out = np.full(blocks.shape[0] * fmt.block_size, np.nan, dtype=np.float32)
    assert host_decoders.decode(int(ggml_type), room.ctypes.data + 1, out.size // 32, out.ctypes.data) == 0
    assert_same_bits(out.reshape(-1, fmt.block_size), ggml_to_float(blocks, ggml_type),
                     f"{ggml_type.name} CUDA decoder on the host, seed {seed}")


def test_grids_hold_ggml_rows():
    """Shapes, values and rows of ggml-common.h's tables (its first, second, middle and last rows)."""
    known = {  # name -> (rows, values, {row: word as ggml-common.h writes it})
        "iq2xxs_grid": (256, {8, 25, 43}, {0: 0x0808080808080808, 1: 0x080808080808082B, 128: 0x082B2B0808082B08,
                                            255: 0x2B2B2B1908081908}),
        "iq2xs_grid": (512, {8, 25, 43}, {1: 0x080808080808082B, 256: 0x190808080808192B, 511: 0x2B2B2B2B2B2B2B2B}),
        "iq2s_grid": (1024, {8, 25, 43}, {1: 0x080808080808082B, 512: 0x19080819082B1919, 1023: 0x2B2B2B2B2B2B2B2B}),
        "iq3xxs_grid": (256, {4, 12, 20, 28, 36, 44, 52, 62}, {0: 0x04040404, 1: 0x04040414, 128: 0x141C3E04,
                                                               255: 0x3E341C04}),
        "iq3s_grid": (512, set(range(1, 16, 2)), {1: 0x01010103, 256: 0x05090507, 511: 0x0F0F0101}),
        "iq1s_grid": (2048, {-1, 0, 1}, {0: 0xFFFFFFFFFFFFFFFF, 1: 0xFFFFFFFFFFFFFF01, 1024: 0x0000000000FF0100,
                                          2047: 0x0101010101010101}),
    }
    for name, (rows, values, words) in known.items():
        g = grids.grid(name)
        assert g.shape == (rows, grids.GRIDS[name][1]) and set(np.unique(g).tolist()) == values, name
        assert len({r.tobytes() for r in g}) == rows, f"{name}: rows repeat"
        got = grids.grid_words(name)
        assert {i: got[i] for i in words} == words, name


def test_ksigns_is_every_even_sign_pattern():
    """ksigns_iq2xs[i]: i with bit 7 the parity of i, so that every pattern has an even count of
    minus signs (what lets ggml store 8 signs in 7 bits)."""
    s = grids.ksigns().astype(int)
    assert [int(v) for v in s] == [i | (bin(i).count("1") & 1) << 7 for i in range(128)]


def test_cuda_header_is_the_generated_one():
    """cuda_src/iq_grids.cuh is what `python -m strata_mgpu.quant.grids` writes from the tables now."""
    assert (nvrtc.CUDA_SRC / "iq_grids.cuh").read_text() == grids.cuda_header()


def test_gen_model_writes_iq_experts(tmp_path):
    """`strata gen-model --expert-type IQ2_XXS --down-type IQ3_S` writes those types, served."""
    from strata_mgpu.cli import main
    from strata_mgpu.model.gguf_reader import GGUFFile

    out = tmp_path / "iq.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--preset", "tiny", "--expert-type", "IQ2_XXS",
                                  "--down-type", "IQ3_S", "--seed", "2"])
    assert r.exit_code == 0, r.output
    f = GGUFFile(out)
    for kind, t in (("gate", Q.IQ2_XXS), ("up", Q.IQ2_XXS), ("down", Q.IQ3_S)):
        info = f.tensor(f"blk.0.ffn_{kind}_exps.weight")
        assert info.ggml_type == t
        assert torch.isfinite(dequantize(f.tensor_data(info.name), t, info.shape)).all()
