"""The reference forward against Hugging Face transformers' Qwen3-MoE on the same weights."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.weights import load_weights
from tests.forward_checks import assert_decode_matches_hf, rel_err
from tests.hf_oracle import hf_qwen3moe


@pytest.fixture(scope="module")
def models(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    w = load_weights(f, spec)
    return ReferenceModel(spec, w), hf_qwen3moe(spec, w)


@torch.no_grad()
def test_prefill_and_decode_match_transformers(models):
    ours, hf = models
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    prompt = torch.randint(0, ours.spec.vocab_size, (57,), generator=g)
    kv, _ = assert_decode_matches_hf(ours, hf, prompt)  # small capacity: decode grows the cache
    assert kv.length == 57 + 6


@torch.no_grad()
def test_chunked_prefill_and_batched_decode_equal_one_shot(models):
    """Prefill in two chunks, and decode two sequences in one batch: same logits as alone."""
    ours, _ = models
    V = ours.spec.vocab_size
    a, b = torch.randint(0, V, (40,)), torch.randint(0, V, (23,))
    kv_a = ours.new_cache(256)
    whole = ours.prefill(a, kv_a)
    kv_c = ours.new_cache(256)
    first = ours.prefill(a[:25], kv_c)
    second = ours.prefill(a[25:], kv_c)
    assert rel_err(torch.cat([first, second]), whole) <= 1e-5
    kv_b = ours.new_cache(256)
    ours.prefill(b, kv_b)
    step = torch.tensor([5, 9])
    batched = ours.logits(ours.forward(step, [Segment(0, 1, kv_a), Segment(1, 2, kv_b)]))
    alone_a = ours.prefill(step[:1], kv_c)
    kv_b2 = ours.new_cache(256)
    ours.prefill(b, kv_b2)
    alone_b = ours.prefill(step[1:], kv_b2)
    assert rel_err(batched[0], alone_a[0]) <= 1e-5
    assert rel_err(batched[1], alone_b[0]) <= 1e-5


def test_context_limit_is_enforced(models):
    ours, _ = models
    kv = ours.new_cache(max_length=10)
    with pytest.raises(ValueError, match="exceeds the context of 10"):
        ours.prefill(torch.zeros(11, dtype=torch.long), kv)


@torch.no_grad()
def test_static_decode_step_equals_forward(models):
    """The capturable decode step (whole-capacity masked attention, device-held position) gives the
    same logits as the ordinary forward."""
    ours, _ = models
    prompt = torch.randint(0, ours.spec.vocab_size, (30,))
    kv_a, kv_b = ours.new_cache(128, capacity=64), ours.new_cache(128, capacity=64)
    assert not kv_b.k.any() and not kv_b.v.any()  # unwritten rows are zeros (masked NaNs would poison)
    a = ours.prefill(prompt, kv_a)[-1]
    ours.prefill(prompt, kv_b)
    for _ in range(4):
        token = torch.tensor([int(a.argmax())])
        a = ours.prefill(token, kv_a)[-1]
        kv_b.reserve(1)
        b = ours.step_static(token, torch.tensor([kv_b.length]), [kv_b])[0]
        kv_b.advance(1)
        assert rel_err(b, a) <= 1e-5


def test_batched_static_decode_step_equals_forward(models):
    """Three sequences of different lengths in one capturable step (each row its own cache and
    position): the logits of the ordinary batched forward, as the batch shrinks too."""
    from strata_mgpu.model.decoder import Segment

    ours, _ = models
    lengths = (30, 7, 19)
    caches_a = [ours.new_cache(128, capacity=64) for _ in lengths]
    caches_b = [ours.new_cache(128, capacity=64) for _ in lengths]
    last = []
    for n, kv_a, kv_b in zip(lengths, caches_a, caches_b, strict=True):
        prompt = torch.randint(0, ours.spec.vocab_size, (n,))
        last.append(ours.prefill(prompt, kv_a)[-1])
        ours.prefill(prompt, kv_b)
    tokens = torch.tensor([int(x.argmax()) for x in last])
    for step in range(4):
        if step == 2:  # a sequence leaves the batch
            caches_a, caches_b, tokens = caches_a[::2], caches_b[::2], tokens[::2]
        segments = [Segment(i, i + 1, kv) for i, kv in enumerate(caches_a)]
        a = ours.logits(ours.forward(tokens, segments))
        for kv in caches_b:
            kv.reserve(1)
        b = ours.step_static(tokens, torch.tensor([kv.length for kv in caches_b]), caches_b)
        for kv in caches_b:
            kv.advance(1)
        assert b.shape == a.shape and rel_err(b, a) <= 1e-5
        tokens = a.argmax(-1)


@torch.no_grad()
def test_a_replaced_route_is_called_by_the_static_step(models):
    """The static step routes inside `ops.moe_input` only while the decoder routes itself: a
    routing hook (tests record or force the routing so) is called for every layer, and its picks
    are the ones used."""
    ours, _ = models
    kv = ours.new_cache(64, capacity=32)
    ours.prefill(torch.randint(0, ours.spec.vocab_size, (5,)), kv)
    calls = []
    own = ours.route

    def recording(i, h, router):
        calls.append(i)
        return own(i, h, router)

    assert ours.routing is None
    ours.routing = recording
    try:
        kv.reserve(1)
        ours.step_static(torch.tensor([1]), torch.tensor([kv.length]), [kv])
    finally:
        ours.routing = None
    assert calls == list(range(ours.spec.n_layers))
