"""The PeerPrefill helper on two (and three) emulated CPU stages: the rule, the controls,
equivalence with help off, repeatability, when it engages, and what memory it holds."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from strata_mgpu import env
from strata_mgpu.config import AUTO_SPLIT, EngineConfig, Placement, StageSwitches
from strata_mgpu.engine.engine import Engine
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.env import EnvError
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.split.help_rule import HelpPolicy, default_share
from strata_mgpu.split.runner import build_split
from strata_mgpu.stage.stage import StageOptions
from tests.test_engine import run_all

CPU = StageOptions(device=torch.device("cpu"), chunk_size=256)


def test_rule_boundaries():
    assert default_share(1) == 0.45 and default_share(819) == 0.45  # capped
    assert default_share(1024) == pytest.approx(0.4375)
    assert default_share(3276) == pytest.approx(0.3, abs=1e-4)  # the last length helped
    assert default_share(3277) == 0.0 and default_share(8192) == 0.0
    shares = [default_share(t) for t in range(800, 3300, 100)]
    assert shares == sorted(shares, reverse=True)


def policy(environ: dict[str, str], flag: bool | None = None, frac: str | None = None) -> HelpPolicy:
    """The helper's policy as `strata serve` builds it: the environment, the flags winning."""
    placement = Placement.from_env(env.read(environ), prefill_help=flag, prefill_help_frac=frac)
    return HelpPolicy.of(placement.prefill_help, placement.prefill_help_frac)


def test_controls():
    assert policy({}) == HelpPolicy(enabled=True, fixed_share=None)
    assert policy({"STRATA_PREFILL_HELP": "0"}).share(1000) == 0.0
    assert policy({"STRATA_PREFILL_HELP": "0"}, True, "rule").share(1000) == default_share(1000)  # the flag wins
    fixed = {"STRATA_PREFILL_HELP": "1", "STRATA_PREFILL_HELP_FRAC": "0.25"}
    assert policy(fixed).share(8000) == 0.25  # fixed: also where the rule is off
    assert policy(fixed, frac="0.4").share(8000) == 0.4
    assert HelpPolicy().share(1000, across_cards=False) == 0.0  # one card, one link: nothing to gain
    assert HelpPolicy(fixed_share=0.3).share(1000, across_cards=False) == 0.3
    for bad in ("0", "1", "1.5", "-0.1", "abc"):
        with pytest.raises(EnvError, match="STRATA_PREFILL_HELP_FRAC"):
            env.read({"STRATA_PREFILL_HELP_FRAC": bad})
    with pytest.raises(EnvError, match="STRATA_PREFILL_HELP='sometimes': expected 0 or 1"):
        env.read({"STRATA_PREFILL_HELP": "sometimes"})
    with pytest.raises(ValueError, match="strictly between 0 and 1"):
        Placement(prefill_help_frac=1.0)


@pytest.fixture(scope="module")
def tiny(tiny_gguf):
    f = GGUFFile(tiny_gguf)
    return f, spec_from_gguf(f)


def helped_and_not(runner, prompt: torch.Tensor, share: float) -> list[torch.Tensor]:
    out = []
    for policy in (HelpPolicy(enabled=False), HelpPolicy(fixed_share=share), HelpPolicy(fixed_share=share)):
        runner.policy = policy
        out.append(runner.prefill(runner.new_sequence(512), prompt, whole_prompt=True))
    return out


def count_hand_overs(runner) -> list[bool]:
    """Spy on every helper's hand-overs: the list fills with each one's `first` flag."""
    firsts: list[bool] = []
    for helper in runner.helpers:
        def spy(i, first, run_rows=helper.run_rows):
            firsts.append(first)
            return run_rows(i, first)
        helper.run_rows = spy
    return firsts


@pytest.mark.parametrize("n_stages, share, halves", [(2, 0.4, False), (2, 0.75, False), (3, 0.3, False),
                                                     (2, 0.4, True), (3, 0.3, True)])
def test_helped_equals_unhelped_and_repeats(tiny, n_stages, share, halves):
    """Helped (all rows at once, or in two halves of rows) equals help-off up to the rounding of
    the two partial sums, and repeats bit for bit."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU] * n_stages, AUTO_SPLIT, help_policy=HelpPolicy())
    for helper in runner.helpers:
        helper.halves_from = 100 if halves else 0
    firsts = count_hand_overs(runner)
    # A fixed prompt: with a fresh one, now and then a near-tied expert pick flips under the helped
    # pass's other summation order and moves the later layers by O(1) (1e-5 cannot hold then).
    prompt = torch.randint(0, spec.vocab_size, (150,), generator=torch.Generator().manual_seed(n_stages * 100 + 7))
    off, on, again = helped_and_not(runner, prompt, share)
    assert torch.equal(on, again)  # repeatable, run after run
    assert float((on - off).abs().max() / off.abs().max()) <= 1e-5  # fp32: two partial sums
    assert all(h.to_helper.bytes_moved > 0 and h.from_helper.bytes_moved > 0 for h in runner.helpers)
    # two helped prompts of spec.n_layers layers: one hand-over a layer, or two (each half's)
    per_layer = [True, False] if halves else [True]
    assert firsts == per_layer * (2 * spec.n_layers)


@pytest.mark.parametrize("n, prefix", [(5, 0), (101, 0), (151, 37), (9, 37)])
def test_halves_of_odd_lengths_and_after_a_prefix(tiny, n, prefix):
    """Two halves of unequal length, and a prompt that continues a cached prefix: helped in halves
    equals help-off (fp32, the two partial sums apart), and the caches hold the same keys."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    for helper in runner.helpers:
        helper.halves_from = 1
    firsts = count_hand_overs(runner)
    g = torch.Generator().manual_seed(n + prefix)
    head, prompt = (torch.randint(0, spec.vocab_size, (k,), generator=g) for k in (prefix, n))
    outs, caches = [], []
    for policy in (HelpPolicy(enabled=False), HelpPolicy(fixed_share=0.4)):
        kv = runner.new_sequence(256)
        if prefix:
            runner.policy = HelpPolicy(enabled=False)
            runner.prefill(kv, head, whole_prompt=True)
        runner.policy = policy
        firsts.clear()
        outs.append(runner.prefill(kv, prompt, whole_prompt=True))
        caches.append(kv)
    assert firsts == [True, False] * spec.n_layers  # the helped one, in halves
    off, on = outs
    assert float((on - off).abs().max() / off.abs().max()) <= 1e-5
    for a, b in zip(caches[0].parts, caches[1].parts, strict=True):
        assert a.length == b.length == prefix + n
        assert torch.allclose(a.k[:, :a.length], b.k[:, :b.length], rtol=1e-4, atol=1e-4)


def test_a_failed_pass_in_halves_leaves_nothing_behind(tiny):
    """A pass that fails in a layer's second half, with hand-overs of earlier halves still to be
    collected: the next helped prompt equals help-off, and no hand-over is left pending."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    for helper in runner.helpers:
        helper.halves_from = 1
    prompt = torch.randint(0, spec.vocab_size, (60,), generator=torch.Generator().manual_seed(3))
    runner.policy = HelpPolicy(enabled=False)
    off = runner.prefill(runner.new_sequence(128), prompt, whole_prompt=True)
    experts = runner.stages[0].experts
    start, calls = experts.start, []

    def failing(i, h, weights, picks, hq=None, first=True):
        calls.append(i)
        if len(calls) == 4:  # layer 1's second half: layer 1's first half not collected yet
            raise RuntimeError("injected")
        return start(i, h, weights, picks, hq=hq, first=first)

    experts.start = failing
    runner.policy = HelpPolicy(fixed_share=0.4)
    with pytest.raises(RuntimeError, match="injected"):
        runner.prefill(runner.new_sequence(128), prompt, whole_prompt=True)
    del experts.start
    on = runner.prefill(runner.new_sequence(128), prompt, whole_prompt=True)
    assert float((on - off).abs().max() / off.abs().max()) <= 1e-5
    assert not any(h.to_helper._pending or h.from_helper._pending for h in runner.helpers)


def test_halves_only_from_their_length(tiny):
    """A helped prompt shorter than `halves_from` hands each layer over once; one as long, twice."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    runner.helpers[0].halves_from = runner.helpers[1].halves_from = 120
    firsts = count_hand_overs(runner)
    for n, per_layer in ((119, [True]), (120, [True, False])):
        firsts.clear()
        runner.prefill(runner.new_sequence(256), torch.randint(0, spec.vocab_size, (n,)), whole_prompt=True)
        assert firsts == per_layer * spec.n_layers


def test_last_help_says_what_each_helper_took(tiny):
    """`SplitRunner.last_help`: per busy stage, the streamed experts a layer its helper took in
    the last whole prompt (what bench's one-chunk bound reads)."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    prompt = torch.randint(0, spec.vocab_size, (50,))
    runner.prefill(runner.new_sequence(64), prompt, whole_prompt=True)
    a, b = runner.stages
    assert runner.last_help == [runner.helper_experts(a, b, 0.4), runner.helper_experts(b, a, 0.4)]
    assert min(runner.last_help) > 0
    runner.policy = HelpPolicy(enabled=False)
    runner.prefill(runner.new_sequence(64), prompt, whole_prompt=True)
    assert runner.last_help == [0, 0]


def test_bench_bound_of_a_one_chunk_prompt_follows_the_help(tiny, monkeypatch):
    """bench's one-chunk bound on a split: the stages' streamed bytes one after the other; helped
    on one device, the hand-over's bytes cross the same link on top."""
    from strata_mgpu.split import rate_model
    from strata_mgpu.tools.bench import split_one_chunk_bound

    f, spec = tiny
    monkeypatch.setattr(rate_model, "link_rate", lambda ctx: 50e9)  # CPU stages have no link to probe
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    runner.policy = HelpPolicy(enabled=False)
    n = 50
    prompt = torch.randint(0, spec.vocab_size, (n,))
    runner.prefill(runner.new_sequence(64), prompt, whole_prompt=True)
    off = split_one_chunk_bound(runner, n)
    assert off == pytest.approx(sum(s.experts.pass_bytes() for s in runner.stages) / 50e9)
    runner.policy = HelpPolicy(fixed_share=0.4)
    runner.prefill(runner.new_sequence(64), prompt, whole_prompt=True)
    assert min(runner.last_help) > 0
    handover = sum(len(s.layers) * n * (2 * spec.hidden * 4 + spec.n_experts_used * 12) for s in runner.stages)
    assert split_one_chunk_bound(runner, n) == pytest.approx(off + handover / 50e9)  # fp32 rows each way


def test_a_prompt_that_gathers_has_no_help(tiny):
    """Where a stage keeps some experts resident, a prompt of fewer picks than experts gathers them
    and streams nothing: no helper is bound and `last_help` says 0."""
    f, spec = tiny
    opts = StageOptions(device=torch.device("cpu"), chunk_size=256, switches=StageSwitches(resident_experts=2))
    runner = build_split(f, spec, [opts, opts], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    moved = sum(h.to_helper.bytes_moved for h in runner.helpers)
    runner.prefill(runner.new_sequence(16), torch.randint(0, spec.vocab_size, (1,)), whole_prompt=True)
    assert runner.last_help == [0, 0] and sum(h.to_helper.bytes_moved for h in runner.helpers) == moved
    runner.prefill(runner.new_sequence(64), torch.randint(0, spec.vocab_size, (40,)), whole_prompt=True)
    assert min(runner.last_help) > 0  # one that streams is helped


def test_bench_compute_passes_teach_the_policy_nothing(tiny, monkeypatch):
    """bench times passes with their uploads skipped; the auto share must not learn from them."""
    from strata_mgpu.split.runner import PromptClock
    from strata_mgpu.tools.bench import time_compute, time_prefill

    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy())
    seen = []
    monkeypatch.setattr(HelpPolicy, "observe", lambda self, tokens, share, secs: seen.append(tokens))
    time_compute(runner, 50, 3, 256)
    runner.prefill(runner.new_sequence(64), torch.randint(0, spec.vocab_size, (50,)), whole_prompt=True)
    assert seen == [] and isinstance(runner.prompt_clock, PromptClock)
    time_prefill(runner, 50, 3, 256)  # timed prompts do teach it, each read at the next call
    assert seen == [50, 50]


def test_early_ring_bytes():
    """A ring fills early only where an earlier stage runs on another card."""
    from types import SimpleNamespace

    from strata_mgpu.tools.bench import _early_ring_bytes

    def stage(card: int, ring_bytes: int | None = 100):
        ring = SimpleNamespace(nbytes=ring_bytes) if ring_bytes is not None else None
        experts = SimpleNamespace(ring=ring)
        return SimpleNamespace(ctx=SimpleNamespace(device=card), experts=experts)

    a, b, c = stage(0), stage(1), stage(0)
    assert _early_ring_bytes(a, []) == 0  # the first stage
    assert _early_ring_bytes(b, [a]) == 100
    assert _early_ring_bytes(c, [a]) == 0  # an earlier stage streams over its card's link
    assert _early_ring_bytes(c, [a, b]) == 100  # while b runs on the other card
    assert _early_ring_bytes(stage(1, None), [a]) == 0  # no ring (nothing streams)


def test_helper_engages_only_for_one_chunk_prompts(tiny):
    f, spec = tiny
    tok = tokenizer_from_gguf(f)
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    moved = lambda: sum(h.to_helper.bytes_moved for h in runner.helpers)  # noqa: E731
    prompt = tok.encode("Once upon a time there was a small model that wanted to run on two old cards.")
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    run_all(Engine(runner, tok, EngineConfig(chunk_size=8)), [(prompt, params)])  # several chunks
    assert moved() == 0
    run_all(Engine(runner, tok, EngineConfig(chunk_size=256)), [(prompt, params)])  # one chunk
    assert moved() > 0
    before = moved()
    runner.prefill(runner.new_sequence(64), torch.tensor(prompt[:16]))  # not said to be whole
    assert moved() == before


def test_helper_holds_only_lent_buffers(tiny):
    """No memory of its own: what the helper computes in is the idle stage's ring and workspace."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.4))
    seen = []
    helper = runner.helpers[0]
    run_rows = helper.run_rows

    def spy(i, first):
        seen.append((helper.lent.ring, helper.lent.workspace.w_gate_up, helper.lent.workspace.w_down))
        assert not any(isinstance(v, torch.Tensor) for v in vars(helper).values())
        return run_rows(i, first)

    helper.run_rows = spy
    runner.prefill(runner.new_sequence(256), torch.randint(0, spec.vocab_size, (100,)), whole_prompt=True)
    idle = runner.stages[1].experts
    ws = idle.workspace
    assert seen and all(r is idle.ring and g is ws.w_gate_up and d is ws.w_down for r, g, d in seen)
    assert helper.lent is None  # unbound after the prompt


def test_sweep_cli_on_two_cpu_stages(tiny_gguf, tmp_path):
    import csv
    import json

    from click.testing import CliRunner

    from strata_mgpu.cli import main

    files = {k: tmp_path / f"sweep.{k}" for k in ("csv", "json", "png")}
    r = CliRunner().invoke(main, ["sweep", str(tiny_gguf), "--devices", "cpu,cpu", "--prompt-tokens", "64,200",
                                  "--shares", "0.3,0.45", "--runs", "1", "--csv", str(files["csv"]),
                                  "--json", str(files["json"]), "--png", str(files["png"])])
    assert r.exit_code == 0, r.output
    rows = list(csv.DictReader(files["csv"].open()))
    assert {(int(x["tokens"]), float(x["share"])) for x in rows} == {(n, s) for n in (64, 200) for s in (0, 0.3, 0.45)}
    data = json.loads(files["json"].read_text())
    assert data["rule_share"]["64"] == 0.45 and len(data["cells"]) == 6
    assert files["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(main, ["sweep", str(tiny_gguf), "--devices", "cpu"])
    assert r.exit_code == 1 and "needs two or more stages" in r.output


def test_rule_leaves_stages_on_one_device_unhelped(tiny):
    """No second link on one device: the rule's share is not used there; a fixed share is."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy())
    prompt = torch.randint(0, spec.vocab_size, (100,))
    runner.prefill(runner.new_sequence(256), prompt, whole_prompt=True)
    assert sum(h.to_helper.bytes_moved for h in runner.helpers) == 0
    runner.policy = HelpPolicy(fixed_share=0.4)
    runner.prefill(runner.new_sequence(256), prompt, whole_prompt=True)
    assert sum(h.to_helper.bytes_moved for h in runner.helpers) > 0


@pytest.mark.parametrize("resident", [0, 3, 6])
def test_helper_takes_only_streamed_experts(tiny, resident):
    """With K experts a layer resident, the helper's share comes from the E - K streamed ones; the
    answer equals the unhelped one of the same residency and the all-streamed one."""
    f, spec = tiny
    opts = StageOptions(device=torch.device("cpu"), chunk_size=256, switches=StageSwitches(resident_experts=resident))
    runner = build_split(f, spec, [opts, opts], AUTO_SPLIT, help_policy=HelpPolicy())
    streamed = build_split(f, spec, [replace(opts, switches=StageSwitches(resident_experts=0))] * 2, AUTO_SPLIT,
                           help_policy=HelpPolicy(enabled=False))
    prompt = torch.randint(0, spec.vocab_size, (120,))
    off, on, again = helped_and_not(runner, prompt, 0.5)
    reference = streamed.prefill(streamed.new_sequence(512), prompt, whole_prompt=True)
    assert torch.equal(on, again)
    assert float((on - off).abs().max() / off.abs().max()) <= 1e-5
    assert float((off - reference).abs().max() / reference.abs().max()) <= 1e-5
    busy = runner.stages[0].experts
    helper = runner.helpers[0]
    n_help = runner.helper_experts(runner.stages[0], runner.stages[1], 0.5)
    assert n_help == round(0.5 * (spec.n_experts - resident))
    per_expert = sum(runner.stages[0].arena.layouts[i].expert_bytes for i in busy.layers)
    assert helper.streamed_bytes == 2 * n_help * per_expert  # two helped prompts, its share of each layer


# grouped_mlp calls on stage 0's kernels: its own rows of layers 0 and 1, then the helper's rows for
# stage 1 (the helper of stage 1 runs on stage 0). The 2nd fails after layer 1's hand-over: the
# helper's sums were sent, never collected, and must not be read by the next prompt.
@pytest.mark.parametrize("failing_call", [2, 3])
def test_a_failed_helped_pass_gives_both_rings_back(tiny, failing_call):
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy(fixed_share=0.5))
    busy = runner.stages[0].experts
    grouped_mlp, calls = busy.kernels.grouped_mlp, []

    def failing(*args):
        calls.append(1)
        if len(calls) == failing_call:
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return grouped_mlp(*args)

    busy.kernels.grouped_mlp = failing
    prompt = torch.randint(0, spec.vocab_size, (100,))
    with pytest.raises(torch.OutOfMemoryError):
        runner.prefill(runner.new_sequence(256), prompt, whole_prompt=True)
    assert all(s.experts.ring.holder is None or s.experts.ring.holder.done for s in runner.stages)
    busy.kernels.grouped_mlp = grouped_mlp
    again = runner.prefill(runner.new_sequence(256), prompt, whole_prompt=True)
    runner.policy = HelpPolicy(enabled=False)
    off = runner.prefill(runner.new_sequence(256), prompt, whole_prompt=True)
    assert float((again - off).abs().max() / off.abs().max()) <= 1e-5


def test_timed_one_chunk_prompts_refine_the_auto_share(tiny, monkeypatch):
    """The split runner times each one-chunk prompt (events on a GPU, the host clock here) and
    hands the policy its time once it has finished, skipping the first (warm-up)."""
    f, spec = tiny
    runner = build_split(f, spec, [CPU, CPU], AUTO_SPLIT, help_policy=HelpPolicy())
    seen = []
    monkeypatch.setattr(HelpPolicy, "observe", lambda self, tokens, share, secs: seen.append((tokens, share, secs)))
    for n in (50, 60, 70):
        runner.prefill(runner.new_sequence(128), torch.randint(0, spec.vocab_size, (n,)), whole_prompt=True)
    runner.prefill(runner.new_sequence(128), torch.randint(0, spec.vocab_size, (40,)))  # a chunk: not timed
    assert [(t, s) for t, s, _ in seen] == [(60, None), (70, None)] and all(sec > 0 for _, _, sec in seen)
