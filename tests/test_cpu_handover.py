"""The decode hand-over of missing experts to the host's cores (stage/experts/handover.py) on the
CPU: the share's choice of picks, the host's sums, the worker's protocol over a mailbox in plain
host memory, and a CPU stage's decode with the twin against the same stage without it."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from strata_mgpu.config import HostShare, StageSwitches
from strata_mgpu.kernels.cpu_experts import TorchExperts
from strata_mgpu.kernels.experts import TorchKernels
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, spec_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.experts.cpu_handover import CpuHandover
from strata_mgpu.stage.experts.handover_twin import HandoverTwin
from strata_mgpu.stage.experts.mailbox import HandoverWorker, Mailbox, host_sums
from strata_mgpu.stage.experts.share_policy import (
    RETUNE_STEPS,
    TRIAL_BLOCK,
    TRIAL_STEPS,
    AutoShare,
    HostRate,
    ShareTrial,
    assign_host,
)
from strata_mgpu.stage.host.arena import HostExpertArena
from strata_mgpu.stage.stage import Stage, StageOptions

CPU = torch.device("cpu")
STAGE_TOL = 0.5  # tests/test_cpu_experts.py: ggml's rounding against fp32, a routing flip included


def rel_err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).abs().max() / ref.float().abs().max())


def test_the_option_reads_auto_off_or_a_share():
    assert HostShare.parse("auto") == HostShare("auto") and HostShare.parse(" OFF ") == HostShare("off")
    assert HostShare.parse("0.25") == HostShare("fixed", 0.25) and str(HostShare.parse("1")) == "1"
    for bad in ("0", "1.5", "-0.1", "half", "nan", ""):
        with pytest.raises(ValueError, match="--cpu-experts"):
            HostShare.parse(bad)


def test_the_share_takes_missing_experts_only_once_each_and_carries_across_calls():
    resident = np.zeros(16, dtype=bool)
    resident[[0, 1, 2, 3]] = True
    picks = [0, 5, 6, 7, 8, 1, 5, 9]  # 5 twice: one choice; 0 and 1 resident
    assert assign_host(picks, resident, 1.0, 0.0) == ({5, 6, 7, 8, 9}, 0.0)
    assert assign_host(picks, resident, 0.0, 0.0)[0] == set()
    host, carry = assign_host(picks, resident, 0.5, 0.0)
    assert host == {6, 8} and carry == pytest.approx(0.5)  # every second miss, in pick order
    host, carry = assign_host(picks, resident, 0.5, carry)  # the carry goes on: 5, 7, 9 now
    assert host == {5, 7, 9} and carry == pytest.approx(0.0)
    rng = np.random.default_rng(0)
    taken = misses = 0
    carry = 0.0
    for _ in range(200):  # over many calls the share holds to within one pick
        row = rng.choice(16, size=8, replace=False).tolist()
        host, carry = assign_host(row, resident, 0.3, carry)
        taken += len(host)
        misses += sum(not resident[e] for e in row)
    assert abs(taken - 0.3 * misses) <= 1


def test_auto_finishes_the_host_with_the_link_and_declines_where_its_fixed_cost_wins():
    free = AutoShare(HostRate(0.0, 20e9), 20e9, expert_bytes=3_000_000, n_used=8)
    assert free.share(0.5) == pytest.approx(0.5) and free.share(0.9) == pytest.approx(0.5)
    assert AutoShare(HostRate(0.0, 60e9), 20e9, 3_000_000, 8).share(0.5) == pytest.approx(0.75)
    costly = AutoShare(HostRate(100e-6, 30e9), 50e9, expert_bytes=3_000_000, n_used=8)
    assert costly.share(0.9) == 0.0  # 0.8 misses a layer: 48 us over the link, less than the host's fixed cost
    f = costly.share(0.25)  # 6 misses: 360 us over the link
    link_s, host_s = 6 * 3e6 / 50e9, 6 * 3e6 / 30e9
    assert 0.1 < f < 0.5 and (1 - f) * link_s == pytest.approx(100e-6 + f * host_s)
    assert costly.share(1.0) == 0.0  # nothing misses


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    return f, spec, HostExpertArena(f, spec, range(spec.n_layers), pin=False)


def test_the_hosts_sums_are_its_picks_weighted_and_rows_without_any_are_left_out(tiny):
    f, spec, arena = tiny
    torch.manual_seed(0)
    t, a, d = 5, spec.n_experts_used, spec.hidden
    h = torch.randn(t, d)
    experts = torch.stack([torch.randperm(spec.n_experts)[:a] for _ in range(t)])
    weights = torch.rand(t, a)
    mine = torch.rand(t, a) < 0.4
    mine[2] = False  # a row with no host pick
    mine[3] = True  # and one with all
    picks = torch.where(mine, experts, -1).numpy().astype(np.int32)
    executor = TorchExperts()
    sums, rows = host_sums(executor, arena, 1, h, picks, weights.numpy())
    assert rows.tolist() == [r for r in range(t) if mine[r].any()]
    for j, r in enumerate(rows.tolist()):
        sel = mine[r]
        want = executor.moe(arena.layer(1), arena.layouts[1], h[r:r + 1], weights[r:r + 1, sel],
                            experts[r:r + 1, sel])
        assert rel_err(sums[j:j + 1], want) <= 1e-6, r


def test_the_twin_gather_skips_the_hosts_picks(tiny_gguf):
    """TorchKernels.moe_gathered with some picks -1 equals the sum over the others alone."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    stage = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    cache, ws = stage.experts.cache, stage.experts.workspace
    kernels = TorchKernels()
    torch.manual_seed(1)
    t, a = 3, spec.n_experts_used
    h = torch.randn(t, spec.hidden)
    experts = torch.stack([torch.randperm(spec.n_experts)[:a] for _ in range(t)])
    weights = torch.rand(t, a)
    lay = stage.arena.layouts[0]
    skip = torch.zeros(t, a, dtype=torch.bool)
    skip[0, 0] = skip[1, 1:] = True
    got = kernels.moe_gathered(cache, 0, lay, h, weights, torch.where(skip, -1, experts), ws.w_gate_up, ws.w_down)
    want = kernels.moe_gathered(cache, 0, lay, h, torch.where(skip, 0.0, weights), experts, ws.w_gate_up, ws.w_down)
    assert rel_err(got, want) <= 1e-6


def post(box: Mailbox, t: int, a: int, layer: int, h: torch.Tensor, picks: np.ndarray, weights: np.ndarray) -> int:
    """What handover_send writes, from Python: the payload, then the request number."""
    box.h[:h.numel()] = h.reshape(-1)
    box.picks[:t * a] = torch.from_numpy(picks.reshape(-1))
    box.weights[:t * a] = torch.from_numpy(weights.reshape(-1))
    box.meta[:] = torch.tensor([t, a, layer, int((picks >= 0).sum())], dtype=torch.int32)
    request = box.request + 1
    box.flags_np[0] = request
    return request


def wait_done(box: Mailbox, request: int, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while box.done != request:
        assert time.monotonic() < end, "the worker did not answer"
        time.sleep(1e-4)


class Failing(TorchExperts):
    def moe(self, *args, **kwargs):
        raise RuntimeError("boom")


def test_the_worker_answers_each_request_and_sleeps_between_steps(tiny):
    """The worker's side of the protocol over a mailbox in plain memory: each request answered with
    host_sums' rows (zeros elsewhere), the done number after; after its idle time it sleeps and an
    arm wakes it; a failing executor still answers (zeros) and leaves the error for the next arm."""
    f, spec, arena = tiny
    t, a, d = 4, spec.n_experts_used, spec.hidden
    box = Mailbox(8, a, d, pin=False)
    executor = TorchExperts()
    worker = HandoverWorker(box, executor, arena, range(1, spec.n_layers))  # local layer 0 is global layer 1
    try:
        rng = np.random.default_rng(2)
        for step in range(3):
            worker.arm()
            h = torch.randn(t, d)
            picks = np.where(rng.random((t, a)) < 0.5, rng.integers(0, spec.n_experts, (t, a)), -1).astype(np.int32)
            picks[0] = -1
            picks[1, 0] = 3
            weights = rng.random((t, a)).astype(np.float32)
            request = post(box, t, a, 0, h, picks, weights)
            wait_done(box, request)
            sums, rows = host_sums(executor, arena, 1, h, picks, weights)
            out = box.out[:t * d].view(t, d)
            assert torch.equal(out[torch.from_numpy(rows)], sums), step
            assert not out[0].any()
        assert worker.counter.rate.calls == 3
        time.sleep(0.4)  # past IDLE_SPIN_S: it only checks every IDLE_POLL_S now
        assert not worker._wake.is_set()
        request = post(box, 1, a, 0, torch.randn(1, d), np.full((1, a), 2, dtype=np.int32),
                       np.ones((1, a), dtype=np.float32))
        wait_done(box, request, timeout=1.0)  # not armed (queued behind long work): answered all the same
        worker.arm()
        request = post(box, 1, a, 0, torch.randn(1, d), np.full((1, a), -1, dtype=np.int32),
                       np.ones((1, a), dtype=np.float32))
        wait_done(box, request)  # a request without host picks is no request: answered with zeros, an error
        assert isinstance(worker.error, RuntimeError) and "overwritten" in str(worker.error)
        worker.error = None
        box.share_np[0] = 0.5
        worker.executor = Failing()
        worker.arm()
        request = post(box, 1, a, 0, torch.randn(1, d), np.full((1, a), 2, dtype=np.int32),
                       np.ones((1, a), dtype=np.float32))
        wait_done(box, request)
        assert isinstance(worker.error, RuntimeError) and "boom" in str(worker.error) and not box.out[:d].any()
        assert box.share_np[0] == 0.0  # later layers give the host nothing
        # what the layers went on past, as the engine reads it: the failed worker, then a timed-out wait too
        as_stage_sees_it = SimpleNamespace(mailbox=box, worker=worker)
        assert CpuHandover.silent_faults(as_stage_sees_it) == 1  # type: ignore[arg-type]
        box.flags_np[16] = 1  # the status word handover_add sets when the host does not answer in time
        assert box.status == 1 and CpuHandover.silent_faults(as_stage_sees_it) == 2  # type: ignore[arg-type]
    finally:
        worker.close()
    assert not any(th.name == "strata cpu experts" and th.is_alive() for th in threading.enumerate()
                   if th is worker._thread)


@pytest.mark.parametrize("share", [0.5, 1.0])
@pytest.mark.parametrize("executor", ["torch", "built"])
def test_decode_with_the_twin_equals_the_link_only_stage(tiny_gguf, share, executor):
    """A CPU stage with 2 of 8 experts resident decodes the same with a share of the misses computed by
    the host's executor (HandoverTwin) as without: with the torch twin as that executor, within fp32
    rounding; with the one the build chose (ggml where ggml-python is installed, which rounds the
    activations to 8 bits: routing may flip), finite and within tests/test_cpu_experts.py's STAGE_TOL."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    plain = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    shared = build_stage(f, spec, StageOptions(device=CPU, threads=1,
                                               switches=StageSwitches(resident_experts=2,
                                                                      cpu_experts=HostShare("fixed", share))))
    handover = shared.experts.handover
    assert isinstance(handover, HandoverTwin)
    if executor == "torch":
        handover.executor = TorchExperts()
    tol = 1e-5 if handover.executor.name == "torch" else STAGE_TOL
    torch.manual_seed(3)
    prompt = torch.randint(0, spec.vocab_size, (12,))
    kv_p, kv_s = plain.new_sequence(64), shared.new_sequence(64)
    a, b = plain.prefill(kv_p, prompt), shared.prefill(kv_s, prompt)
    assert torch.equal(a, b)  # a 12-token prompt streams whole layers: no hand-over (prompts are off)
    prompt_picks = handover.host_picks
    assert prompt_picks == 0
    misses: list[int] = []  # each decode layer's missing experts, as the stage handed them over
    send = handover.send

    def counting_send(i, h, weights, experts):
        resident = handover.cache.slot_of_host[i] >= 0
        misses.append(sum(1 for e in set(experts.reshape(-1).tolist()) if not resident[e]))
        return send(i, h, weights, experts)

    handover.send = counting_send  # type: ignore[method-assign]
    token = torch.tensor([int(a.argmax())])
    for step in range(6):
        a, b = plain.decode([kv_p], token)[0], shared.decode([kv_s], token)[0]
        assert torch.isfinite(b).all() and rel_err(b, a) <= tol, step
        token = torch.tensor([int(a.argmax())])
    assert len(misses) == 6 * spec.n_layers  # every decode layer handed over
    # one row a step: each missing expert is one pick, and the host took the share asked of them (the
    # carry rounds down: within one pick)
    assert abs(handover.host_picks - share * sum(misses)) < 1


def test_off_and_auto_build_no_hand_over_on_the_cpu(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    for share in (HostShare("off"), HostShare("auto")):
        stage = build_stage(f, spec, StageOptions(device=CPU,
                                                  switches=StageSwitches(resident_experts=2, cpu_experts=share)))
        assert stage.experts.handover is None
    everything = build_stage(f, spec, StageOptions(device=CPU,
                                                   switches=StageSwitches(resident_experts=spec.n_experts,
                                                                          cpu_experts=HostShare("fixed", 1.0))))
    assert everything.experts.handover is None  # nothing misses


def test_the_hosts_rate_refits_to_what_its_answered_requests_took():
    """Live requests (bytes, seconds) replace the probe's line: two sizes give both parts back;
    one size keeps the probe's bytes/s and refits the fixed part."""
    probe = HostRate(50e-6, 50e9)
    live = [(n * 3_000_000, 200e-6 + n * 3_000_000 / 25e9) for n in (1, 2, 3, 1, 2, 3)]
    fit = probe.refit(live)
    assert fit.overhead_s == pytest.approx(200e-6, rel=1e-6) and fit.bytes_per_s == pytest.approx(25e9, rel=1e-6)
    same = probe.refit([(3_000_000, 300e-6)] * 4)
    assert same.bytes_per_s == 50e9 and same.overhead_s == pytest.approx(300e-6 - 3e6 / 50e9)


def link_only_and_shared(tiny_gguf) -> tuple[ModelSpec, Stage, Stage, HandoverTwin]:
    """Two CPU stages with 2 experts a layer resident: one link-only, one handing all its missing
    experts to the host (HandoverTwin, the plain twin as executor)."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    plain = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    shared = build_stage(f, spec, StageOptions(device=CPU,
                                               switches=StageSwitches(resident_experts=2,
                                                                      cpu_experts=HostShare("fixed", 1.0))))
    handover = shared.experts.handover
    assert isinstance(handover, HandoverTwin)
    handover.executor = TorchExperts()
    return spec, plain, shared, handover


def test_a_declined_hand_over_is_detached_and_its_graphs_dropped(tiny_gguf, monkeypatch):
    """Where `auto` declines mid-run (arm() says False), the stage detaches the hand-over before the
    step, drops the graphs captured with its kernels, and decodes as the link-only stage does."""
    spec, plain, shared, handover = link_only_and_shared(tiny_gguf)
    dropped = []
    monkeypatch.setattr(shared.graphs, "drop", lambda: dropped.append(True))
    prompt = torch.randint(0, spec.vocab_size, (12,))
    kv_p, kv_s = plain.new_sequence(64), shared.new_sequence(64)
    a, _ = plain.prefill(kv_p, prompt), shared.prefill(kv_s, prompt)
    token = torch.tensor([int(a.argmax())])
    a, b = plain.decode([kv_p], token)[0], shared.decode([kv_s], token)[0]
    assert shared.experts.handover is handover and handover.host_picks > 0 and not dropped
    monkeypatch.setattr(handover, "arm", lambda: False)  # the share fell to 0
    closed = []
    monkeypatch.setattr(handover, "close", lambda: closed.append(True))
    assert shared.silent_faults() == 0
    monkeypatch.setattr(handover, "silent_faults", lambda: 1)  # as a host that did not answer in time
    assert shared.silent_faults() == 1
    token = torch.tensor([int(a.argmax())])
    a, b = plain.decode([kv_p], token)[0], shared.decode([kv_s], token)[0]
    assert shared.experts.handover is None and dropped == [True] and closed == [True]
    assert shared.silent_faults() == 1  # the detached hand-over's failure stays counted
    assert rel_err(b, a) <= 1e-5


def test_a_hand_over_that_has_failed_takes_no_pass(tiny_gguf, monkeypatch):
    """Once the hand-over has failed (counted in silent_faults, not yet detached: a prompt's pass
    comes before the next decode step's arm), a pass gives the host nothing and computes every pick
    itself, as the link-only stage does: no layer goes on without the host's part unnoticed."""
    spec, plain, shared, handover = link_only_and_shared(tiny_gguf)
    prompt = torch.randint(0, spec.vocab_size, (6,))
    kv_p, kv_s = plain.new_sequence(64), shared.new_sequence(64)
    a, _ = plain.prefill(kv_p, prompt), shared.prefill(kv_s, prompt)
    token = torch.tensor([int(a.argmax())])
    plain.decode([kv_p], token), shared.decode([kv_s], token)
    taken = handover.host_picks
    assert taken > 0
    monkeypatch.setattr(handover, "silent_faults", lambda: 1)
    a, b = plain.decode([kv_p], token)[0], shared.decode([kv_s], token)[0]
    assert handover.host_picks == taken and rel_err(b, a) <= 1e-5


@pytest.mark.parametrize("share", [0.5, 1.0])
def test_a_few_row_prompt_gives_the_host_its_share_of_the_streamed_experts(tiny_gguf, share):
    """A streamed pass of at most the mailbox's rows: the host's cores take `share` of each layer's
    streamed experts (HostPrefillHelper over the twin), the ring uploads only the rest, and the
    logits equal the link-only stage's (fp32, the torch twin as the host's executor); a longer
    prompt streams everything itself."""
    f = GGUFFile(tiny_gguf)
    spec = spec_from_gguf(f)
    plain = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(resident_experts=2)))
    shared = build_stage(f, spec, StageOptions(device=CPU, switches=StageSwitches(
        resident_experts=2, cpu_experts=HostShare("fixed", share), host_prompt_help=True)))
    handover, helper = shared.experts.handover, shared.experts.host_helper
    assert isinstance(handover, HandoverTwin) and helper is not None
    handover.executor = TorchExperts()
    streamed = spec.n_experts - 2
    torch.manual_seed(4)
    for n in (24, handover.max_rows, handover.max_rows + 16):
        prompt = torch.randint(0, spec.vocab_size, (n,))
        before, up_p, up_s = handover.host_picks, plain.experts.ring.uploaded_bytes, shared.experts.ring.uploaded_bytes
        a = plain.prefill(plain.new_sequence(128), prompt)
        b = shared.prefill(shared.new_sequence(128), prompt)
        assert rel_err(b, a) <= 1e-5, n
        took = round(share * streamed) if n <= handover.max_rows else 0
        assert helper.n_experts == took
        assert (handover.host_picks > before) == (took > 0), n
        expert = shared.arena.layouts[0].expert_bytes
        assert shared.experts.ring.uploaded_bytes - up_s == (plain.experts.ring.uploaded_bytes - up_p
                                                            - took * spec.n_layers * expert), n


def run_trial(share: float, with_host_s: float, without_s: float, outliers: dict[int, float] | None = None
              ) -> tuple[ShareTrial, list[float]]:
    """A ShareTrial driven as the engine drives it: steps run back to back on the device (a step's
    time: with_host_s where it ran at a share, else without_s, plus any outlier of its index), and
    the arm of step n comes as step n - 2 ends (one step in flight, the one before it landed)."""
    trial, shares = ShareTrial(share), []
    ends: list[float] = []  # when each step ended
    while True:
        n = len(shares)
        now = ends[n - 2] + 1e-6 if n >= 2 else 0.0
        got = trial.step(now)
        if got is None:
            return trial, shares
        shares.append(got)
        start = max(ends[-1] if ends else 0.0, now)
        ends.append(start + (with_host_s if got > 0 else without_s) + (outliers or {}).get(n, 0.0))
        assert n < 10 * TRIAL_STEPS, "the trial never decided"


def test_auto_keeps_its_share_only_where_the_clock_says_the_host_shortens_the_steps():
    """`auto`'s trial: blocks without the host and with it, alternating; the share kept where the
    steps with the host are shorter by more than the margin (a prompt chunk's long step among them
    changes nothing), declined (0) where they are not, or are longer."""
    trial, shares = run_trial(0.4, 1e-3, 1.3e-3, outliers={9: 0.05, 30: 0.08})
    assert shares[:TRIAL_BLOCK] == [0.0] * TRIAL_BLOCK and shares[TRIAL_BLOCK:2 * TRIAL_BLOCK] == [0.4] * TRIAL_BLOCK
    assert trial.verdict == 0.4 and len(shares) == TRIAL_STEPS + 1  # one step more, queued while the last ran
    # each step timed as itself: its own duration, never a neighbour's of the other kind
    assert all(abs(t - 1e-3) < 1e-5 for t in trial.times[True] if t < 0.01)
    assert all(abs(t - 1.3e-3) < 1e-5 for t in trial.times[False])
    assert sum(t > 0.01 for t in trial.times[True]) == 1  # step 30's; step 9 is among a block's first, not counted
    assert run_trial(0.4, 0.99e-3, 1e-3)[0].verdict == 0.0  # 1% shorter: within the margin
    assert run_trial(0.22, 1.09e-3, 1e-3)[0].verdict == 0.0  # longer (30B-A3B at 8 GiB on the H200: 8% longer)


def test_auto_tries_its_share_after_the_first_retune_and_detaches_where_it_loses():
    """CpuHandover's side, over plain memory: at the first retune a trial starts, the mailbox's
    share follows its blocks, and its verdict becomes the share (0: the next arm says to detach)."""
    box = SimpleNamespace(share_np=np.full(1, 0.3, dtype=np.float32))
    retunes = []
    fake = SimpleNamespace(_trial=None, _steps=0, mailbox=box, share_value=0.3, retune=lambda: retunes.append(1))
    fake.set_share = lambda share: (setattr(fake, "share_value", share), box.share_np.__setitem__(0, share))
    fake._tune = lambda now: CpuHandover._tune(fake, now)  # type: ignore[arg-type]
    ends: list[float] = []
    in_mailbox = []
    for _ in range(RETUNE_STEPS + TRIAL_STEPS + 8):
        fake._steps += 1  # as arm() counts
        n = len(in_mailbox)
        fake._tune(ends[n - 2] + 1e-6 if n >= 2 else 0.0)
        in_mailbox.append(float(box.share_np[0]))
        ends.append((ends[-1] if ends else 0.0) + (1.1e-3 if in_mailbox[-1] > 0 else 1e-3))
    first = RETUNE_STEPS - 1  # the step queued at the first retune's arm
    assert retunes == [1] and in_mailbox[:first] == pytest.approx([0.3] * first)
    assert in_mailbox[first:first + TRIAL_BLOCK] == [0.0] * TRIAL_BLOCK
    assert in_mailbox[first + TRIAL_BLOCK:first + 2 * TRIAL_BLOCK] == pytest.approx([0.3] * TRIAL_BLOCK)
    assert fake._trial is None and fake.share_value == 0.0 and in_mailbox[-1] == 0.0  # declined: arm() says detach
