"""The stage, ring, exchange and helper under the ordering twin: the CPU tests of test_stage,
test_split and test_peer_prefill rerun with twin streams (every declared access checked against
the waits that order it), and every wait those modules issue, dropped one at a time, caught with
the names of the stream, the buffer and the missing wait."""

from __future__ import annotations

import pytest
import torch

from strata_mgpu.config import AUTO_SPLIT, LayerSplit
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.split.help_rule import HelpPolicy
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.ring import ExpertRing, Slot
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.stage.streams import OrderingError, ordering_twin
from tests import test_break_even as break_even_tests
from tests import test_peer_prefill as helper_tests
from tests import test_residency as residency_tests
from tests import test_split as split_tests
from tests import test_stage as stage_tests
from tests import test_static_rows as static_tests
from tests.ordering_schedules import first_race, replay

CPU = StageOptions(device=torch.device("cpu"), chunk_size=64)
WHOLE_PROMPT = StageOptions(device=torch.device("cpu"), chunk_size=256)  # the helper's buffers hold one chunk


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return f, spec_from_gguf(f)


# (the test, how to call it from its fixtures, whether it crosses streams on a declared buffer)
RERUN = {
    "stage_matches_reference": (lambda t, g, tmp: stage_tests.test_stage_matches_reference_prefill_and_decode(
        tmp, stage_tests.Q.Q8_0), True),
    "ring_reuses_slots": (lambda t, g, tmp: stage_tests.test_ring_reuses_slots_in_order(), False),
    "cache_follows_routing": (lambda t, g, tmp: stage_tests.test_cache_follows_the_routing_and_answers_stay_the_same(g),
                              True),
    "split_bitwise_2": (lambda t, g, tmp: split_tests.test_split_equals_single_stage_bit_for_bit(t, "2", 2), True),
    "split_bitwise_3": (lambda t, g, tmp: split_tests.test_split_equals_single_stage_bit_for_bit(t, "1,3", 3), True),
    "split_engine_greedy": (lambda t, g, tmp: split_tests.test_engine_greedy_on_split_equals_reference(t, g), True),
    "static_rows_split": (lambda t, g, tmp: static_tests.test_a_split_reaches_the_static_path_on_each_stage(
        static_tests.write_wide(tmp / "wide.gguf")), True),
    "helped_2_stages": (lambda t, g, tmp: helper_tests.test_helped_equals_unhelped_and_repeats(t, 2, 0.4, False), True),
    "helped_most_experts": (lambda t, g, tmp: helper_tests.test_helped_equals_unhelped_and_repeats(t, 2, 0.75, False),
                                                                                                True),
    "helped_3_stages": (lambda t, g, tmp: helper_tests.test_helped_equals_unhelped_and_repeats(t, 3, 0.3, False), True),
    "helped_in_halves": (lambda t, g, tmp: helper_tests.test_helped_equals_unhelped_and_repeats(t, 2, 0.4, True), True),
    "helped_in_halves_3": (lambda t, g, tmp: helper_tests.test_helped_equals_unhelped_and_repeats(t, 3, 0.3, True),
                           True),
    "helper_engages": (lambda t, g, tmp: helper_tests.test_helper_engages_only_for_one_chunk_prompts(t), True),
    "helper_lent_buffers": (lambda t, g, tmp: helper_tests.test_helper_holds_only_lent_buffers(t), True),
    "helper_one_device": (lambda t, g, tmp: helper_tests.test_rule_leaves_stages_on_one_device_unhelped(t), True),
    "resident_in_place": (lambda t, g, tmp: stage_tests.test_resident_experts_computed_in_place_equal_all_streamed(g),
                          True),
    "helper_streamed_only": (lambda t, g, tmp: helper_tests.test_helper_takes_only_streamed_experts(t, 3), True),
    "residency_concentrated": (
        lambda t, g, tmp: residency_tests.test_concentrated_traffic_becomes_resident_and_answers_stay_the_oracles(g),
        True),
    "few_rows_gather": (
        lambda t, g, tmp: break_even_tests.test_a_few_row_prompt_gathers_below_the_break_even_and_answers_as_streaming(
            g), True),
    "failed_pass": (lambda t, g, tmp: stage_tests.test_a_pass_that_fails_partway_gives_the_ring_back(g), True),
    "failed_helped_pass": (lambda t, g, tmp: helper_tests.test_a_failed_helped_pass_gives_both_rings_back(t, 3), True),
    "failed_after_hand_over": (lambda t, g, tmp: helper_tests.test_a_failed_helped_pass_gives_both_rings_back(t, 2),
                               True),
}


@pytest.mark.parametrize("name", list(RERUN))
def test_cpu_tests_pass_under_the_twin(name, tiny, tiny_gguf, tmp_path):
    run, crosses = RERUN[name]
    with ordering_twin() as twin:
        run(tiny, tiny_gguf, tmp_path)
    assert twin.contexts > 0 and twin.accesses > 0
    assert (twin.cross_stream > 0) == crosses  # accesses ordered across streams by waits: what a drop breaks


def drop_waits(monkeypatch, event_name: str) -> list[str]:
    """Every DeviceContext.wait on an event so named does nothing, as if deleted from the code;
    returns the names of the waits dropped."""
    wait = DeviceContext.wait
    dropped = []

    def maybe_wait(self, event, stream=None):
        if event is not None and event.name == event_name:
            dropped.append(event.name)
            return
        wait(self, event, stream)

    monkeypatch.setattr(DeviceContext, "wait", maybe_wait)
    return dropped


def one_stage_prefill(tiny) -> None:
    f, spec = tiny
    stage = build_stage(f, spec, CPU)
    stage.prefill(stage.new_sequence(128), torch.randint(0, spec.vocab_size, (40,)))


def split_prefill_in_chunks(tiny) -> None:
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], LayerSplit((2,)))
    kv, prompt = runner.new_sequence(256), torch.randint(0, spec.vocab_size, (150,))
    for start in range(0, 150, 64):
        runner.prefill(kv, prompt[start:start + 64])


def helped_prefill(tiny, layer_split: LayerSplit = AUTO_SPLIT, prompts: int = 1) -> None:
    f, spec = tiny
    runner = build_split(f, spec, [WHOLE_PROMPT] * 2, layer_split, help_policy=HelpPolicy(fixed_share=0.4))
    for _ in range(prompts):
        runner.prefill(runner.new_sequence(256), torch.randint(0, spec.vocab_size, (100,)), whole_prompt=True)


def helped_prefill_in_halves(tiny) -> None:
    """A helped prompt in two halves of rows (checked: two hand-overs a layer)."""
    f, spec = tiny
    runner = build_split(f, spec, [WHOLE_PROMPT] * 2, AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    for helper in runner.helpers:
        helper.halves_from = 1
    firsts = helper_tests.count_hand_overs(runner)
    runner.prefill(runner.new_sequence(256), torch.randint(0, spec.vocab_size, (100,)), whole_prompt=True)
    assert firsts == [True, False] * spec.n_layers

def residency_swaps(tiny) -> None:
    """Decode steps whose hot expert the residency moves in, a swap a step."""
    from strata_mgpu.config import StageSwitches
    from strata_mgpu.stage.experts.residency import PERIOD

    f, spec = tiny
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu"), chunk_size=64,
                                              switches=StageSwitches(residency_swaps=1)))
    kv = stage.new_sequence(64)
    stage.prefill(kv, torch.randint(0, spec.vocab_size, (4,)))
    stage.experts.cache.picks[:, spec.n_experts - 1] = 100.0  # not resident at load
    for _ in range(PERIOD + spec.n_layers + 1):
        stage.decode([kv], torch.randint(0, spec.vocab_size, (1,)))
    assert stage.experts.cache.swapped >= spec.n_layers


# (the wait's event, the run that needs it, what the twin must say)
NEEDED_WAITS = [
    ("cpu0 ring slot 0 ready", one_stage_prefill,
     r"cpu0\.compute reads 'cpu0 ring slot 0' .*write on cpu0\.upload .*missing a wait on 'cpu0 ring slot 0 ready'"),
    ("cpu0 ring slot 1 free", one_stage_prefill,
     r"cpu0\.upload writes 'cpu0 ring slot 1' .*read on cpu0\.compute .*missing a wait on 'cpu0 ring slot 1 free'"),
    ("cpu0 expert slots freed", residency_swaps,  # the upload into a slot after the kernels reading its old expert
     r"cpu0\.upload writes 'cpu0 expert slot \d+' .*read on cpu0\.compute .*missing a wait on "
     r"'cpu0 expert slots freed'"),
    ("cpu0 expert slot filled", residency_swaps,  # the new expert in the table after its upload
     r"cpu0\.compute reads 'cpu0 expert slot \d+' .*write on cpu0\.upload .*missing a wait on "
     r"'cpu0 expert slot filled'"),
    ("cpu1 hand-over from cpu0 buffer 0 read", split_prefill_in_chunks,
     r"cpu0\.compute writes 'cpu0 hand-over to cpu1 buffer 0' .*read on cpu1\.compute .*missing a wait on "
     r"'cpu1 hand-over from cpu0 buffer 0 read'"),
    ("cpu0 hand-over to cpu1 buffer 1 sent", split_prefill_in_chunks,
     r"cpu1\.compute reads 'cpu0 hand-over to cpu1 buffer 1' .*write on cpu0\.compute .*missing a wait on "
     r"'cpu0 hand-over to cpu1 buffer 1 sent'"),
    ("cpu0 helper input to cpu1 buffer 2 sent", helped_prefill,
     r"cpu1\.compute reads 'cpu0 helper input to cpu1 buffer 2' .*missing a wait on "
     r"'cpu0 helper input to cpu1 buffer 2 sent'"),
    ("cpu1 helper output to cpu0 buffer 0 sent", helped_prefill,
     r"cpu0\.compute reads 'cpu1 helper output to cpu0 buffer 0' .*missing a wait on "
     r"'cpu1 helper output to cpu0 buffer 0 sent'"),
    ("cpu1 ring slot 1 ready", helped_prefill,  # the helper reads the idle stage's lent ring
     r"cpu1\.compute reads 'cpu1 ring slot 1' .*write on cpu1\.upload .*missing a wait on 'cpu1 ring slot 1 ready'"),
    ("cpu1 ring slot 0 free", helped_prefill,  # the idle stage's own upload after the helper's read
     r"cpu1\.upload writes 'cpu1 ring slot 0' .*read on cpu1\.compute .*missing a wait on 'cpu1 ring slot 0 free'"),
    # in halves each layer hands over twice: the exchanges' buffers go round twice as fast
    ("cpu0 helper input to cpu1 buffer 5 sent", helped_prefill_in_halves,
     r"cpu1\.compute reads 'cpu0 helper input to cpu1 buffer 5' .*missing a wait on "
     r"'cpu0 helper input to cpu1 buffer 5 sent'"),
    ("cpu1 helper output to cpu0 buffer 1 sent", helped_prefill_in_halves,
     r"cpu0\.compute reads 'cpu1 helper output to cpu0 buffer 1' .*missing a wait on "
     r"'cpu1 helper output to cpu0 buffer 1 sent'"),
]


@pytest.mark.parametrize("event_name, run, message", NEEDED_WAITS,
                         ids=[w[0] + (" (halves)" if w[1] is helped_prefill_in_halves else "") for w in NEEDED_WAITS])
def test_each_needed_wait_dropped_is_caught(monkeypatch, tiny, event_name, run, message):
    dropped = drop_waits(monkeypatch, event_name)
    with ordering_twin(), pytest.raises(OrderingError, match=message):
        run(tiny)
    assert dropped


def test_helper_input_read_waits_are_implied_today(monkeypatch, tiny):
    """(All rows at once.) The busy stage collects layer i's sums before it sends layer i + 2's inputs, and the helper
    reads those inputs before sending the sums: the helper's exchanges are ordered without their
    'read' waits (kept, so that a change of that flow stays safe). Dropped, nothing races."""
    dropped = drop_waits(monkeypatch, "cpu1 helper input from cpu0 buffer 0 read")
    with ordering_twin() as twin:
        helped_prefill(tiny, layer_split=LayerSplit((3,)), prompts=2)  # three busy layers: the six buffers go round
    assert dropped and twin.cross_stream > 0


class RingSkippingFreeWait(ExpertRing):
    """A deliberately broken ring: uploads into a slot without waiting for its last reader."""

    def upload(self, layer: int, src: torch.Tensor) -> Slot:
        slot = self.slots[self._next]
        free, slot.free = slot.free, None  # the upload's wait on None is no wait
        try:
            return super().upload(layer, src)
        finally:
            slot.free = free


def test_a_broken_ring_is_caught_and_its_race_is_real(tiny):
    """The twin names the race; the trace's own dependency graph agrees, and the seeded
    schedules replaying it find an upload overwriting the slot before compute read it."""
    f, spec = tiny
    with ordering_twin(trace=True) as twin:
        stage = build_stage(f, spec, StageOptions(device=torch.device("cpu"), expert_cache=False))
        experts = stage.experts
        experts.ring = RingSkippingFreeWait(stage.ctx, stage.arena.max_layer_bytes, n_slots=2)
        with pytest.raises(OrderingError, match=r"cpu0\.upload writes 'cpu0 ring slot 0' .*its read on cpu0\.compute"):
            stage.prefill(stage.new_sequence(64), torch.randint(0, spec.vocab_size, (40,)))
    race_at = first_race(twin.trace)[0]
    assert twin.trace[race_at][0] == "access"  # the race the twin raised at: after it only the failed pass's
    assert all(op[0] == "record" for op in twin.trace[race_at + 1:])  # ring given back (its slots' free events)
    names = [s.name for s in twin.streams]
    with pytest.raises(OrderingError, match=r"'cpu0 ring slot 0' .*at version"):
        replay(twin.trace, range(50), names)


@pytest.mark.parametrize("run", [helped_prefill, helped_prefill_in_halves], ids=["rows", "halves"])
def test_correct_traces_survive_adversarial_schedules(tiny, run):
    """A helped two-stage prompt's whole trace: no seeded schedule changes a version anywhere."""
    with ordering_twin(trace=True) as twin:
        run(tiny)
    assert first_race(twin.trace) is None
    assert replay(twin.trace, range(30), [s.name for s in twin.streams]) == 30

