"""RoPE scaling (`{arch}.rope.scaling.*`): YaRN and linear files written by gen-model, read as
llama.cpp reads them, and the oracle's forward against transformers' Qwen3-MoE with the same
`rope_parameters` at positions past the original context; the frequencies against llama.cpp's
`rope_yarn` formula; malformed and unknown scalings refused in one line."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
import pytest
import torch
from gguf.constants import RopeScalingType

from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFError, GGUFFile
from strata_mgpu.model.ops import DecodeOps, rope_cos_sin, rope_inv_freq
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import NO_ROPE_SCALING, RopeScaling, spec_from_gguf
from strata_mgpu.model.synthetic import PRESETS, preset_spec, rope_option, write_model
from strata_mgpu.model.weights import load_weights
from tests.forward_checks import TOL, hf_step, rel_err
from tests.hf_oracle import hf_qwen3moe

CPU = torch.device("cpu")
ORIGINAL = 64  # the original context of the test files: positions past it are cheap


@pytest.fixture(scope="module", params=["yarn:4:64", "linear:4:64"])
def scaled(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("rope") / "m.gguf"
    write_model(path, "tiny", seed=11, rope=rope_option(request.param, PRESETS["tiny"].context_length))
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    w = load_weights(f, spec)
    return ReferenceModel(spec, w), hf_qwen3moe(spec, w), w


def test_gen_model_writes_the_scaling_and_the_stretched_context(scaled):
    ours, _, _ = scaled
    r = ours.spec.rope_scaling
    assert r.original_context == ORIGINAL and r.beta_fast == 32 and r.beta_slow == 1 and r.attn_factor == 1
    assert (r.kind, r.factor) in ((RopeScalingType.YARN, 4.0), (RopeScalingType.LINEAR, 4.0))
    assert ours.spec.context_length == r.factor * ORIGINAL  # a scaled file's context: factor x the original
    assert ours.spec == dataclasses.replace(preset_spec("tiny", rope=r), rms_eps=ours.spec.rms_eps)  # float32


@torch.no_grad()
def test_scaled_forward_matches_transformers_past_the_original_context(scaled):
    """A prompt of 150 (past the original 64) in two chunks, then decode steps by the ordinary
    forward and by the capturable step, against transformers' model with its cache."""
    ours, hf, _ = scaled
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(0, ours.spec.vocab_size, (150,), generator=g)
    kv, kv_static = ours.new_cache(ours.spec.context_length, capacity=32), ours.new_cache(ours.spec.context_length,
                                                                                          capacity=256)
    logits = torch.cat([ours.prefill(prompt[:90], kv), ours.prefill(prompt[90:], kv)])
    ours.prefill(prompt, kv_static)
    ref, cache = hf_step(hf, prompt[None], None)
    errors = [rel_err(logits, ref)]
    nxt = ref[-1].argmax()
    for _ in range(4):
        step = ours.prefill(nxt[None], kv)
        kv_static.reserve(1)
        static = ours.step_static(nxt[None], torch.tensor([kv_static.length]), [kv_static])
        kv_static.advance(1)
        ref, cache = hf_step(hf, nxt[None, None], cache)
        errors += [rel_err(step, ref), rel_err(static, ref)]
        nxt = ref[-1].argmax()
    print(f"{ours.spec.rope_scaling.kind.value}: max relative error against transformers {max(errors):.2e}")
    assert max(errors) <= TOL
    assert kv.length == 154 > ORIGINAL


@torch.no_grad()
def test_the_comparison_sees_the_scaling(scaled):
    """The same weights without the file's scaling are far from transformers' scaled model, so the
    test above checks the scaling and not only the rest of the forward."""
    ours, hf, w = scaled
    plain = ReferenceModel(dataclasses.replace(ours.spec, rope_scaling=NO_ROPE_SCALING), w)
    prompt = torch.randint(0, ours.spec.vocab_size, (120,), generator=torch.Generator().manual_seed(4))
    ref, _ = hf_step(hf, prompt[None], None)
    assert rel_err(plain.prefill(prompt, plain.new_cache(256)), ref) > 1000 * TOL


@torch.no_grad()
def test_packed_rows_rotate_at_their_own_positions(scaled):
    """Two sequences at different lengths in one forward: each row's table is its own position's."""
    ours, _, _ = scaled
    V = ours.spec.vocab_size
    a, b = torch.randint(0, V, (100,)), torch.randint(0, V, (20,))
    kv_a, kv_b = ours.new_cache(256), ours.new_cache(256)
    ours.prefill(a, kv_a), ours.prefill(b, kv_b)
    step = torch.tensor([5, 9])
    both = ours.logits(ours.forward(step, [Segment(0, 1, kv_a), Segment(1, 2, kv_b)]))
    kv_a2, kv_b2 = ours.new_cache(256), ours.new_cache(256)
    ours.prefill(a, kv_a2), ours.prefill(b, kv_b2)
    assert rel_err(both[0], ours.prefill(step[:1], kv_a2)[0]) <= 1e-5
    assert rel_err(both[1], ours.prefill(step[1:], kv_b2)[0]) <= 1e-5


def llama_cpp_rope(spec, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """cos, sin and the angles [T, Dh/2] as ggml's rope_yarn computes them (ggml-cpu ops.cpp, in float64 here):
    theta_extrap = p * base^(-i0/n_dims), theta_interp = freq_scale * theta_extrap, the ramp
    rope_yarn_ramp(corr_dims, i0) mixing them (ext_factor 1 for YaRN, 0 otherwise), and the
    magnitude: llama-context's yarn_attn_factor (get_mscale(factor) / (1 + 0.1 ln factor) times
    rope.scaling.attn_factor) times the kernel's 1 + 0.1 ln(1 / freq_scale)."""
    r, n_dims, base = spec.rope_scaling, spec.head_dim, spec.rope_base
    freq_scale = 1 / r.factor
    ext = 1.0 if r.kind == RopeScalingType.YARN else 0.0

    def corr_dim(n_rot: float) -> float:
        return n_dims * math.log(r.original_context / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    i0 = np.arange(0, n_dims, 2, dtype=np.float64)
    low, high = (max(0, math.floor(corr_dim(r.beta_fast))), min(n_dims - 1, math.ceil(corr_dim(r.beta_slow)))) \
        if ext else (0, 0)
    theta_extrap = positions[:, None] * base ** (-i0 / n_dims)
    theta_interp = freq_scale * theta_extrap
    ramp_mix = (1 - np.clip((i0 / 2 - low) / max(0.001, high - low), 0, 1)) * ext
    theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
    attn = r.attn_factor
    if ext:
        get_mscale = 1.0 if r.factor <= 1 else 0.1 * math.log(r.factor) + 1.0
        attn *= get_mscale / (1.0 + 0.1 * math.log(r.factor)) * (1.0 + 0.1 * math.log(1.0 / freq_scale))
    return np.cos(theta) * attn, np.sin(theta) * attn, theta


@pytest.mark.parametrize("scaling", [
    RopeScaling(RopeScalingType.YARN, 4.0, 32768),  # Qwen3's model cards: 32K -> 128K
    RopeScaling(RopeScalingType.YARN, 8.0, 4096, attn_factor=0.9, beta_fast=16.0, beta_slow=2.0),
    RopeScaling(RopeScalingType.LINEAR, 2.0, 40960),
    NO_ROPE_SCALING,
], ids=lambda r: f"{r.kind.value}-{r.factor:g}")
def test_tables_equal_llama_cpp_rope_yarn(scaling):
    """The real 235B-A22B shapes (head 128, base 1e6) at positions up to the stretched context."""
    spec = dataclasses.replace(PRESETS["235b-a22b"].spec("x"), rope_scaling=scaling)
    positions = np.array([0, 1, 63, 4095, 40959, 100_000, 131_071], dtype=np.float64)
    cos, sin = rope_cos_sin(torch.tensor(positions, dtype=torch.int64), spec, torch.float32)  # [T, Dh]
    want_cos, want_sin, theta = llama_cpp_rope(spec, positions)
    half = spec.head_dim // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])  # NEOX
    # fp32, as both llama.cpp and transformers compute them: a frequency within a few ulp, its
    # angle at position p within p times that (5e-3 rad at 131,071 for the fastest)
    bound = 1e-6 + 4e-7 * theta * scaling.mscale
    assert (np.abs(cos[:, :half].double().numpy() - want_cos) <= bound).all()
    assert (np.abs(sin[:, :half].double().numpy() - want_sin) <= bound).all()
    got_freq = rope_inv_freq(spec, CPU).double().numpy()
    assert np.allclose(got_freq, llama_cpp_rope(spec, np.array([1.0]))[2][0], rtol=4e-7, atol=0)


def test_yarn_mixes_kept_and_divided_frequencies():
    r = RopeScaling(RopeScalingType.YARN, 4.0, 32768)
    spec = dataclasses.replace(PRESETS["30b-a3b"].spec("x"), rope_scaling=r)
    low, high = r.correction_range(spec.head_dim, spec.rope_base)
    got = rope_inv_freq(spec, CPU)
    plain = rope_inv_freq(dataclasses.replace(spec, rope_scaling=NO_ROPE_SCALING), CPU)
    assert 0 < low < high < spec.head_dim // 2  # Qwen3's 32K: a ramp inside the head
    assert torch.equal(got[:low], plain[:low])  # fast frequencies kept
    assert torch.allclose(got[high:], plain[high:] / 4, rtol=1e-6)  # slow ones divided by the factor
    assert r.mscale == pytest.approx(1 + 0.1 * math.log(4))


# -- reading the keys ------------------------------------------------------------------------

def _with_keys(src, dst, **keys):
    """`src` rewritten with the rope.scaling keys given (None: dropped)."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    r = GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    full = {f"{arch}.rope.{k.replace('__', '.')}": v for k, v in keys.items()}
    w = GGUFWriter(dst, arch)
    for key, field in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in full:
            continue
        w.add_key_value(key, field.contents(), field.types[0],
                        sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, v in full.items():
        if v is not None:
            w.add_key_value(key, v, GGUFValueType.STRING if isinstance(v, str) else GGUFValueType.FLOAT32
                            if isinstance(v, float) else GGUFValueType.UINT32)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=t.data.shape, raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


@pytest.mark.parametrize("keys, want", [
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=1024),
     RopeScaling(RopeScalingType.YARN, 4.0, 1024)),
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__yarn_beta_fast=16.0, scaling__yarn_beta_slow=2.0,
          scaling__attn_factor=0.5),
     RopeScaling(RopeScalingType.YARN, 4.0, 4096, attn_factor=0.5, beta_fast=16.0, beta_slow=2.0)),  # orig: context
    (dict(scaling__factor=2.0), RopeScaling(RopeScalingType.LINEAR, 2.0, 4096)),  # no type: linear, as llama.cpp
    (dict(scale_linear=2.0), RopeScaling(RopeScalingType.LINEAR, 2.0, 4096)),  # the factor's old key
    (dict(scaling__type="none", scaling__factor=8.0), NO_ROPE_SCALING),  # none scales nothing
    (dict(scaling__type="yarn", scaling__factor=0.0), NO_ROPE_SCALING),  # factor 0 is 1
    (dict(scaling__type="linear", scaling__attn_factor=2.0), RopeScaling(attn_factor=2.0)),
])
def test_scaling_keys_read_as_llama_cpp_reads_them(tiny_gguf, tmp_path, keys, want):
    spec = spec_from_gguf(GGUFFile(_with_keys(tiny_gguf, tmp_path / "k.gguf", **keys)))
    assert spec.rope_scaling == want


@pytest.mark.parametrize("keys, message", [
    (dict(scaling__type="longrope", scaling__factor=4.0),
     "metadata 'qwen3moe.rope.scaling.type' = 'longrope' is not supported (supported: none, linear, yarn)"),
    (dict(scaling__type="dynamic", scaling__factor=4.0), "= 'dynamic' is not supported"),
    (dict(scaling__type="yarn", scaling__factor=-4.0), "'qwen3moe.rope.scaling.factor' = -4.0 must be positive"),
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__yarn_beta_fast=0.0),
     "'qwen3moe.rope.scaling.yarn_beta_fast' = 0.0 must be positive"),
    (dict(scaling__type="yarn", scaling__factor=4.0, scaling__original_context_length=0),
     "'qwen3moe.rope.scaling.original_context_length' = 0 must be positive"),
])
def test_bad_scaling_is_refused_at_load_in_one_line(tiny_gguf, tmp_path, keys, message):
    path = _with_keys(tiny_gguf, tmp_path / "bad.gguf", **keys)
    with pytest.raises(GGUFError, match=re.escape(message)) as e:
        spec_from_gguf(GGUFFile(path))
    assert "\n" not in str(e.value) and str(path) in str(e.value)


def test_an_unknown_scaling_is_one_line_from_strata_info(tiny_gguf, tmp_path):
    from click.testing import CliRunner

    from strata_mgpu.cli import main

    path = _with_keys(tiny_gguf, tmp_path / "bad.gguf", scaling__type="longrope", scaling__factor=4.0)
    r = CliRunner().invoke(main, ["info", str(path)])
    assert r.exit_code == 1 and "'longrope' is not supported" in r.output and "Traceback" not in r.output
    assert len(r.output.strip().splitlines()) == 1


@pytest.mark.parametrize("text, message", [
    ("yarn", "give none, linear:FACTOR"), ("rope:4", "give none"), ("none:2", "give none"),
    ("yarn:x:64", "FACTOR is a number"), ("yarn:1:64", "FACTOR must be above 1"), ("yarn:4:0", "ORIGINAL at least 1"),
    ("yarn:4:64:1", "give none"),
])
def test_bad_rope_options_are_refused(text, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        rope_option(text, 4096)


def test_rope_option_defaults_the_original_to_the_preset_context():
    assert rope_option("yarn:4", 40960) == RopeScaling(RopeScalingType.YARN, 4.0, 40960)
    assert rope_option(" None ", 40960) == NO_ROPE_SCALING
    spec = preset_spec("30b-a3b", rope=rope_option("yarn:4:32768", 40960))
    assert spec.context_length == 131072 and spec.rope_scaling.original_context == 32768


@pytest.mark.parametrize("preset", ["tiny", "tiny-hybrid"])
def test_the_fused_rotation_reads_the_tables_it_is_given(monkeypatch, preset):
    """qk_norm_rope_kv launches with the host's cos/sin (where the scaling lives) and the dims they
    rotate (all of a head, or tiny-hybrid's first 16 of 64), its arguments those of the kernel in
    decode_ops.cu; tables of another shape take the twin. (The kernel's result against the twin,
    YaRN and a partial rotation included, is tests/test_gpu.py's.)"""
    from types import SimpleNamespace

    from strata_mgpu.kernels import decode_ops as DO
    from strata_mgpu.kernels import nvrtc
    from strata_mgpu.kernels.paths import PathCounter
    from strata_mgpu.model.kv_cache import KVCache

    spec = preset_spec(preset, rope=rope_option("yarn:4:64", 4096))
    assert (spec.rotary_dim < spec.head_dim) == (preset == "tiny-hybrid")
    ops = DO.CudaDecodeOps.__new__(DO.CudaDecodeOps)  # no CuPy, no device: only the launch arithmetic
    ops.device, ops.paths = CPU, PathCounter()
    launches = []
    monkeypatch.setattr(DO.CudaDecodeOps, "_ok", staticmethod(lambda *t: True))
    monkeypatch.setattr(DO.CudaDecodeOps, "_rows_ok", staticmethod(lambda t: True))
    monkeypatch.setattr(ops, "kv_table", lambda kvs: torch.zeros(len(kvs), DO.KV_TABLE_COLUMNS, dtype=torch.int64))
    monkeypatch.setattr(ops, "_launch", lambda name, grid, block, *args, shared_mem=0:
                        launches.append((name, grid, block, args)))
    n, dh = 3, spec.head_dim
    w = SimpleNamespace(q_norm=torch.ones(dh, dtype=torch.bfloat16), k_norm=torch.ones(dh, dtype=torch.bfloat16))
    q, k, v = (torch.randn(n, h * dh).to(torch.bfloat16) for h in (spec.n_heads, spec.n_kv_heads, spec.n_kv_heads))
    positions = torch.tensor([70, 3, 200])
    kvs = [KVCache(2, spec.n_kv_heads, dh, capacity=256, max_length=256, device=CPU, dtype=torch.bfloat16)
           for _ in range(n)]
    cos, sin = rope_cos_sin(positions, spec, torch.bfloat16)
    ops.qk_norm_rope_kv(spec, w, 1, q, k, v, positions, cos, sin, kvs)
    [(name, grid, block, args)] = launches
    sig = re.search(r"void qk_norm_rope_kv_row\((.*?)\)\s*{", nvrtc.cuda_source(DO.OPS_FILE), re.S)
    params = [p.split()[-1].lstrip("*") for p in sig.group(1).split(",")]
    assert name == "qk_norm_rope_kv" and len(args) == len(params) and "base" not in params
    assert args[params.index("cos_table")] == cos.data_ptr() and args[params.index("sin_table")] == sin.data_ptr()
    assert args[params.index("positions")] == positions.data_ptr() and grid == (spec.n_heads + 2 * spec.n_kv_heads, n)
    assert cos.shape == (n, spec.rotary_dim) and args[params.index("R")] == spec.rotary_dim
    twin = []
    monkeypatch.setattr(DecodeOps, "qk_norm_rope_kv", lambda self, *a: twin.append(a))
    ops.qk_norm_rope_kv(spec, w, 1, q, k, v, positions, cos[:2], sin[:2], kvs)  # two rows' tables for three
    assert len(launches) == 1 and len(twin) == 1 and ops.paths["qk_norm_rope_kv:twin"] == 1
