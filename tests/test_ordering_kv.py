"""The two-tier KV's prefetch side stream under the ordering twin: the CPU tests of test_kv_two_tier
rerun with twin streams, a stage's spilled prefill and decode with STRATA_KV_PREFETCH=1 checked
and replayed, and each wait of `stage/kv/two_tier.py` dropped to show whether the twin needs it."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.reference import ReferenceModel
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.weights import load_weights
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.kv.two_tier import Hold, KVStaging, TwoTierKV, make_kv_cache
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.stage.streams import OrderingError, ordering_twin
from tests import test_kv_two_tier as kv_tests
from tests.ordering_schedules import first_race, replay

CPU = torch.device("cpu")
# 12 VRAM cells a layer, sequences of up to 96: anything past 12 tokens spills to host rows.
SPILLING = StageOptions(device=CPU, chunk_size=16, kv_tokens=12, context=96)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return f, spec_from_gguf(f)


@pytest.fixture(scope="module")
def model(tiny) -> ReferenceModel:
    f, spec = tiny
    return ReferenceModel(spec, load_weights(f, spec))


# (the test, how to call it, whether it crosses streams on a declared buffer: only with prefetch)
RERUN = {
    "chunks_prefetch": (lambda m, g: kv_tests.test_chunks_and_decode_equal_all_vram(m, 5, [3, 20, 2, 9], True), True),
    "chunks_window_1": (lambda m, g: kv_tests.test_chunks_and_decode_equal_all_vram(m, 1, [7, 1, 13], True), True),
    "chunks_plain": (lambda m, g: kv_tests.test_chunks_and_decode_equal_all_vram(m, 16, [10, 4, 30, 1], False),
                     False),
    "batched_prefetch": (lambda m, g: kv_tests.test_batched_decode_with_a_shared_staging_equals_alone(m, True), True),
    "failed_prefill": (lambda m, g: kv_tests.test_failed_prefill_with_prefetch_pending_leaves_everything_intact(m, g),
                       True),
    "pending_overwritten": (lambda m, g: kv_tests.test_a_prefetch_left_pending_is_overwritten_safely(m), True),
    "close": (lambda m, g: kv_tests.test_close_frees_and_refuses_more(m), True),
}


@pytest.mark.parametrize("name", list(RERUN))
def test_two_tier_tests_pass_under_the_twin(name, model, tiny_gguf):
    run, crosses = RERUN[name]
    with ordering_twin() as twin:
        run(model, tiny_gguf)
    assert twin.contexts > 0 and twin.accesses > 0
    assert (twin.cross_stream > 0) == crosses  # ordered by the staging's waits: what a drop breaks


@torch.no_grad()
def spilled_prefill_and_decode(tiny, monkeypatch) -> None:
    """A stage with prefetch on: two sequences' prompts in chunks (some longer than the window),
    then decode steps of both together sharing the staging; every logit equals an all-VRAM
    cache's on the same stage."""
    f, spec = tiny
    monkeypatch.setenv("STRATA_KV_PREFETCH", "1")
    stage = build_stage(f, spec, SPILLING)
    kvs = [stage.new_sequence(96) for _ in range(2)]
    assert all(isinstance(kv, TwoTierKV) for kv in kvs) and kvs[0].staging.prefetch
    with stage.ctx.on_compute():
        plains = [make_kv_cache(spec, stage.layers, 96, 96, device=CPU, dtype=torch.float32, staging=None)
                  for _ in kvs]
    g = torch.Generator().manual_seed(3)
    for kv, plain, n in zip(kvs, plains, (45, 30), strict=True):
        prompt = torch.randint(0, spec.vocab_size, (n,), generator=g)
        for at in range(0, n, 16):
            assert torch.equal(stage.prefill(kv, prompt[at:at + 16]), stage.prefill(plain, prompt[at:at + 16]))
    assert kvs[0].spilled and kvs[1].spilled
    step = torch.tensor([5, 9])
    for _ in range(3):
        want = stage.decode(plains, step)
        assert torch.equal(stage.decode(kvs, step), want)
        step = want.argmax(-1)


def test_spilled_stage_with_prefetch_has_no_race(tiny, monkeypatch):
    """No race, and the trace survives adversarial schedules of the GPU's choosing."""
    with ordering_twin(trace=True) as twin:
        spilled_prefill_and_decode(tiny, monkeypatch)
    assert twin.cross_stream > 0 and any(s.name == "cpu0.kv side" for s in twin.streams)
    assert first_race(twin.trace) is None
    assert replay(twin.trace, range(5), [s.name for s in twin.streams]) == 5


def test_plain_cpu_runs_the_side_stream_path(model):
    """Without the twin the context has no streams (its ops are no-ops), yet prefetch runs its
    bookkeeping: a prefetch is held, then consumed by the forward."""
    st = kv_tests.staging(model, prefetch=True)
    assert st.ctx.compute is None and st.side is None and st.n_buffers == 2
    kv = kv_tests.two_tier(model, 4, st)
    kv_tests.logits(model, kv_tests.tokens(model, 12, 1), kv)
    kv.prefetch(0)
    assert st.holds[0] is not None
    kv_tests.logits(model, torch.tensor([7]), kv)
    assert st.holds == [None, None]


def only_while(monkeypatch, cls: type, method: str, when=lambda self, *args: True) -> dict[str, bool]:
    """A flag that is on while `cls.method` runs, for calls where `when(self, *args)` holds."""
    flag, inner = {"on": False}, getattr(cls, method)

    def flagged(self, *args):
        flag["on"] = when(self, *args)
        try:
            return inner(self, *args)
        finally:
            flag["on"] = False

    monkeypatch.setattr(cls, method, flagged)
    return flag


def drop_waits(monkeypatch, what: str, flag: dict[str, bool] | None = None) -> list[str]:
    """Every DeviceContext.wait on a KV event ('cpu0 kv ...') whose name ends with `what` does
    nothing (only while `flag` is on, if given), as if deleted from two_tier.py; returns the names
    of the waits dropped."""
    wait = DeviceContext.wait
    dropped = []

    def maybe_wait(self, event, stream=None):
        if event is not None and " kv " in event.name and event.name.endswith(what) and (flag is None or flag["on"]):
            dropped.append(event.name)
            return
        wait(self, event, stream)

    monkeypatch.setattr(DeviceContext, "wait", maybe_wait)
    return dropped


def in_prefetch(monkeypatch) -> dict[str, bool]:
    return only_while(monkeypatch, TwoTierKV, "prefetch")


def taking_a_prefetch(monkeypatch) -> dict[str, bool]:
    def prefetched(st: KVStaging, owner: int, layer: int, rows: int, b: int) -> bool:
        return st.holds[b] == Hold(owner, layer, rows)

    return only_while(monkeypatch, KVStaging, "take", prefetched)


STAGING = r"'cpu0 kv staging \d'"
# (the events whose waits are dropped, where (None: everywhere), what the twin must say)
NEEDED_WAITS = {
    "released, before a spill": ("released", None, rf"cpu0\.kv side reads {STAGING} at two_tier\.py:\d+ write, but its "
                                 rf"write on cpu0\.compute .*missing a wait on 'cpu0 kv staging \d released'"),
    # the twin names the first event recorded on compute after that read: the expert ring's, which would order it too
    "released, before a prefetch": ("released", in_prefetch, rf"cpu0\.kv side writes {STAGING} at two_tier\.py:\d+ "
                                    rf"prefetch, but its read on cpu0\.compute at two_tier\.py:\d+ write .*missing "
                                    rf"a wait on 'cpu0 ring slot \d free'"),
    "ready, after a spill": ("ready", None, rf"cpu0\.compute writes {STAGING} at two_tier\.py:\d+ write, but its read "
                             rf"on cpu0\.kv side at two_tier\.py:\d+ write .*missing a wait on 'cpu0 kv staging \d "
                             rf"ready'"),
    "ready, taking a prefetch": ("ready", taking_a_prefetch, rf"cpu0\.compute writes {STAGING} at two_tier\.py:\d+ "
                                 rf"write, but its write on cpu0\.kv side at two_tier\.py:\d+ prefetch .*missing a "
                                 rf"wait on 'cpu0 kv staging \d ready'"),
}


@pytest.mark.parametrize("case", list(NEEDED_WAITS))
def test_each_needed_wait_dropped_is_caught(monkeypatch, tiny, case):
    what, where, message = NEEDED_WAITS[case]
    dropped = drop_waits(monkeypatch, what, where(monkeypatch) if where else None)
    with ordering_twin(), pytest.raises(OrderingError, match=message):
        spilled_prefill_and_decode(tiny, monkeypatch)
    assert dropped


def test_upload_wait_on_the_last_spill_is_implied_today(monkeypatch, tiny):
    """An upload on the compute stream waits for the cache's last spill (`_spilled`), but `take`
    has just made it wait on `ready[b]`, recorded after the last side work on b, and a layer
    spills only through its own buffer b: the rows it reads are ordered without it. Dropped,
    nothing races (kept, so that a change of the buffer assignment stays safe)."""
    dropped = drop_waits(monkeypatch, "spilled")
    with ordering_twin() as twin:
        spilled_prefill_and_decode(tiny, monkeypatch)
    assert dropped and twin.cross_stream > 0
