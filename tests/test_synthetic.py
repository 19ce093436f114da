from __future__ import annotations

import hashlib

import numpy as np
import pytest
from gguf import quants as gguf_quants
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.quant import SUPPORTED_TYPES, dequantize


def digest(p) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def test_same_seed_same_file_other_seed_other_file(tmp_path):
    a, b, c = tmp_path / "a.gguf", tmp_path / "b.gguf", tmp_path / "c.gguf"
    write_model(a, "tiny", seed=5)
    write_model(b, "tiny", seed=5)
    write_model(c, "tiny", seed=6)
    assert digest(a) == digest(b) != digest(c)


@pytest.mark.parametrize("ggml_type", SUPPORTED_TYPES, ids=lambda t: t.name)
def test_every_type_writes_a_valid_model(tmp_path, ggml_type):
    p = tmp_path / f"{ggml_type.name}.gguf"
    write_model(p, "tiny", expert_type=ggml_type, down_type=ggml_type, seed=1)
    f = GGUFFile(p)
    spec = spec_from_gguf(f)
    for name in ("blk.0.ffn_gate_exps.weight", "blk.3.ffn_down_exps.weight"):
        info = f.tensor(name)
        assert info.ggml_type == ggml_type
        raw = f.tensor_data(name)
        ours = dequantize(raw, ggml_type, info.shape).numpy()
        ref = gguf_quants.dequantize(np.asarray(raw), ggml_type).reshape(info.shape)
        assert np.array_equal(ours, ref)
        # weights of the intended spread (1/sqrt(fan_in)) and about zero mean
        expected = 1 / np.sqrt(info.shape[-1])
        assert 0.5 * expected < ours.std() < 2 * expected, ours.std()
        assert abs(ours.mean()) < 0.6 * expected
    assert spec.n_experts == 8


@pytest.mark.parametrize("dense", [Q.F16, Q.BF16, Q.F32, Q.Q4_K])
def test_dense_types(tmp_path, dense):
    p = tmp_path / "m.gguf"
    write_model(p, "tiny", dense_type=dense, seed=2)
    f = GGUFFile(p)
    spec_from_gguf(f)
    assert f.tensor("blk.0.attn_q.weight").ggml_type == dense
