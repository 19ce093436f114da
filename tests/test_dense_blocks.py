"""A GPU stage's projections kept as the file's blocks (`kernels.dense`), on the CPU: which ones
`load_weights` keeps (`keeps_blocks`: the integer types dense_q8 dots), the VRAM they take against
what `strata info` previews, and the decoder's forward over them through a torch twin of
`DeviceDense` (dense_q8's rounding: 8-bit activations) against the float weights. The kernels
themselves: tests/test_gpu_dense.py."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.config import Placement
from strata_mgpu.engine.build import dense_layout_bytes, stage_options
from strata_mgpu.kernels.dense import DeviceDense, dense_reference, keeps_blocks
from strata_mgpu.model.decoder import Decoder, Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.model.weights import BlockMatrix, Matrix, load_weights
from strata_mgpu.stage.build import dense_storage_bytes, holds_blocks
from strata_mgpu.stage.memory_plan import dense_bytes

# max|diff| / max|ref|: fp32 everywhere but the projections' inputs, rounded to 8 bits a value
# (32 a scale) as dense_q8's are; the integer expert kernels' twin is held to the same on a GPU
Q8_INPUT_TOL = 3e-2


def bf16_layout(path) -> tuple[GGUFFile, object, object]:
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    return f, spec, load_weights(f, spec, dtype=torch.bfloat16, with_experts=False, blocks=keeps_blocks)


def test_q8_0_projections_stay_one_q_k_v_matrix(tiny_gguf):
    f, spec, w = bf16_layout(tiny_gguf)
    layer = w.layers[0]
    assert isinstance(layer.wqkv, BlockMatrix) and layer.wqkv.ggml_type == Q.Q8_0
    assert layer.wqkv.n == spec.q_dim + 2 * spec.kv_dim and layer.wqkv.k == spec.hidden
    assert isinstance(layer.wk, BlockMatrix)  # a view of wqkv's rows, not a copy
    assert layer.wk.raw.data_ptr() == layer.wqkv.raw.data_ptr() + spec.q_dim * layer.wqkv.raw.shape[1]
    assert isinstance(layer.wo, BlockMatrix) and isinstance(w.output, BlockMatrix)
    assert isinstance(w.embed, torch.Tensor) and w.embed.dtype == torch.bfloat16  # looked up by row: floats
    # the plan's line: the blocks, and a prompt's transient bf16 copy of one
    planned = dense_layout_bytes(f, spec, range(spec.n_layers), elem=2, blocks=True)
    assert planned == dense_storage_bytes(w) + DeviceDense.scratch_bytes
    assert dense_storage_bytes(w) < dense_bytes(spec, spec.n_layers, embed=True, head=True) * 0.8


def test_q4_k_m_types_keep_q_k_v_apart(q4_k_m_gguf):
    f, spec, w = bf16_layout(q4_k_m_gguf)
    layer = w.layers[1]
    assert layer.wqkv is None
    assert [m.ggml_type for m in (layer.wq, layer.wk, layer.wv, layer.wo)] == [Q.Q4_K, Q.Q4_K, Q.Q6_K, Q.Q4_K]
    assert isinstance(w.output, BlockMatrix) and w.output.ggml_type == Q.Q6_K
    planned = dense_layout_bytes(f, spec, range(spec.n_layers), elem=2, blocks=True)
    assert planned == dense_storage_bytes(w) + DeviceDense.scratch_bytes


def test_types_dense_q8_does_not_dot_stay_bf16(tmp_path):
    path = tmp_path / "f16.gguf"
    write_model(path, "tiny", dense_type=Q.F16, seed=3)
    f, spec, w = bf16_layout(path)
    layer = w.layers[0]
    assert isinstance(layer.wqkv, torch.Tensor) and isinstance(w.output, torch.Tensor) and not holds_blocks(w)
    assert layer.wq.data_ptr() == layer.wqkv.data_ptr()  # one matrix, as without blocks
    layers = range(spec.n_layers)
    assert dense_layout_bytes(f, spec, layers, elem=2, blocks=True) == dense_bytes(spec, spec.n_layers, embed=True,
                                                                                   head=True)
    assert dense_storage_bytes(w) == dense_bytes(spec, spec.n_layers, embed=True, head=True)


def test_keeps_blocks_needs_whole_blocks_and_an_integer_dot():
    assert keeps_blocks(Q.Q4_K, 2048) and keeps_blocks(Q.Q8_0, 96) and keeps_blocks(Q.Q6_K, 4096)
    assert not keeps_blocks(Q.Q4_K, 96)  # a K-quant block is 256 values
    assert not keeps_blocks(Q.Q3_K, 2048) and not keeps_blocks(Q.BF16, 2048) and not keeps_blocks(Q.IQ4_XS, 2048)
    assert not keeps_blocks(Q.Q8_0, 1 << 20)  # its quantized input would not fit the kernel's shared memory


def test_placement_carries_the_switch_to_every_stage():
    off = Placement(devices=("cpu",), dense_blocks=False)
    assert [o.switches.dense_blocks for o in stage_options(off, 512, 512, devices=[torch.device("cpu")] * 2)] == \
        [False] * 2
    assert all(o.switches.dense_blocks for o in stage_options(Placement(devices=("cpu",)), 512, 512,
                                                     devices=[torch.device("cpu")]))


class Q8InputTwin:
    """DeviceDense's arithmetic on the CPU: blocks times x rounded to 8 bits a value
    (dense_reference), counted; floats by torch."""

    def __init__(self):
        self.block_calls = 0

    def __call__(self, x: torch.Tensor, w: Matrix) -> torch.Tensor:
        if not isinstance(w, BlockMatrix):
            return x @ w.T
        self.block_calls += 1
        return dense_reference(x, w.raw, w.ggml_type).to(x.dtype)

    def many(self, x: torch.Tensor, ws: Sequence[Matrix]) -> list[torch.Tensor]:
        return [self(x, w) for w in ws]


def test_forward_over_blocks_matches_the_float_weights(q4_k_m_gguf):
    """A prompt and a decode step of the decoder over q4_k_m's blocks (q, k, v apart: `many`), in
    fp32 with the twin's 8-bit inputs, against the reference over the same weights dequantized."""
    f = GGUFFile(q4_k_m_gguf)
    spec = spec_from_gguf(f)
    ref = ReferenceModel(spec, load_weights(f, spec))
    twin = Q8InputTwin()
    blocks = load_weights(f, spec, blocks=keeps_blocks)
    model = Decoder(spec, blocks, ref.experts, dense=twin)
    prompt = torch.randint(0, spec.vocab_size, (12,), generator=torch.Generator().manual_seed(5))
    kv_ref, kv = ref.new_cache(32), model.new_cache(32)
    for tokens in (prompt, prompt[-1:]):
        want = ref.logits(ref.forward(tokens, [Segment(0, tokens.numel(), kv_ref)]))
        got = model.logits(model.forward(tokens, [Segment(0, tokens.numel(), kv)]))
        assert float((got - want).abs().max() / want.abs().max()) <= Q8_INPUT_TOL
    # a forward: q, k, v (apart) and o a layer, and the head
    assert twin.block_calls == 2 * (4 * spec.n_layers + 1)
