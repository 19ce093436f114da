"""Two-tier KV (last cells in VRAM, older prefix in host RAM) against the all-VRAM `KVCache`, on the
tiny synthetic model's fp32 reference forward: the keys and values attention sees are the same
bits, so the logits must be equal."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.model.decoder import Segment
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.kv_cache import KVCache
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.host.pool import HostBufferPool
from strata_mgpu.stage.kv.two_tier import Hold, KVStaging, TwoTierKV, make_kv_cache, staging_bytes, window_bytes
from tests.failing_experts import FailingExperts

MAX_LEN = 96


@pytest.fixture(scope="module")
def model(tiny_gguf) -> ReferenceModel:
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return ReferenceModel(spec, load_weights(f, spec))


def staging(model, prefetch: bool, max_cells: int = MAX_LEN) -> KVStaging:
    """On a CPU context of its own: inside `ordering_twin()` one with twin streams
    (tests/test_ordering_kv.py reruns these tests there)."""
    ctx = DeviceContext(torch.device("cpu"))
    return KVStaging.for_model(model.spec, max_cells, ctx=ctx, dtype=torch.float32, prefetch=prefetch)


def two_tier(model, window: int, st: KVStaging, max_length: int = MAX_LEN) -> TwoTierKV:
    kv = make_kv_cache(model.spec, range(len(model.w.layers)), window, max_length, device=torch.device("cpu"),
                       dtype=torch.float32, staging=st)
    assert isinstance(kv, TwoTierKV)
    return kv


def logits(model, tokens: torch.Tensor, kv) -> torch.Tensor:
    return model.logits(model.forward(tokens, [Segment(0, tokens.shape[0], kv)]))


def tokens(model, n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.spec.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
@pytest.mark.parametrize("window,chunks", [(1, [7, 1, 13]), (5, [3, 20, 2, 9]), (16, [10, 4, 30, 1]),
                                           (24, [24, 1, 17])])
def test_chunks_and_decode_equal_all_vram(model, window, chunks, prefetch):
    """Prefill chunks (some longer than the window, some spilling part of themselves), then decode
    steps: every logit equals the all-VRAM cache's, and VRAM never holds more than the window."""
    seed = int(torch.randint(0, 2**31, ()))
    prompt = tokens(model, sum(chunks), seed)
    plain, kv = KVCache(len(model.w.layers), model.spec.n_kv_heads, model.spec.head_dim, max_length=MAX_LEN,
                        capacity=8), two_tier(model, window, staging(model, prefetch))
    at = 0
    for n in chunks:
        want, got = logits(model, prompt[at:at + n], plain), logits(model, prompt[at:at + n], kv)
        assert torch.equal(got, want), f"seed {seed}: chunk {at}..{at + n} differs"
        at += n
        assert kv.capacity <= window and kv.host_rows == [max(0, at - window)] * len(model.w.layers)
    token = want[-1].argmax()[None]
    for step in range(5):
        want, got = logits(model, token, plain), logits(model, token, kv)
        assert torch.equal(got, want), f"seed {seed}: decode step {step} differs"
        token = want[-1].argmax()[None]
    assert kv.spilled and kv.nbytes == window_bytes(model.spec, len(model.w.layers), window, elem=4)
    assert kv.host_k.shape[1] <= MAX_LEN - window
    assert kv.staging.holds == [None] * kv.staging.n_buffers  # every prefetch was consumed


@torch.no_grad()
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_batched_decode_with_a_shared_staging_equals_alone(model, prefetch):
    """Three sequences in one decode batch, two spilled and one not, assembling in one staging:
    the same logits as the batch over all-VRAM caches."""
    st = staging(model, prefetch)
    lengths, window = [40, 3, 27], 6
    prompts = [tokens(model, n, 100 + i) for i, n in enumerate(lengths)]
    kvs = [two_tier(model, window, st) for _ in prompts]
    plains = [model.new_cache(MAX_LEN) for _ in prompts]
    for p, kv, plain in zip(prompts, kvs, plains, strict=True):
        logits(model, p, kv)
        logits(model, p, plain)
    assert [kv.spilled for kv in kvs] == [True, False, True]
    step = torch.tensor([11, 7, 3])
    for _ in range(3):
        batched = model.logits(model.forward(step, [Segment(i, i + 1, kv) for i, kv in enumerate(kvs)]))
        want = model.logits(model.forward(step, [Segment(i, i + 1, kv) for i, kv in enumerate(plains)]))
        assert torch.equal(batched, want)
        step = want.argmax(-1)


@torch.no_grad()
def test_failed_prefill_with_prefetch_pending_leaves_everything_intact(model, tiny_gguf):
    """A prefill chunk (longer than the window) fails in layer 1's experts while layer 2's upload is
    pending: the forward drains it, the other sequence's cache and the staging stay usable, and
    the failed sequence itself, retried, gives the all-VRAM cache's logits."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    failing = ReferenceModel(spec, load_weights(f, spec))
    st = staging(failing, prefetch=True)
    holds_at_failure: list[Hold | None] = []  # the staging's holds when the experts raised
    failing.experts = experts = FailingExperts(failing.experts, on_failure=lambda: holds_at_failure.extend(st.holds))
    window = 8
    a, b = two_tier(failing, window, st), two_tier(failing, window, st)
    pa, pb = tokens(model, 50, 1), tokens(model, 30, 2)
    plain_a, plain_b = model.new_cache(MAX_LEN), model.new_cache(MAX_LEN)
    for kv, plain, p in ((a, plain_a, pa[:20]), (b, plain_b, pb[:20])):
        assert torch.equal(logits(failing, p, kv), logits(model, p, plain))
    experts.fail_layer = 1
    with pytest.raises(RuntimeError, match="injected failure"):
        logits(failing, pa[20:], a)
    assert Hold(a.owner, 2, 20 - window) in holds_at_failure  # the pending upload
    assert st.holds == [None, None] and a.length == 20  # drained; the failed chunk did not count
    assert a.host_rows[:2] == [50 - window] * 2 and a.host_rows[2:] == [20 - window] * 2
    # the other sequence, then the failed one retried, then both decoding together
    assert torch.equal(logits(failing, pb[20:], b), logits(model, pb[20:], plain_b))
    assert torch.equal(logits(failing, pa[20:], a), logits(model, pa[20:], plain_a))
    step = torch.tensor([5, 9])
    batched = failing.logits(failing.forward(step, [Segment(0, 1, a), Segment(1, 2, b)]))
    assert torch.equal(batched, model.logits(model.forward(step, [Segment(0, 1, plain_a), Segment(1, 2, plain_b)])))


@torch.no_grad()
def test_failed_first_chunk_then_a_shorter_one(model, tiny_gguf):
    """A first chunk longer than the window fails after some layers spilled part of it; the
    sequence then goes on with other tokens in chunks that fit the window: those stale host rows
    must never be read as the sequence's."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    failing = ReferenceModel(spec, load_weights(f, spec))
    st = staging(failing, prefetch=False)
    failing.experts = experts = FailingExperts(failing.experts)
    kv, plain = two_tier(failing, 10, st), model.new_cache(MAX_LEN)
    experts.fail_layer = 2
    with pytest.raises(RuntimeError, match="injected failure"):
        logits(failing, tokens(model, 25, 7), kv)
    assert kv.host_rows[0] == 15 and kv.length == 0
    for n in (6, 3, 9):
        p = tokens(model, n, 8 + n)
        assert torch.equal(logits(failing, p, kv), logits(model, p, plain))


@torch.no_grad()
def test_a_prefetch_left_pending_is_overwritten_safely(model):
    """A sequence's prefetch that its forward never consumed (a caller that stopped early without
    draining) does not leak into another sequence's attention, nor go stale for its owner."""
    st = staging(model, prefetch=True)
    a, b = two_tier(model, 4, st), two_tier(model, 4, st)
    pa, pb = tokens(model, 20, 3), tokens(model, 20, 4)
    plain_a, plain_b = model.new_cache(MAX_LEN), model.new_cache(MAX_LEN)
    for kv, plain, p in ((a, plain_a, pa), (b, plain_b, pb)):
        logits(model, p, kv)
        logits(model, p, plain)
    b.prefetch(1)
    a.prefetch(1)  # refused: the buffer is b's until consumed
    assert st.holds[1] == Hold(b.owner, 1, 20 - 4)
    token = torch.tensor([42])
    assert torch.equal(logits(model, token, a), logits(model, token, plain_a))
    assert torch.equal(logits(model, token, b), logits(model, token, plain_b))


@torch.no_grad()
def test_static_decode_step_while_the_window_holds_everything(model):
    """Until the first spill the ring is a plain cache: the capturable static step reads it as it
    reads a plain cache of the same capacity; once the next cell would not fit, the cache says so."""
    window = 24
    kv, plain = two_tier(model, window, staging(model, False)), model.new_cache(MAX_LEN, capacity=window)
    prompt = tokens(model, 20, 5)
    a = logits(model, prompt, plain)[-1]
    logits(model, prompt, kv)
    while kv.graph_capturable:
        token = a.argmax()[None]
        out = []
        for cache in (plain, kv):
            cache.reserve(1)
            out.append(model.step_static(token, torch.tensor([cache.length]), [cache])[0])
            cache.advance(1)
        assert kv.capacity == plain.capacity and torch.equal(out[1], out[0])
        a = out[0]
    assert kv.length == window and not kv.spilled
    with pytest.raises(AssertionError, match="decode it with run"):
        model.step_static(a.argmax()[None], torch.tensor([kv.length]), [kv])
    token = a.argmax()[None]
    assert torch.equal(logits(model, token, kv), logits(model, token, plain))
    assert kv.spilled and not kv.graph_capturable


def test_make_kv_cache_picks_the_tier_and_checks_its_staging(model):
    spec, layers, cpu = model.spec, range(len(model.w.layers)), torch.device("cpu")
    plain = make_kv_cache(spec, layers, 64, 64, device=cpu, dtype=torch.float32, staging=None)
    assert isinstance(plain, KVCache) and plain.graph_capturable
    with pytest.raises(ValueError, match="no staging buffer"):
        make_kv_cache(spec, layers, 32, 64, device=cpu, dtype=torch.float32, staging=None)
    with pytest.raises(ValueError, match="staging buffer holds 48 cells"):
        make_kv_cache(spec, layers, 32, 64, device=cpu, dtype=torch.float32, staging=staging(model, False, 48))
    st = staging(model, True, 64)
    assert st.nbytes == staging_bytes(spec, 64, prefetch=True, elem=4)
    assert staging(model, False, 64).nbytes == staging_bytes(spec, 64, prefetch=False, elem=4)


@torch.no_grad()
def test_close_frees_and_refuses_more(model):
    kv = two_tier(model, 4, staging(model, True))
    logits(model, tokens(model, 12, 6), kv)
    assert kv.host_nbytes > 0
    kv.close()
    assert kv.host_nbytes == 0 and kv.nbytes == 0 and kv.staging.holds == [None, None]
    with pytest.raises(RuntimeError, match="closed"):
        kv.reserve(1)


@torch.no_grad()
@pytest.mark.parametrize("prefetch", [False, True], ids=["plain", "prefetch"])
def test_host_rows_of_an_ended_sequence_serve_the_next(model, prefetch):
    """The stage's pool hands a closed (or collected) sequence's host rows to the next one that
    spills: no new buffer, stale contents never read (its logits equal the all-VRAM cache's)."""
    st = staging(model, prefetch)
    st.pool = HostBufferPool(pin=False, granule=64)  # buffers this small grow with the tiny model's rows
    first = two_tier(model, 4, st)
    prompt = tokens(model, 60, 1)
    for at in range(0, 60, 10):  # its host rows grow; each outgrown buffer goes back to the pool
        logits(model, prompt[at:at + 10], first)
    made = st.pool.made
    assert made >= 2 and st.pool.idle_bytes > 0
    first.close()
    for end in ("close", "collected"):
        seed = int(torch.randint(0, 2**31, ()))
        prompt = tokens(model, 50, seed)
        plain = KVCache(len(model.w.layers), model.spec.n_kv_heads, model.spec.head_dim, max_length=MAX_LEN)
        kv = two_tier(model, 4, st)
        for at in range(0, 50, 10):
            want, got = logits(model, prompt[at:at + 10], plain), logits(model, prompt[at:at + 10], kv)
            assert torch.equal(got, want), f"seed {seed}: chunk at {at} differs"
        assert st.pool.made == made and st.pool.reused >= 1  # nothing new allocated or pinned
        if end == "close":
            kv.close()
        else:
            del kv  # the finalizer gives the rows back
    assert st.pool.idle_bytes > 0 and st.pool.made == made
