from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q
from gguf.constants import LlamaFileType

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import file_type, write_model
from strata_mgpu.quant import SUPPORTED_TYPES, dequantize


def digest(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_seed_same_file_other_seed_other_file(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_model(a, "tiny", seed=5)
    write_model(b, "tiny", seed=5)
    write_model(c, "tiny", seed=6)
    assert digest(a) == digest(b) != digest(c)


def test_tensors_made_ahead_on_threads_write_the_same_file(tmp_path, monkeypatch):
    """Tensors made on a thread pool ahead of the writer (bounded by AHEAD_BYTES, here small enough
    that the window fills and drains) give the file one thread gives."""
    from strata_mgpu.model import synthetic

    monkeypatch.setattr(synthetic, "AHEAD_BYTES", 1 << 20)
    one, many = tmp_path / "one.gguf", tmp_path / "many.gguf"
    written = []
    write_model(one, "small", seed=5, workers=1)
    write_model(many, "small", seed=5, workers=3, on_tensor=lambda name, nbytes: written.append(name))
    assert digest(one) == digest(many)
    plans = synthetic.plan_tensors(synthetic.PRESETS["small"].spec("x"), Q.Q4_K, Q.Q6_K, Q.Q8_0)
    assert written == [p.name for p in plans]  # in order, each once


# |mean| / std of a file's dequantized weights, per kind of tensor. Random codes are not zero-mean
# (Q4_0 -0.10, IQ4_NL -0.083, Q5_0 -0.054 before the scales got a random sign); what is left is
# sampling noise, under 0.01 on these ~10^6 weights.
MEAN_BOUND = 0.02


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_type_writes_a_valid_zero_mean_model(tmp_path, ggml_type):
    p = tmp_path / f"{ggml_type.name}.gguf"
    write_model(p, "tiny", expert_type=ggml_type, down_type=ggml_type, dense_type=ggml_type, seed=1)
    f = GGUFFile(p)
    spec = spec_from_gguf(f)
    assert f.get("general.file_type") == file_type(ggml_type, ggml_type)
    experts, dense = [], []
    for layer in range(spec.n_layers):
        for kind in ("gate", "up", "down"):
            name = f"blk.{layer}.ffn_{kind}_exps.weight"
            info = f.tensor(name)
            assert info.ggml_type == ggml_type
            raw = f.tensor_data(name)
            ours = dequantize(raw, ggml_type, info.shape).numpy()
            if layer in (0, 3):  # our dequant against gguf's on the writer's blocks
                ref = gguf_quants.dequantize(np.asarray(raw), ggml_type).reshape(info.shape)
                assert np.array_equal(ours, ref)
            expected = 1 / np.sqrt(info.shape[-1])  # the intended spread: 1/sqrt(fan_in)
            assert 0.5 * expected < ours.std() < 2 * expected, (name, ours.std())
            experts.append(ours.reshape(-1))
        for kind in ("attn_q", "attn_output"):
            info = f.tensor(f"blk.{layer}.{kind}.weight")
            dense.append(dequantize(f.tensor_data(info.name), ggml_type, info.shape).numpy().reshape(-1))
    embd = f.tensor("token_embd.weight")
    for what, w in (("experts", np.concatenate(experts)), ("attention", np.concatenate(dense)),
                    ("token_embd", dequantize(f.tensor_data(embd.name), ggml_type, embd.shape).numpy())):
        w = w.astype(np.float64)
        assert abs(w.mean()) < MEAN_BOUND * w.std(), f"{ggml_type.name} {what}: mean {w.mean() / w.std():+.4f} std"
    assert spec.n_experts == 8


@pytest.mark.parametrize("expert,down,want", [
    (Q.Q4_K, Q.Q6_K, LlamaFileType.MOSTLY_Q4_K_M), (Q.Q4_K, Q.Q4_K, LlamaFileType.MOSTLY_Q4_K_S),
    (Q.Q5_K, Q.Q6_K, LlamaFileType.MOSTLY_Q5_K_M), (Q.Q3_K, Q.Q4_K, LlamaFileType.MOSTLY_Q3_K_M),
    (Q.Q3_K, Q.Q3_K, LlamaFileType.MOSTLY_Q3_K_S), (Q.Q2_K, Q.Q3_K, LlamaFileType.MOSTLY_Q2_K),
    (Q.Q8_0, Q.Q8_0, LlamaFileType.MOSTLY_Q8_0), (Q.Q4_0, Q.Q8_0, LlamaFileType.MOSTLY_Q4_0),
    (Q.MXFP4, Q.MXFP4, LlamaFileType.MOSTLY_MXFP4_MOE), (Q.BF16, Q.BF16, LlamaFileType.MOSTLY_BF16),
    (Q.F32, Q.F32, LlamaFileType.ALL_F32), (Q.IQ4_XS, Q.IQ4_XS, LlamaFileType.MOSTLY_IQ4_XS),
])
def test_file_type_names_the_expert_types(expert, down, want):
    assert file_type(expert, down) == want


def test_every_supported_type_has_a_file_type():
    for t in SUPPORTED_TYPES:
        assert file_type(t, t) != LlamaFileType.GUESSED


def test_written_file_type_follows_the_default_down(tmp_path):
    p = tmp_path / "m.gguf"
    write_model(p, "tiny", expert_type=Q.Q8_0, seed=1)
    assert GGUFFile(p).get("general.file_type") == LlamaFileType.MOSTLY_Q8_0


@pytest.mark.parametrize("dense", [Q.F16, Q.BF16, Q.F32, Q.Q4_K])
def test_dense_types(tmp_path, dense):
    p = tmp_path / "m.gguf"
    write_model(p, "tiny", dense_type=dense, seed=2)
    f = GGUFFile(p)
    spec_from_gguf(f)
    assert f.tensor("blk.0.attn_q.weight").ggml_type == dense
