"""Every expert type gen-model writes, served end to end by a CPU stage: prefill and decode logits
equal the reference forward's (fp32 both: only the order of sums differs)."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.quant.formats import SUPPORTED_TYPES
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")
FP32_TOL = 1e-5  # max|diff| / max|ref|, as tests/test_stage.py
# (gate/up, down): every served type once (Q4_K twice: the types are odd in number), gate/up and
# down of two types as in llama.cpp's mixes and Unsloth's UD-IQ1_S / UD-IQ2_XXS ones (gate/up and
# down go through the same dequant, so each type on one side covers it).
PAIRS = [(Q.Q4_K, Q.Q6_K), (Q.Q5_K, Q.Q8_0), (Q.Q2_K, Q.Q3_K), (Q.IQ4_XS, Q.IQ4_NL), (Q.MXFP4, Q.BF16),
         (Q.Q4_0, Q.Q4_1), (Q.Q5_0, Q.Q5_1), (Q.F16, Q.F32), (Q.IQ1_S, Q.IQ2_XXS), (Q.IQ1_M, Q.IQ3_S),
         (Q.IQ2_XS, Q.IQ3_XXS), (Q.IQ2_S, Q.TQ1_0), (Q.TQ2_0, Q.Q4_K)]


def test_pairs_cover_every_served_type():
    served = [t for pair in PAIRS for t in pair]
    assert sorted(set(served)) == sorted(SUPPORTED_TYPES) and len(served) == len(SUPPORTED_TYPES) + 1


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("expert_type,down_type", PAIRS, ids=lambda t: t.name)
def test_stage_serves_every_expert_type(tmp_path, expert_type, down_type):
    path = tmp_path / "m.gguf"
    write_model(path, "tiny", expert_type=expert_type, down_type=down_type, seed=int(expert_type) + 100)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    assert stage.arena.layouts[0].gate_type == expert_type and stage.arena.layouts[0].down_type == down_type
    prompt = torch.randint(0, spec.vocab_size, (8,), generator=torch.Generator().manual_seed(int(expert_type)))
    kv_ref, kv_stage = ref.new_sequence(32), stage.new_sequence(32)
    a, b = ref.prefill(kv_ref, prompt), stage.prefill(kv_stage, prompt)
    assert torch.isfinite(b).all() and rel_err(b, a) <= FP32_TOL
    for _ in range(2):
        token = torch.tensor([int(a.argmax())])
        a, b = ref.decode([kv_ref], token)[0], stage.decode([kv_stage], token)[0]
        assert rel_err(b, a) <= FP32_TOL
