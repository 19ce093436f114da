"""GPU checks of the q8_0 KV cache's kernels (marker `gpu`; skipped without CUDA): `qk_norm_rope_kv`
quantizing into Q8_0 caches and `attn_split` dequantizing them in its tile loads, against their
torch twins (`model.ops.DecodeOps`), for q8_0 keys, values or both, on fresh random inputs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.ops import DecodeOps, rope_cos_sin
from strata_mgpu.model.synthetic import PRESETS
from tests.test_gpu import CUDA, OPS_TOL, _fresh_generator, rel_err

pytestmark = pytest.mark.gpu
TYPES = [(Q.Q8_0, Q.Q8_0), (Q.Q8_0, Q.BF16), (Q.BF16, Q.Q8_0)]
# the kernel's normed and rotated keys are within OPS_TOL of the twin's (tests/test_gpu.py), and
# quantizing moves a value by at most one step of its block's max / 127
Q8_KEY_TOL = OPS_TOL + 1 / 127


@pytest.fixture(scope="module", params=TYPES, ids=lambda t: f"k_{t[0].name}_v_{t[1].name}")
def typed_ops(request):
    from strata_mgpu.kernels.decode_ops import CudaDecodeOps

    return CudaDecodeOps(CUDA, kv_types=request.param), request.param


def random_caches(spec, capacities, types, g, layers=2) -> list[KVCache]:
    """Caches of random cells (Q8_0 ones as valid blocks of random values)."""
    caches = []
    for cap in capacities:
        kv = KVCache(layers, spec.n_kv_heads, spec.head_dim, capacity=cap, max_length=cap, device=CUDA,
                     dtype=torch.bfloat16, keys=types[0], values=types[1])
        f = kv.format
        for t, cells in ((f.keys, kv.k), (f.values, kv.v)):
            x = torch.randn(layers, cap, spec.n_kv_heads, spec.head_dim, device=CUDA, generator=g)
            cells.copy_(f.store(t, x.to(torch.bfloat16)))
        caches.append(kv)
    return caches


@pytest.mark.parametrize("preset,rows", [("tiny", 1), ("30b-a3b", 3)])
def test_q8_qk_norm_rope_kv_equals_twin(typed_ops, preset, rows):
    ops, types = typed_ops
    spec = PRESETS[preset].spec(preset)
    g, seed = _fresh_generator()
    H, Hkv, Dh, cap = spec.n_heads, spec.n_kv_heads, spec.head_dim, 512
    w = SimpleNamespace(q_norm=(1 + 0.1 * torch.randn(Dh, device=CUDA, generator=g)).to(torch.bfloat16),
                        k_norm=(1 + 0.1 * torch.randn(Dh, device=CUDA, generator=g)).to(torch.bfloat16))
    q, k, v = (torch.randn(rows, n * Dh, device=CUDA, generator=g).to(torch.bfloat16) for n in (H, Hkv, Hkv))
    positions = torch.randperm(cap, device=CUDA, generator=g)[:rows]
    cos, sin = rope_cos_sin(positions, spec, torch.bfloat16)
    outs = []
    for impl in (ops, DecodeOps()):
        kvs = random_caches(spec, [cap] * rows, types, torch.Generator(device=CUDA).manual_seed(seed))
        outs.append((impl.qk_norm_rope_kv(spec, w, 1, q.clone(), k, v, positions, cos, sin, kvs), kvs))
    (q_got, kvs_got), (q_want, kvs_want) = outs
    assert ops.paths["qk_norm_rope_kv:cuda"] > 0 and ops.paths["qk_norm_rope_kv:twin"] == 0, ops.paths
    assert rel_err(q_got, q_want) <= OPS_TOL, f"seed {seed}"
    for got, want in zip(kvs_got, kvs_want, strict=True):
        f = got.format
        assert torch.equal(got.v, want.v), f"seed {seed}"  # a copy of v, quantized alike: the same bytes
        assert rel_err(f.load(f.keys, got.k), f.load(f.keys, want.k)) <= Q8_KEY_TOL, f"seed {seed}"
        assert int((got.k != want.k).any(dim=(2, 3)).sum()) <= 1  # one cell of one layer written


@pytest.mark.parametrize("heads,kv_heads,head_dim,capacities", [(32, 4, 128, [300, 4096, 64, 20000]),
                                                                (24, 2, 64, [256, 1000]), (32, 2, 256, [700])])
def test_q8_attention_equals_twin(typed_ops, heads, kv_heads, head_dim, capacities):
    """Each row against its own Q8_0 cache up to its own position: the kernel's tile loads
    dequantize as the twin's load does (fp32 d q, rounded to bf16), so the bf16 tolerance holds."""
    from strata_mgpu.kernels.decode_ops import attention_split

    ops, types = typed_ops
    spec = SimpleNamespace(n_heads=heads, n_kv_heads=kv_heads, head_dim=head_dim)
    g, seed = _fresh_generator()
    kvs = random_caches(spec, capacities, types, g)
    edges = [None, attention_split(max(capacities)), 0, capacities[-1] - 1]
    positions = torch.tensor([int(torch.randint(0, cap, (1,), generator=g, device=CUDA)) if e is None
                              else min(e, cap - 1) for cap, e in zip(capacities, edges, strict=False)], device=CUDA)
    q = torch.randn(len(capacities), heads, head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    before = ops.paths["attention:cuda"]
    got, want = ops.attention(1, q, positions, kvs), DecodeOps().attention(1, q, positions, kvs)
    assert ops.paths["attention:cuda"] == before + 1, ops.paths
    assert rel_err(got, want) <= OPS_TOL, f"seed {seed}, positions {positions.tolist()}"


def test_q8_caches_in_other_ops_go_to_the_twin():
    """Ops built for bf16 caches send a Q8_0 cache to the twin (counted), never misread it."""
    from strata_mgpu.kernels.decode_ops import CudaDecodeOps

    ops = CudaDecodeOps(CUDA)
    spec = PRESETS["tiny"].spec("tiny")
    g, _ = _fresh_generator()
    kvs = random_caches(spec, [64], (Q.Q8_0, Q.Q8_0), g)
    q = torch.randn(1, spec.n_heads, spec.head_dim, device=CUDA, generator=g).to(torch.bfloat16)
    positions = torch.tensor([10], device=CUDA)
    assert torch.equal(ops.attention(1, q, positions, kvs), DecodeOps().attention(1, q, positions, kvs))
    assert ops.paths["attention:twin"] == 1
