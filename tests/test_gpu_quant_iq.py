"""GPU checks of the IQ grid types and the ternary ones (marker `gpu`; skipped without CUDA): the
CUDA block decoders (dequant.cu, through ggml_blocks.cuh and its grids) bit-exact against the
torch twin, which tests/test_quant_iq.py holds to ggml's C, on the same edge blocks (fp16 edge
scales, codes all zeros and all ones) at every byte alignment; the twin on the GPU against itself
on the CPU; and a stage whose experts are of these types against the fp32 reference: a prompt
of whole layers (CUDA dequant, grouped GEMMs) and decode steps (the fused kernels' float path)
in bf16 on shared routing, and an fp32 prompt on free routing.

tests/test_gpu_quant.py runs these types too where it goes over every served type (the random-byte
dequant, and decode's fused kernels and the address gather for every type on each side)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.config import StageSwitches
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.quant import block_format, dequantize_rows
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from tests.test_gpu import BF16_Q8_TOL, BF16_TOL, _seg, _share_routing, rel_err
from tests.test_gpu_quant import same_bf16_bits
from tests.test_quant import assert_same_bits, fresh_seed
from tests.test_quant_iq import EDGE_F16, IQ_TYPES, sensible_f16, with_scales

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda", 0)


def edge_blocks(ggml_type: Q, rng: np.random.Generator) -> np.ndarray:
    """[N, type_size]: random codes at sensible scales, and codes of all zeros, all ones and random
    ones at each of fp16's edge values."""
    fmt = block_format(ggml_type)
    codes = rng.integers(0, 256, size=(64, fmt.type_size), dtype=np.uint8)
    codes[0], codes[1] = 0, 255
    edges = [with_scales(codes[:8], ggml_type, np.full(8, e)) for e in EDGE_F16]
    return np.concatenate([with_scales(codes, ggml_type, sensible_f16(len(codes), rng)), *edges])


@pytest.mark.parametrize("offset", [0, 1, 2, 3])  # the blocks at every alignment a byte offset gives
@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_cuda_dequant_equals_twin_at_the_edges(kernels, ggml_type, offset):
    seed = fresh_seed()
    blocks = edge_blocks(ggml_type, np.random.default_rng(seed))
    n = blocks.shape[0] * block_format(ggml_type).block_size
    room = np.zeros(blocks.nbytes + 8, dtype=np.uint8)
    room[offset:offset + blocks.nbytes] = blocks.reshape(-1)
    src = torch.from_numpy(room).to(CUDA)[offset:]
    got = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=CUDA)  # poisoned
    before = kernels.paths["dequant:cuda"]
    kernels.dequant(src, ggml_type, 1, n, 0, got)
    want = torch.empty(n, dtype=torch.bfloat16)
    TorchKernels().dequant(torch.from_numpy(blocks.reshape(-1).copy()), ggml_type, 1, n, 0, want)  # on the CPU
    torch.cuda.synchronize()
    assert kernels.paths["dequant:cuda"] == before + 1  # the kernel ran, not the twin
    ok, at = same_bf16_bits(got.cpu(), want)
    assert ok, f"seed {seed}: {ggml_type.name} differs first at weight {at} (block {at // 256})"
    assert bool(want.isnan().any()) and bool(want.isinf().any())  # the edges were there to compare


@pytest.mark.parametrize("ggml_type", IQ_TYPES, ids=lambda t: t.name)
def test_twin_on_the_gpu_equals_the_twin_on_the_cpu(ggml_type):
    """The twin dequantizes dense weights where they go (weights.load_weights) and runs the fp32
    stage's experts: on the GPU its fp32 results are the CPU's, bit for bit."""
    seed = fresh_seed()
    blocks = torch.from_numpy(edge_blocks(ggml_type, np.random.default_rng(seed)))
    cpu = dequantize_rows(blocks, ggml_type, 256)
    gpu = dequantize_rows(blocks.to(CUDA), ggml_type, 256)
    assert gpu.device.type == "cuda"
    assert_same_bits(gpu.cpu().numpy(), cpu.numpy(), f"{ggml_type.name} on the GPU, seed {seed}")


# (gate/up, down): every type of IQ_TYPES on one side, as Unsloth's UD mixes pair them
STAGE_PAIRS = [(Q.IQ1_S, Q.IQ2_XXS), (Q.IQ1_M, Q.IQ3_S), (Q.IQ2_XS, Q.IQ3_XXS), (Q.IQ2_S, Q.TQ1_0),
               (Q.TQ2_0, Q.IQ2_XXS)]


def test_stage_pairs_cover_the_types():
    assert {t for pair in STAGE_PAIRS for t in pair} == set(IQ_TYPES)


@pytest.mark.parametrize("types", STAGE_PAIRS, ids=lambda t: f"{t[0].name}-{t[1].name}")
def test_stage_with_iq_experts_matches_reference(tmp_path, types):
    """The tiny model with experts of `types` (dense Q8_0): in bf16 on the GPU against the fp32
    reference on the CPU, routing shared (bf16 flips a pick now and then; sharing leaves only the
    arithmetic to bound), a prompt of whole layers then decode steps, through the CUDA paths the
    counters name; and in fp32 on the GPU (the twin dequantizing there) on free routing."""
    path = tmp_path / "iq.gguf"
    write_model(path, "tiny", expert_type=types[0], down_type=types[1], seed=int(types[0]) + 7)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CUDA, max_vram_gib=8,
                                              switches=StageSwitches(cuda_graphs=False)))  # the hooks sync
    assert (stage.arena.layouts[0].gate_type, stage.arena.layouts[0].down_type) == types
    _share_routing(stage, ref)
    n = stage.experts.gather_picks // spec.n_experts_used + 8  # past the gather limit: whole layers
    prompt = torch.randint(0, spec.vocab_size, (n,), generator=torch.Generator().manual_seed(int(types[1])))
    kv_r, kv_s = ref.new_sequence(n + 8), stage.new_sequence(n + 8)
    b = stage.model.logits(stage.model.forward(prompt.to(CUDA), [_seg(kv_s, n)]))
    a = ref.model.logits(ref.model.forward(prompt, [_seg(kv_r, n)]))
    assert torch.isfinite(b).all() and rel_err(b.cpu(), a) <= BF16_TOL
    paths = stage.kernels.paths
    assert paths["dequant:cuda"] + paths["dequant_addressed:cuda"] > 0 and paths["dequant:torch"] == 0, \
        stage.kernels.path_summary()
    fused = paths["moe_gathered:fused"]
    for _ in range(4):  # decode: the fused kernels' float path (no integer dot for these types)
        token = torch.tensor([int(a[-1].argmax())])
        b = stage.decode([kv_s], token)
        a = ref.decode([kv_r], token)
        assert rel_err(b.cpu(), a) <= BF16_Q8_TOL
    assert paths["moe_gathered:fused"] == fused + 4 * spec.n_layers, stage.kernels.path_summary()
    assert paths["moe_gathered:twin"] == 0, stage.kernels.path_summary()

    stage32 = build_stage(f, spec, StageOptions(device=CUDA, dtype=torch.float32))
    ref.model.routing = None  # free routing again
    a = ref.model.logits(ref.model.forward(prompt, [_seg(ref.new_sequence(n), n)]))
    b = stage32.model.logits(stage32.model.forward(prompt.to(CUDA), [_seg(stage32.new_sequence(n), n)])).cpu()
    assert rel_err(b, a) <= 1e-3  # fp32 both: summation order only
    assert torch.equal(a.argmax(-1), b.argmax(-1))
