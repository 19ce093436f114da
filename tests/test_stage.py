"""The streamed-expert stage and its pieces on the CPU, against the reference forward."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType as Q

from strata_mgpu.config import StageSwitches
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.kernels.routing import combine, group_rows, masked_combine
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.runner import load_reference_runner
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.synthetic import write_model
from strata_mgpu.quant import dequantize
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.device import DeviceContext
from strata_mgpu.stage.experts.cache import ExpertCache
from strata_mgpu.stage.experts.ring import ExpertRing
from strata_mgpu.stage.stage import StageOptions

CPU = torch.device("cpu")


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


@pytest.mark.parametrize("expert_type", [Q.Q4_K, Q.Q5_K, Q.Q8_0])
def test_stage_matches_reference_prefill_and_decode(tmp_path, expert_type):
    path = tmp_path / "m.gguf"
    write_model(path, "tiny", expert_type=expert_type, seed=11)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    experts = stage.experts
    prompt = torch.randint(0, spec.vocab_size, (40,))
    kv_ref, kv_stage = ref.new_sequence(128), stage.new_sequence(128)
    a, b = ref.prefill(kv_ref, prompt), stage.prefill(kv_stage, prompt)
    assert experts.streaming and experts.ring.uploaded_bytes == experts.pass_bytes() == stage.report.pass_bytes
    assert experts.pass_bytes() == stage.arena.nbytes * (spec.n_experts - experts.cache.per_layer) // spec.n_experts
    assert rel_err(b, a) <= 1e-5  # fp32 both: only summation order differs
    for _ in range(5):
        token = torch.tensor([int(a.argmax())])
        a, b = ref.decode([kv_ref], token)[0], stage.decode([kv_stage], token)[0]
        assert not experts.streaming  # one row: experts come one by one through the cache
        assert rel_err(b, a) <= 1e-5
    cache = experts.cache
    assert 0 < cache.hits < cache.lookups  # picks read from VRAM slots and from the host arena


def test_arena_layout_one_expert_one_slice(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, expert_cache=False))
    arena = stage.arena
    assert arena.nbytes == sum(f.tensor(f"blk.{i}.ffn_{k}_exps.weight").nbytes
                               for i in range(spec.n_layers) for k in ("gate", "up", "down"))
    lay = arena.layouts[2]
    one = arena.expert(2, 5).numpy()
    gate = f.tensor_data("blk.2.ffn_gate_exps.weight")[5].reshape(-1)
    down = f.tensor_data("blk.2.ffn_down_exps.weight")[5].reshape(-1)
    assert (one[:lay.gate_bytes] == gate).all() and (one[lay.down_offset:] == down).all()
    assert arena.layer(2).numel() == spec.n_experts * lay.expert_bytes


def test_torch_dequant_of_strided_runs_equals_dequantize(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, expert_cache=False))
    lay = stage.arena.layouts[1]
    src = stage.arena.layer(1)
    out = torch.empty(spec.n_experts * lay.down_weights)
    TorchKernels().dequant(src[lay.down_offset:], lay.down_type, spec.n_experts, lay.down_weights,
                           lay.expert_bytes, out)
    info = f.tensor("blk.1.ffn_down_exps.weight")
    assert torch.equal(out.view(info.shape), dequantize(f.tensor_data(info.name), info.ggml_type, info.shape))


def test_group_rows_and_combine():
    T, A, E, D = 37, 3, 9, 16
    experts = torch.stack([torch.randperm(E)[:A] for _ in range(T)])
    weights = torch.rand(T, A)
    order, offs = group_rows(experts, torch.arange(E))
    flat = experts.reshape(-1)[order]
    assert torch.equal(flat, flat.sort().values)  # sorted by expert
    assert torch.equal(order, torch.argsort(experts.reshape(-1), stable=True))  # stable: rows in order within one
    assert offs.dtype == torch.int32
    counts = torch.bincount(experts.reshape(-1), minlength=E)
    assert offs.tolist() == counts.cumsum(0).tolist()
    rows = torch.randn(T * A, D)  # an output per (token, pick)
    got = combine(rows[order], order, weights)
    ref = (rows.view(T, A, D) * weights[..., None]).sum(1)
    assert torch.allclose(got, ref, atol=1e-6)


def test_masked_combine_counts_only_its_picks():
    """A part's rows past its groups hold anything (here NaN, as memory a grouped GEMM left
    unwritten may): they count zero, and the part's picks are weighted as `combine` weights them."""
    T, A, E, D = 29, 4, 8, 16
    experts = torch.stack([torch.randperm(E)[:A] for _ in range(T)])
    weights = torch.rand(T, A)
    mine = experts < 3  # a part of experts 0..2
    order, _ = group_rows(torch.where(mine, experts, 3), torch.arange(4))
    rows = torch.randn(T * A, D)
    y_sorted = rows[order].clone()
    y_sorted[~mine.reshape(-1)[order]] = float("nan")
    got = masked_combine(y_sorted, order, weights, mine)
    ref = (rows.view(T, A, D) * (weights * mine)[..., None]).sum(1)
    assert torch.allclose(got, ref, atol=1e-6)


def test_ring_reuses_slots_in_order():
    ctx = DeviceContext(CPU)
    ring = ExpertRing(ctx, slot_bytes=16, n_slots=2)
    slots = [ring.upload(i, [torch.full((8,), i, dtype=torch.uint8)]) for i in range(3)]
    assert [s.index for s in slots] == [0, 1, 0]
    assert slots[2].layer == 2 and int(slots[2].buffer[0]) == 2
    packed = ring.upload(3, [torch.full((5,), 7, dtype=torch.uint8), torch.full((3,), 9, dtype=torch.uint8)])
    assert packed.buffer[:8].tolist() == [7] * 5 + [9] * 3  # runs packed one after the other
    with pytest.raises(AssertionError):
        ring.upload(9, [torch.zeros(9, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)])


def test_expert_cache_table_and_addresses(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, expert_cache=False))
    layers = range(spec.n_layers)
    cache = ExpertCache(DeviceContext(CPU), stage.arena, layers, n_slots=3 * spec.n_layers)
    assert cache.per_layer == 3 and cache.hit_rate_uniform == 3 / spec.n_experts
    n = stage.arena.layouts[1].expert_bytes
    assert torch.equal(cache.source(1, 2)[:n], stage.arena.expert(1, 2))  # resident copy
    assert cache.source(1, 6).data_ptr() == stage.arena.expert(1, 6).data_ptr()  # read in place
    picks = torch.tensor([0, 2, 5, 7])
    addresses = cache.addresses(1, picks).tolist()
    expected = [cache.slots[int(cache.slot_of_host[1, e])].data_ptr() if e < 3 else
                stage.arena.expert(1, e).data_ptr() for e in picks.tolist()]
    assert addresses == expected
    assert int((cache.slot_of[1, picks] >= 0).sum()) == 2


def test_cache_follows_the_routing_and_answers_stay_the_same(tiny_gguf):
    from strata_mgpu.stage.experts.residency import PERIOD

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    ref = load_reference_runner(f, spec)
    stage = build_stage(f, spec, StageOptions(device=CPU))
    cache = stage.experts.cache
    assert cache.per_layer == 2 and cache.swapped == 0
    prompt = torch.randint(0, spec.vocab_size, (40,))
    stage.prefill(stage.new_sequence(128), prompt)
    assert float(cache.picks.sum()) == 40 * spec.n_experts_used * spec.n_layers  # counted on the device
    kv_s, kv_r = stage.new_sequence(128), ref.new_sequence(128)
    b, a = stage.prefill(kv_s, prompt), ref.prefill(kv_r, prompt)
    assert cache.swapped == 0  # not in a prompt: moves there would slow its stream
    cache.picks.zero_()
    cache.picks[:, 5] = 100.0  # expert 5 is hot in every layer
    for step in range(1, PERIOD + 3):
        token = torch.tensor([int(a.argmax())])
        a, b = ref.decode([kv_r], token)[0], stage.decode([kv_s], token)[0]
        assert rel_err(b, a) <= 1e-5
        # chosen at a flush, in the table a step later (expert 5 in each layer, perhaps others the steps picked)
        assert (cache.swapped == 0) if step <= PERIOD else (cache.swapped >= spec.n_layers)
    assert all(int(cache.slot_of_host[i, 5]) >= 0 for i in range(spec.n_layers))
    assert torch.equal(cache.slot_of, cache.slot_of_host)
    n = stage.arena.layouts[0].expert_bytes
    assert torch.equal(cache.source(0, 5)[:n], stage.arena.expert(0, 5))


def test_resident_experts_computed_in_place_equal_all_streamed(tiny_gguf):
    """A prompt pass reads resident experts from VRAM and streams only the rest: the same answer
    as streaming everything (fp32) for any resident share, and only the rest crosses the link."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    prompt = torch.randint(0, spec.vocab_size, (48,))
    outs = {}
    for k in (0, 1, spec.n_experts // 2, spec.n_experts):
        stage = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=k)))
        experts = stage.experts
        outs[k] = stage.prefill(stage.new_sequence(64), prompt)
        assert experts.cache.per_layer == k and stage.plan.resident_per_layer == k
        assert experts.pass_bytes() == stage.arena.nbytes * (spec.n_experts - k) // spec.n_experts
        assert (experts.ring is None) == (k == spec.n_experts)  # nothing streams: no ring at all
        assert (experts.ring.uploaded_bytes if experts.ring else 0) == experts.pass_bytes()
    for k, out in outs.items():
        assert torch.equal(out, outs[0]), k  # fp32: each row meets the same weights in the same order


def test_a_pass_that_fails_partway_gives_the_ring_back(tiny_gguf):
    """An error inside a streamed pass (the device out of memory, say) must not leave the ring
    held: the next prompt streams and answers as a fresh stage does."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=1)))
    kernels, calls = stage.experts.kernels, []
    grouped_mlp = kernels.grouped_mlp

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return grouped_mlp(*args)

    kernels.grouped_mlp = failing
    prompt = torch.randint(0, spec.vocab_size, (48,))
    with pytest.raises(torch.OutOfMemoryError):
        stage.prefill(stage.new_sequence(64), prompt)
    ring = stage.experts.ring
    assert ring.holder is not None and ring.holder.done  # given back, not left claimed
    again = stage.prefill(stage.new_sequence(64), prompt)
    fresh = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=1)))
    assert torch.equal(again, fresh.prefill(fresh.new_sequence(64), prompt))


def test_a_decode_step_out_of_memory_after_the_caches_advanced_is_redone_from_their_lengths(tiny_gguf):
    """`Stage.decode_rows`' retry (graphs dropped, the step run again) starts from the lengths the
    caches had: an out-of-memory error in the head, after `run` advanced them, must not leave the
    token's KV written twice (one cell on). Same logits as a step that never failed."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu")))
    prompt = torch.randint(0, spec.vocab_size, (6,), generator=torch.Generator().manual_seed(4))
    kv_ok, kv_oom = stage.new_sequence(16), stage.new_sequence(16)
    stage.prefill(kv_ok, prompt)
    stage.prefill(kv_oom, prompt)
    want = stage.decode([kv_ok], torch.tensor([5]))
    own_logits, failures = stage.model.logits, [1]

    def logits_once_out_of_memory(x):
        if failures:
            failures.pop()
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return own_logits(x)

    stage.model.logits = logits_once_out_of_memory
    stage.graphs.captured = {1: object()}  # something to drop: the retry only runs where graphs held memory
    try:
        got = stage.decode([kv_oom], torch.tensor([5]))
    finally:
        del stage.model.logits
    assert not failures and not stage.graphs.captured
    assert kv_oom.length == kv_ok.length == 7
    torch.testing.assert_close(got, want)


def test_a_batch_size_whose_capture_ran_out_of_memory_decodes_eagerly_for_a_while(tiny_gguf, monkeypatch):
    """After a capture runs out of memory its batch size decodes eagerly for CAPTURE_RETRY_STEPS
    steps without trying again (each try costs a warm-up step, a sync and an empty_cache), then
    tries once more. Captures are stood in for on the CPU."""
    from strata_mgpu.stage.graphs import replay

    f = GGUFFile(tiny_gguf)
    stage = build_stage(f, spec_from_gguf(f), StageOptions(device=torch.device("cpu")))
    tries = []

    def capture_out_of_memory(*args, **kwargs):
        tries.append(1)
        raise torch.OutOfMemoryError("CUDA out of memory (test)")

    monkeypatch.setattr(replay, "DecodeGraph", capture_out_of_memory)
    monkeypatch.setattr(replay, "CAPTURE_RETRY_STEPS", 3)
    monkeypatch.setattr(stage.graphs, "_capture", lambda: None)
    kv = stage.new_sequence(16)
    assert [stage.graphs.step([kv], torch.tensor([1])) for _ in range(5)] == [None] * 5
    assert len(tries) == 2  # the first step, then again after 3 eager ones


def test_bench_compute_passes_upload_nothing_and_leave_the_ring_as_it_was(tiny_gguf):
    """`tools.bench.uploads_skipped`: a pass meanwhile takes its ring slots with nothing copied
    into them; afterwards the ring uploads again, through its own method."""
    from strata_mgpu.tools.bench import uploads_skipped

    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=torch.device("cpu"), switches=StageSwitches(resident_experts=0)))
    ring, prompt = stage.experts.ring, torch.randint(0, spec.vocab_size, (40,))
    assert ring is not None and stage.experts.should_stream(prompt.numel())
    with uploads_skipped([stage]):
        stage.prefill(stage.new_sequence(64), prompt)
    assert ring.uploaded_bytes == 0 and "upload" not in vars(ring)
    stage.prefill(stage.new_sequence(64), prompt)
    assert ring.uploaded_bytes == stage.experts.pass_bytes() > 0
