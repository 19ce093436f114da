"""A GPU stage's projections kept as the file's blocks (`kernels.dense.DeviceDense`): the kernel
paths against their twins on fresh random blocks of every type dense_q8 dots, and a stage keeping
blocks against one holding bf16 copies (STRATA_DENSE_BLOCKS=0) on shared routing. Which
projections are kept, and the forward over them on the CPU: tests/test_dense_blocks.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.config import StageSwitches
from strata_mgpu.kernels import dense
from strata_mgpu.kernels.dense import DeviceDense, dense_reference, rows_a_launch, w_rows_a_warp
from strata_mgpu.kernels.experts import Q8_DOT_TYPES
from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.weights import BlockMatrix
from strata_mgpu.quant.dequant import dequantize_rows
from strata_mgpu.quant.formats import block_format
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.test_gpu import _share_routing
from tests.test_gpu_quant import FUSED_TOL, rel_err
from tests.test_quant import fresh_seed, raw_blocks

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)
# the dequantizing path against x @ (W dequantized by torch, rounded to bf16): the same bf16
# weights where the kernel rounds as torch does; fp32 sums of the GEMM in another order
DEQUANT_TOL = 1e-2
# a stage's logits with its projections' inputs rounded to 8 bits a value (dense_q8) against bf16
# copies on shared routing: the expert kernels' BF16_Q8_TOL (tests/test_gpu.py) for each of the two
BLOCKS_TOL = 6e-2


def random_matrix(ggml_type, n: int, k: int, rng: np.random.Generator) -> BlockMatrix:
    fmt = block_format(ggml_type)
    raw = raw_blocks(ggml_type, n * k // fmt.block_size, rng).view(np.uint8).reshape(n, -1)
    return BlockMatrix(torch.from_numpy(raw.copy()).to(CUDA), ggml_type, k)


@pytest.mark.parametrize("k,rows", [(512, 1), (512, 3), (512, 5), (512, 8), (512, 9), (4096, 8), (8192, 5)])
@pytest.mark.parametrize("ggml_type", sorted(Q8_DOT_TYPES), ids=lambda t: t.name)
def test_device_dense_against_its_twins(kernels, ggml_type, k, rows, monkeypatch):
    """Up to one launch's rows (`rows_a_launch`): dense_q8, held to dense_reference, with up to 4
    rows of W a warp (a card of one multiprocessor, here, gives a warp the most) over 101 rows
    (the last warp's rows past the end); more: the dequantized copy's GEMM, held to torch's
    dequantization and GEMM."""
    monkeypatch.setattr(kernels, "multiprocessors", 1)
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    w = random_matrix(ggml_type, 101, k, rng)
    x = torch.from_numpy(rng.standard_normal((rows, k)).astype(np.float32)).to(CUDA).bfloat16()
    before = dict(kernels.paths)
    got = DeviceDense(kernels)(x, w)
    if rows <= rows_a_launch(k):
        assert w_rows_a_warp(rows, 101, 1) == {1: 1, 3: 2, 5: 4, 8: 4}[rows]
        want, tol, path = dense_reference(x, w.raw, ggml_type), FUSED_TOL, "dense:q8"
    else:
        wf = dequantize_rows(w.raw.cpu(), ggml_type, k).to(CUDA).bfloat16()
        want, tol, path = x @ wf.T, DEQUANT_TOL, "dense:dequant"
    torch.cuda.synchronize()
    assert got.shape == (rows, 101) and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
    assert rel_err(got, want) <= tol, f"{ggml_type.name}, seed {seed}"
    assert kernels.paths[path] == before.get(path, 0) + 1


@pytest.mark.parametrize("rows", [3, 20])
def test_many_quantizes_once_and_equals_one_at_a_time(kernels, rows, monkeypatch):
    """q, k, v of three types (a Q4_K_M file's) in one `many`: each result equal to its own call
    (past one launch's rows: through slices of a few rows' copy, made small here)."""
    monkeypatch.setattr(dense, "DENSE_SCRATCH_VALUES", 32 * 256)  # 32 rows of K = 256 a slice
    rng = np.random.default_rng(fresh_seed())
    k = 256
    ws = [random_matrix(t, n, k, rng) for t, n in ((Q.Q4_K, 128), (Q.Q4_K, 64), (Q.Q6_K, 80))]
    x = torch.randn(rows, k, device=CUDA).bfloat16()
    mm = DeviceDense(kernels)
    calls = []
    quantize = kernels._quantize_q8
    monkeypatch.setattr(kernels, "_quantize_q8", lambda t: calls.append(t) or quantize(t))
    together = mm.many(x, ws)
    assert len(calls) == (1 if rows <= rows_a_launch(k) else 0)
    for got, w in zip(together, ws, strict=True):
        alone = mm(x, w)
        assert got.shape == (rows, w.n)
        if rows <= rows_a_launch(k):
            assert torch.equal(got, alone)
        else:  # sliced against the whole copy: the same bf16 weights, GEMMs of other shapes
            wf = dequantize_rows(w.raw.cpu(), w.ggml_type, k).to(CUDA).bfloat16()
            assert rel_err(got, x @ wf.T) <= DEQUANT_TOL


@pytest.mark.parametrize("which", ["tiny_gguf", "q4_k_m_gguf"])
def test_stage_keeping_blocks_matches_bf16_copies_on_shared_routing(which, request):
    """Two stages of one file, one keeping its projections and head as blocks, one with bf16 copies;
    the first picks each layer's experts as the second did. A prompt through whole layers (the
    dequantized copies), 20 and 6 tokens on the row path (copies; dense_q8), each followed by
    decode steps (dense_q8): logits within BLOCKS_TOL. The blocks take less VRAM."""
    f = GGUFFile(request.getfixturevalue(which))
    spec = spec_from_gguf(f)
    opts = StageOptions(device=CUDA, max_vram_gib=8,
                        switches=StageSwitches(cuda_graphs=False))  # the routing hooks sync
    plain = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8,
                                              switches=StageSwitches(cuda_graphs=False, dense_blocks=False)))
    blocks = build_stage(f, spec, opts)
    assert isinstance(blocks.model.w.output, BlockMatrix) and isinstance(plain.model.w.output, torch.Tensor)
    assert blocks.report.dense_bytes < 0.8 * plain.report.dense_bytes
    _share_routing(plain, blocks)  # each forward runs on `plain` first, then on `blocks`
    g = torch.Generator().manual_seed(fresh_seed())
    for n in (plain.experts.gather_picks // spec.n_experts_used + 8, 20, 6):
        prompt = torch.randint(0, spec.vocab_size, (n,), generator=g)
        kv_p, kv_b = plain.new_sequence(n + 8), blocks.new_sequence(n + 8)
        a = plain.model.logits(plain.model.forward(prompt.to(CUDA), [Segment(0, n, kv_p)]))
        b = blocks.model.logits(blocks.model.forward(prompt.to(CUDA), [Segment(0, n, kv_b)]))
        assert rel_err(b, a) <= BLOCKS_TOL, n
        for _ in range(3):
            token = torch.tensor([int(a[-1].argmax())])
            a, b = plain.decode([kv_p], token), blocks.decode([kv_b], token)
            assert rel_err(b, a) <= BLOCKS_TOL, n
    paths = blocks.kernels.paths
    assert paths["dense:q8"] > 0 and paths["dense:dequant"] > 0
    assert plain.kernels.paths["dense:q8"] == plain.kernels.paths["dense:dequant"] == 0
