"""The DeltaNet state pool (`model.state_pool`): a stage's sequences hold slots of one pool sized at
build (its scratch slot beside them), their layer states are views of it, a dropped sequence's slot
comes back zeroed for the next, one too many is refused in one line, and the reference's pool grows
keeping every state."""

from __future__ import annotations

import gc

import pytest
import torch

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.linear_state import HybridSequence
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.state_pool import SCRATCH, StatePool, StatePoolFull
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hybrid(tiny_hybrid_gguf):
    f = GGUFFile(tiny_hybrid_gguf)
    return f, spec_from_gguf(f)


def _fill(seq: HybridSequence, value: float) -> None:
    for i in seq.linear.layers:
        s = seq.linear.layer(i)
        s.conv.fill_(value)
        s.recurrent.fill_(value)


@torch.no_grad()
def test_a_stage_holds_its_sequences_states_in_one_pool_of_fixed_slots(hybrid):
    f, spec = hybrid
    stage = build_stage(f, spec, StageOptions(device=CPU, kv_tokens=1024, sequences=3))
    pool = stage.model.states
    assert isinstance(pool, StatePool) and pool.bounded and pool.sequence_slots == 3
    assert pool.slot_bytes == spec.linear_state_bytes()  # fp32 on the CPU, as the plan counts it
    assert pool.nbytes == 4 * spec.linear_state_bytes() and stage.plan.linear_state == 3 * pool.slot_bytes
    seqs = [stage.new_sequence(64) for _ in range(3)]
    assert all(isinstance(s, HybridSequence) for s in seqs)
    slots = [s.linear.slot for s in seqs]  # type: ignore[union-attr]
    assert sorted(slots) == [1, 2, 3] and SCRATCH not in slots and pool.held == 3
    first = seqs[0]
    assert isinstance(first, HybridSequence)
    i = first.linear.layers[0]
    view = first.linear.layer(i).recurrent  # a view of the pool's slot: a write lands there
    view.fill_(2.0)
    assert torch.equal(pool.recurrent[i][first.linear.slot], view) and view.data_ptr() == \
        pool.recurrent[i][first.linear.slot].data_ptr()
    with pytest.raises(StatePoolFull, match="all 3 DeltaNet state slots are held") as e:
        stage.new_sequence(64)
    assert "\n" not in str(e.value)
    freed = first.linear.slot
    _fill(first, 5.0)
    del first, seqs[0], view
    gc.collect()
    again = stage.new_sequence(64)  # the freed slot, zeroed
    assert isinstance(again, HybridSequence) and again.linear.slot == freed
    assert all(not again.linear.layer(j).recurrent.any() and not again.linear.layer(j).conv.any()
               for j in again.linear.layers)


@torch.no_grad()
def test_the_references_pool_grows_and_keeps_every_state(hybrid):
    f, spec = hybrid
    ref = load_reference_runner(f, spec)
    pool = ref.model.states
    assert pool is not None and not pool.bounded
    g = torch.Generator().manual_seed(3)
    seqs = []
    for n in range(6):  # past a pool of one slot, then two, then four
        seq = ref.new_sequence(64)
        ref.prefill(seq, torch.randint(0, spec.vocab_size, (5 + n,), generator=g))
        assert isinstance(seq, HybridSequence)
        seqs.append((seq, seq.linear.snapshot()))
    assert pool.sequence_slots >= 6 and len({s.linear.slot for s, _ in seqs}) == 6
    for seq, snap in seqs:  # each state where it was, through the growths after it
        now = seq.linear.snapshot()
        assert all(torch.equal(now.layers[i].recurrent, snap.layers[i].recurrent)
                   and torch.equal(now.layers[i].conv, snap.layers[i].conv) for i in now.layers)
