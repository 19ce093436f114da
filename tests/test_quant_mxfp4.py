"""MXFP4 (gpt-oss's experts, issue #45) against ggml's own C, on every one of its 256 E8M0 scale
bytes: 0 and 1, which ggml decodes as subnormals, 253 to 255, whose largest weights overflow to
inf (255 is no NaN in ggml, nor here), and all between. The torch twin and the CUDA block decoder
(built for the host, rounding as the device does) equal ggml-python's `to_float` bit for bit; the
CUDA integer dot (q8_dot.cuh) equals fp64 sums of the twin's weights times 8-bit activations; the
synthetic writer's blocks read as ggml reads them; and a tiny model with MXFP4 experts, written by
`strata gen-model`, is served by a CPU stage as the reference forward computes it.

The other tests hold MXFP4 to the same bars as every type (tests/test_quant.py, test_blocks_host.py,
test_q8_dot.py, test_cpu_experts.py, test_quant_stage.py; on a GPU test_gpu_quant.py,
test_gpu_dense.py) on scales of fp16's magnitudes (tests/test_quant.py's E8M0_DRAWN).
"""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.cli import main
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import TensorPlan, make_tensor
from strata_mgpu.quant import block_format, dequantize_rows
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.test_blocks_host import HARNESS, build_host_lib
from tests.test_q8_dot import DP4A_SHIM, quantize_words
from tests.test_q8_dot import HARNESS as DOT_HARNESS
from tests.test_quant import assert_same_bits, fresh_seed
from tests.test_quant_iq import ggml_to_float

FMT = block_format(Q.MXFP4)
BLOCKS_A_SCALE = 8  # of which: codes all 0, all 1s (0xFF), every code in both nibbles, random
# from here on the integer dot's fp32 product d * sum q xq may overflow where the weights do not
# (2^(e - 128) * 32 * 12 * 127 >= 2^128); ggml-cuda's vec_dot_mxfp4_q8_1 multiplies the same way
DOT_FINITE_BELOW = 240


def every_scale_blocks(rng: np.random.Generator) -> np.ndarray:
    """[256 * BLOCKS_A_SCALE, 17] uint8: for each scale byte 0..255, blocks of edge and random codes."""
    codes = np.zeros((BLOCKS_A_SCALE, FMT.type_size - 1), np.uint8)
    codes[1] = 0xFF
    codes[2] = np.arange(16, dtype=np.uint8) * 17  # code k in both nibbles of byte k
    codes[3] = np.arange(16, dtype=np.uint8) | (np.arange(15, -1, -1, dtype=np.uint8) << 4)
    codes[4:] = rng.integers(0, 256, size=(BLOCKS_A_SCALE - 4, FMT.type_size - 1), dtype=np.uint8)
    scales = np.repeat(np.arange(256, dtype=np.uint8), BLOCKS_A_SCALE)[:, None]
    return np.concatenate([scales, np.tile(codes, (256, 1))], axis=1)


def ours(blocks: np.ndarray) -> np.ndarray:
    return dequantize_rows(torch.from_numpy(blocks.copy()), Q.MXFP4, FMT.block_size).numpy()


def test_ggml_lays_out_mxfp4_as_the_table_says():
    """32 weights a block, 17 bytes: ggml's type traits, gguf's sizes and ours agree (ggml_to_float
    checks), and the scale byte is the first (doubling it by one exponent step doubles every weight)."""
    rng = np.random.default_rng(fresh_seed())
    blocks = rng.integers(0, 256, size=(64, FMT.type_size), dtype=np.uint8)
    blocks[:, 0] = rng.integers(2, 250, size=64)
    up = blocks.copy()
    up[:, 0] += 1
    assert (FMT.block_size, FMT.type_size, FMT.e8m0_fields, FMT.f16_scales) == (32, 17, (0,), 0)
    assert np.array_equal(ggml_to_float(up, Q.MXFP4), 2 * ggml_to_float(blocks, Q.MXFP4))


def test_twin_equals_ggml_on_every_scale_byte():
    seed = fresh_seed()
    blocks = every_scale_blocks(np.random.default_rng(seed))
    with np.errstate(over="ignore"):
        want = ggml_to_float(blocks, Q.MXFP4)
        numpy_ref = gguf_quants.dequantize(blocks.reshape(1, -1), Q.MXFP4).reshape(-1, FMT.block_size)
    by_scale = want.reshape(256, -1)
    assert not np.isnan(want).any() and all(np.isinf(by_scale[e]).any() for e in (253, 254, 255))
    assert np.isfinite(by_scale[:253]).all()  # 12 * 2^(e - 128) < 2^128 up to e = 252
    assert by_scale[0][by_scale[0] > 0].min() == np.float32(2.0 ** -128)  # the subnormal half of 2^-127
    assert_same_bits(ours(blocks), want, f"MXFP4 on every scale byte, seed {seed}")
    assert_same_bits(numpy_ref.astype(np.float32), want, "gguf-py's MXFP4 against ggml's")


def test_twin_equals_ggml_on_blocks_gguf_quantizes():
    """gguf-py quantizes MXFP4 too (e = floor(log2 max|x|) - 2 + 127, nearest code): those blocks,
    from floats of magnitudes 1e-30 .. 1e30, read alike."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((512, 32)) * 10.0 ** rng.uniform(-30, 30, (512, 1))
    blocks = np.ascontiguousarray(gguf_quants.quantize(x.astype(np.float32), Q.MXFP4)).view(np.uint8)
    blocks = blocks.reshape(-1, FMT.type_size)
    assert_same_bits(ours(blocks), ggml_to_float(blocks, Q.MXFP4), f"MXFP4 quantized, seed {seed}")


@pytest.fixture(scope="module")
def host_decoders(tmp_path_factory):
    so = build_host_lib(tmp_path_factory.mktemp("mxfp4_blocks"), HARNESS)
    so.decode.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    return so


@pytest.fixture(scope="module")
def host_dots(tmp_path_factory):
    from tests.test_blocks_host import SHIM

    so = build_host_lib(tmp_path_factory.mktemp("mxfp4_dots"), DOT_HARNESS, SHIM + DP4A_SHIM)
    so.dots.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p]
    return so


@pytest.mark.parametrize("offset", [0, 1, 3])  # 17-byte blocks: at every alignment in turn anyway
def test_cuda_decoder_on_the_host_equals_ggml_on_every_scale_byte(host_decoders, offset):
    seed = fresh_seed()
    blocks = every_scale_blocks(np.random.default_rng(seed))
    room = np.zeros(blocks.nbytes + 8, dtype=np.uint8)
    room[offset:offset + blocks.nbytes] = blocks.reshape(-1)
    out = np.full(blocks.shape[0] * 32, np.nan, dtype=np.float32)
    assert host_decoders.decode(int(Q.MXFP4), room.ctypes.data + offset, blocks.shape[0], out.ctypes.data) == 0
    with np.errstate(over="ignore"):
        want = ggml_to_float(blocks, Q.MXFP4)
    assert_same_bits(out.reshape(-1, 32), want, f"MXFP4 CUDA decoder on every scale byte, seed {seed}")


def test_integer_dot_on_the_host_over_every_scale_byte(host_dots):
    """Each block's codes looked up as integers (table16_bytes) times 8-bit activations, times its
    scale: the fp64 sum of ggml's weights times the same activations, within fp32's rounding of
    the sums, on every scale byte below DOT_FINITE_BELOW (subnormal scales included)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    blocks = every_scale_blocks(rng)[:DOT_FINITE_BELOW * BLOCKS_A_SCALE]
    x = torch.from_numpy(rng.standard_normal(blocks.shape[0] * 32).astype(np.float32)).bfloat16()
    words, q, dx = quantize_words(x)
    got = np.full(blocks.shape[0], np.nan, dtype=np.float32)
    src = np.ascontiguousarray(blocks)
    assert host_dots.dots(int(Q.MXFP4), src.ctypes.data, words.ctypes.data, blocks.shape[0], got.ctypes.data) == 0
    terms = ggml_to_float(blocks, Q.MXFP4).astype(np.float64) * (q * dx[:, None].astype(np.float64))
    want, scale = terms.sum(1), np.abs(terms).sum(1)
    assert np.isfinite(got).all()
    assert np.all(np.abs(got - want) <= 1e-5 * scale + 2.0 ** -149), f"seed {seed}"
    assert np.all(got[0:BLOCKS_A_SCALE * DOT_FINITE_BELOW:BLOCKS_A_SCALE] == 0)  # codes all 0: +-0


def test_gen_model_blocks_decode_as_ggml_with_the_intended_spread():
    plan = TensorPlan("blk.0.ffn_gate_exps.weight", (4, 256, 512), Q.MXFP4, std=1 / np.sqrt(512))
    blocks = make_tensor(plan, seed=11).reshape(-1, FMT.type_size)
    want = ggml_to_float(blocks, Q.MXFP4)
    assert_same_bits(ours(blocks), want, "MXFP4 as gen-model writes it")
    w = want.astype(np.float64)
    assert np.isfinite(w).all() and 0.6 * plan.std < w.std() < 1.6 * plan.std, w.std()
    assert abs(w.mean()) < 0.02 * w.std()
    assert len(np.unique(blocks[:, 0])) > 1  # a scale a block, not one for the tensor


def test_gen_model_mxfp4_experts_are_served_as_the_reference_computes(tmp_path):
    """`strata gen-model --expert-type mxfp4` (gate, up and down: MXFP4 takes no other down by
    default, as gpt-oss's GGUFs have it) and a --mix with MXFP4 layers: a CPU stage's prefill and
    decode logits equal the reference forward's (experts dequantized to fp32) within fp32's
    rounding, as tests/test_quant_stage.py holds every type."""
    for name, extra in (("all.gguf", []), ("mix.gguf", ["--mix", "0-1:MXFP4/Q8_0"])):
        path = tmp_path / name
        r = CliRunner().invoke(main, ["gen-model", str(path), "--preset", "tiny", "--expert-type",
                                      "mxfp4" if not extra else "q4_0", *extra, "--seed", "3"])
        assert r.exit_code == 0, r.output
        f = GGUFFile(path)
        spec = spec_from_gguf(f)
        types = [tuple(f.tensor(f"blk.{i}.ffn_{kind}_exps.weight").ggml_type for kind in ("up", "down"))
                 for i in range(spec.n_layers)]
        assert types == ([(Q.MXFP4, Q.MXFP4)] * spec.n_layers if not extra else
                         [(Q.MXFP4, Q.Q8_0)] * 2 + [(Q.Q4_0, Q.Q8_0)] * (spec.n_layers - 2))
        ref = load_reference_runner(f, spec)
        stage = build_stage(f, spec, StageOptions(device=torch.device("cpu")))
        prompt = torch.randint(0, spec.vocab_size, (8,), generator=torch.Generator().manual_seed(fresh_seed()))
        kv_ref, kv_stage = ref.new_sequence(32), stage.new_sequence(32)
        a, b = ref.prefill(kv_ref, prompt), stage.prefill(kv_stage, prompt)
        for _ in range(3):
            assert torch.isfinite(b).all() and float((b - a).abs().max() / a.abs().max()) <= 1e-5, name
            token = torch.tensor([int(a.argmax())])
            a, b = ref.decode([kv_ref], token)[0], stage.decode([kv_stage], token)[0]
