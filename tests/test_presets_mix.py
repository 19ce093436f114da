"""gen-model's presets, `--layers`, `--mix` (experts' types by layer, as Unsloth's mixes vary
them, served end to end by a CPU stage), `strata info`'s quant mix and RoPE scaling, and split
files: served under the model's name, a later shard refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.cli import gen_model, main
from strata_mgpu.config import ServerConfig
from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.info import OTHER, TENSOR_CLASSES, TypeCount, model_info, tensor_class
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS, mix_option, plan_tensors, preset_spec, write_model
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")
FP32_TOL = 1e-5  # as tests/test_quant_stage.py: fp32 both, only the order of sums differs


def test_235b_a22b_has_qwen3_235b_a22b_shapes():
    p = PRESETS["235b-a22b"]
    assert (p.n_layers, p.hidden, p.n_heads, p.n_kv_heads, p.head_dim) == (94, 4096, 64, 4, 128)
    assert (p.n_experts, p.n_experts_used, p.expert_ffn, p.vocab_size) == (128, 8, 1536, 151936)
    assert (p.context_length, p.rope_base, p.rms_eps, p.tied_output) == (40960, 1e6, 1e-6, False)
    spec = preset_spec("235b-a22b")
    assert spec.n_params == pytest.approx(235e9, rel=0.01)
    assert spec.n_active_params == pytest.approx(22e9, rel=0.02)
    assert spec.expert_ffn * spec.n_experts_used == 12288  # the feed_forward_length written: its config's


def test_24_layers_of_235b_are_38_gb_of_q4k_q6k_experts():
    spec = preset_spec("235b-a22b", layers=24)
    assert spec.n_layers == 24 and spec.hidden == 4096
    experts = sum(p.nbytes for p in plan_tensors(spec, Q.Q4_K, Q.Q6_K, Q.Q8_0) if "_exps." in p.name)
    assert experts == pytest.approx(37.6e9, rel=0.01)


def test_gen_model_offers_every_preset():
    [preset] = [p for p in gen_model.params if p.name == "preset"]
    assert sorted(preset.type.choices) == sorted(PRESETS)


@pytest.mark.parametrize("text, n_layers, want", [
    ("0-3:Q6_K,4-:Q4_K", 6, {0: (Q.Q6_K, Q.Q6_K), 1: (Q.Q6_K, Q.Q6_K), 2: (Q.Q6_K, Q.Q6_K), 3: (Q.Q6_K, Q.Q6_K),
                            4: (Q.Q4_K, Q.Q6_K), 5: (Q.Q4_K, Q.Q6_K)}),  # down by default as --expert-type pairs it
    ("1:q8_0/q4_k, 3-3:IQ4_XS", 4, {1: (Q.Q8_0, Q.Q4_K), 3: (Q.IQ4_XS, Q.IQ4_XS)}),
])
def test_mix_option(text, n_layers, want):
    assert mix_option(text, n_layers) == want


@pytest.mark.parametrize("text, message", [
    ("0-3Q4_K", "give FIRST[-[LAST]]:GATE_UP[/DOWN]"), ("3-1:Q4_K", "layers 3-1 are not within"),
    ("0-4:Q4_K", "layers 0-4 are not within the model's 0-3"), ("0-2:Q4_K,2:Q6_K", "layer 2 is named twice"),
    ("0:Q9", "unknown tensor type 'Q9'"),
])
def test_bad_mix_is_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        mix_option(text, 4)


def test_gen_model_layers_and_mix_and_info(tmp_path):
    out = tmp_path / "m.gguf"
    r = CliRunner().invoke(main, ["gen-model", str(out), "--preset", "small", "--layers", "3", "--mix",
                                  "0:Q8_0/Q8_0,1-1:Q6_K", "--rope-scaling", "yarn:4:2048"])
    assert r.exit_code == 0, r.output
    f = GGUFFile(out)
    spec = spec_from_gguf(f)
    assert spec.n_layers == 3 and spec.context_length == 8192 and spec.rope_scaling.original_context == 2048
    types = [tuple(f.tensor(f"blk.{i}.ffn_{k}_exps.weight").ggml_type for k in ("gate", "up", "down"))
             for i in range(3)]
    assert types == [(Q.Q8_0, Q.Q8_0, Q.Q8_0), (Q.Q6_K, Q.Q6_K, Q.Q6_K), (Q.Q4_K, Q.Q4_K, Q.Q6_K)]
    mi = model_info(f)
    assert mi.quant_mix["experts gate"] == {"Q8_0": TypeCount(1, f.tensor("blk.0.ffn_gate_exps.weight").nbytes),
                                            "Q6_K": TypeCount(1, f.tensor("blk.1.ffn_gate_exps.weight").nbytes),
                                            "Q4_K": TypeCount(1, f.tensor("blk.2.ffn_gate_exps.weight").nbytes)}
    assert set(mi.quant_mix["experts down"]) == {"Q8_0", "Q6_K"} and mi.quant_mix["experts down"]["Q6_K"].tensors == 2
    assert mi.quant_mix["attention"] == {"Q8_0": TypeCount(12, sum(
        f.tensor(f"blk.{i}.attn_{k}.weight").nbytes for i in range(3) for k in ("q", "k", "v", "output")))}
    assert mi.quant_mix["router"]["F32"].tensors == 3 and mi.quant_mix["norms"]["F32"].tensors == 3 * 4 + 1
    assert list(mi.quant_mix) == [c for c in TENSOR_CLASSES if c in mi.quant_mix]  # every tensor classed, in order
    assert sum(c.nbytes for types in mi.quant_mix.values() for c in types.values()) == mi.tensor_bytes
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0, r.output
    assert re.search(r"RoPE scaling\s+yarn x4 of 2,048, betas 32/1 \(cos/sin x1\.139\)", r.output), r.output
    assert "quant mix by tensor class" in r.output and re.search(r"experts down\s*│\s*Q6_K\s*│\s*2 ", r.output)


def test_tensor_classes():
    assert tensor_class("blk.12.ffn_down_exps.weight") == "experts down"
    assert tensor_class("blk.0.attn_k_norm.weight") == "norms"
    assert tensor_class("blk.3.ffn_up_shexp.weight") == "dense FFN / shared"
    assert tensor_class("token_embd.weight") == "embeddings" and tensor_class("output.weight") == "output"
    assert tensor_class("blk.1.mystery.weight") == OTHER


def test_a_stage_serves_experts_of_other_types_layer_by_layer(tmp_path):
    """A per-layer mix (Q8_0, Q6_K and Q4_K/Q6_K experts of different sizes) through the CPU stage's
    arena, slots and kernels' twins: the reference forward's logits, prefill and decode."""
    path = tmp_path / "mix.gguf"
    write_model(path, "tiny", seed=21, mix=mix_option("0:Q8_0,1-2:Q6_K/Q8_0", 4))
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    layouts = stage.arena.layouts
    assert [(layouts[i].gate_type, layouts[i].down_type) for i in range(4)] == [
        (Q.Q8_0, Q.Q8_0), (Q.Q6_K, Q.Q8_0), (Q.Q6_K, Q.Q8_0), (Q.Q4_K, Q.Q6_K)]
    assert len({lay.expert_bytes for lay in layouts.values()}) == 3
    prompt = torch.randint(0, spec.vocab_size, (12,), generator=torch.Generator().manual_seed(21))
    kv_ref, kv_stage = ref.new_sequence(64), stage.new_sequence(64)
    a, b = ref.prefill(kv_ref, prompt), stage.prefill(kv_stage, prompt)
    assert rel_err(b, a) <= FP32_TOL
    for _ in range(3):
        token = torch.tensor([int(a.argmax())])
        a, b = ref.decode([kv_ref], token)[0], stage.decode([kv_stage], token)[0]
        assert rel_err(b, a) <= FP32_TOL


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("file, alias, name", [
    ("models/Qwen3-235B-A22B-Q4_K_M-00001-of-00003.gguf", None, "Qwen3-235B-A22B-Q4_K_M"),
    ("Qwen3-30B-A3B-Q4_K_M.gguf", None, "Qwen3-30B-A3B-Q4_K_M"),
    ("m-1-of-3.gguf", None, "m-1-of-3"),  # not llama.cpp's shard suffix
    ("m-00001-of-00003.gguf", "mine", "mine"),
])
def test_a_split_model_serves_under_its_name(file, alias, name):
    assert ServerConfig(model_path=Path(file), alias=alias).model_name == name


def test_a_later_shard_is_refused_in_one_line(tmp_path):
    write_model(tmp_path / "m.gguf", "tiny", seed=3, split_max_bytes=2_000_000)
    shards = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(shards) >= 3
    with pytest.raises(GGUFError, match=re.escape(f"this is shard 2 of {len(shards)} of a split model: give the "
                                                  f"first, m-00001-of-{len(shards):05d}.gguf")):
        GGUFFile(shards[1])
    f = GGUFFile(shards[0])  # the first holds the metadata, the tensors are spread over all
    assert {info.shard for info in f.tensors.values()} == set(range(len(shards)))
    assert spec_from_gguf(f).n_layers == 4
