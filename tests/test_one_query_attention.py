"""A CPU decode step's attention (`model.ops.one_query_attention`): one query row over every key,
two batched products and a softmax, against torch's SDPA (what it replaces for one fp32 row on
the CPU: several times slower there) on fresh random inputs of the models' head layouts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strata_mgpu.model import ops

# max |diff| / max |sdpa|: fp32 both ways, the sums in another order
FP32_TOL = 1e-5


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    qh, kh, vh = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    return F.scaled_dot_product_attention(qh, kh, vh, enable_gqa=True)[0].transpose(0, 1)


@pytest.mark.parametrize("heads,kv_heads,head_dim,keys", [(32, 4, 128, 2), (32, 4, 128, 777), (64, 4, 128, 300),
                                                          (16, 16, 64, 50), (8, 2, 256, 1025)])
def test_one_query_equals_sdpa(heads, kv_heads, head_dim, keys):
    g = torch.Generator().manual_seed(heads * keys)
    q = torch.randn(1, heads, head_dim, generator=g)
    k, v = (3 * torch.randn(keys, kv_heads, head_dim, generator=g) for _ in range(2))
    want = sdpa(q, k, v)
    got = ops.one_query_attention(q, k, v)
    assert got.shape == want.shape
    assert float((got - want).abs().max() / want.abs().max()) <= FP32_TOL


def test_causal_attention_takes_it_for_one_fp32_row_on_the_cpu(monkeypatch):
    calls = []
    plain = ops.one_query_attention
    monkeypatch.setattr(ops, "one_query_attention", lambda *a: calls.append(a) or plain(*a))
    q, k, v = torch.randn(1, 8, 64), torch.randn(40, 2, 64), torch.randn(40, 2, 64)
    ops.causal_attention(q, k, v)
    assert len(calls) == 1
    ops.causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16())  # bf16 twins keep SDPA's fp32 accumulation
    ops.causal_attention(torch.randn(3, 8, 64), k, v)  # a chunk: the causal SDPA
    assert len(calls) == 1
