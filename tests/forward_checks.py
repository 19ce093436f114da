"""Checks every architecture's reference forward passes, written once: against transformers' model
on the same weights (a prompt, then decoded tokens through both caches), and chunks, packs and
batches against whole prompts. A hybrid decoder's sequences carry their DeltaNet state
(`Decoder.new_linear_state`), others none."""

from __future__ import annotations

import inspect

import torch

from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.runner import DecoderRunner

TOL = 1e-4  # max|diff| / max|ref|, both fp32


def hf_step(hf, ids: torch.Tensor, cache):
    """One forward of transformers' model with its KV cache, whichever name this version gives
    the cache (`cache` in 5.24+, `past_key_values` before)."""
    name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
    out = hf(ids, use_cache=True, **({name: cache} if cache is not None else {}))
    return out.logits[0], getattr(out, name)


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).abs().max() / ref.abs().max())


@torch.no_grad()
def assert_decode_matches_hf(ours: ReferenceModel, hf, prompt: torch.Tensor, steps: int = 6, capacity: int = 8):
    """The prompt's logits, then `steps` greedy tokens' (transformers' argmax fed to both), within TOL.
    A cache of small `capacity`: decode grows it. Returns our cache (and DeltaNet state)."""
    kv, linear = ours.new_cache(max_length=256, capacity=capacity), ours.new_linear_state()
    logits = ours.prefill(prompt, kv, linear)
    ref, cache = hf_step(hf, prompt[None], None)
    assert rel_err(logits, ref) <= TOL
    nxt = ref[-1].argmax()
    for _ in range(steps):
        step = ours.prefill(nxt[None], kv, linear)
        ref, cache = hf_step(hf, nxt[None, None], cache)
        assert rel_err(step, ref) <= TOL
        nxt = ref[-1].argmax()
    return kv, linear


@torch.no_grad()
def assert_chunks_packs_and_batches_equal_whole(ours: ReferenceModel, cuts: tuple[int, ...] = (7, 80)) -> None:
    """A 100-token prompt in chunks cut at `cuts`, two prompts packed in one forward, and two sequences
    decoded in one batch: the logits each has alone (to 1e-5)."""
    runner = DecoderRunner(ours)
    V = ours.spec.vocab_size
    a, b = torch.randint(0, V, (100,)), torch.randint(0, V, (23,))
    whole_kv, whole_linear = ours.new_cache(256), ours.new_linear_state()
    whole = ours.prefill(a, whole_kv, whole_linear)
    kv, linear = ours.new_cache(256), ours.new_linear_state()
    bounds = [0, *cuts, 100]
    parts = [ours.prefill(a[lo:hi], kv, linear) for lo, hi in zip(bounds, bounds[1:], strict=False)]
    assert rel_err(torch.cat(parts), whole) <= 1e-5

    seq_a, seq_b = runner.new_sequence(256), runner.new_sequence(256)
    packed = runner.prefill_many([seq_a, seq_b], [a, b])
    alone_b = runner.prefill(runner.new_sequence(256), b)
    assert rel_err(packed[0], whole[-1]) <= 1e-5 and rel_err(packed[1], alone_b) <= 1e-5
    step = torch.tensor([5, 9])
    batched = runner.decode([seq_a, seq_b], step)
    assert rel_err(batched[0], ours.prefill(step[:1], whole_kv, whole_linear)[0]) <= 1e-5
    seq_b2 = runner.new_sequence(256)
    runner.prefill(seq_b2, b)
    assert rel_err(batched[1], runner.decode([seq_b2], step[1:])[0]) <= 1e-5
