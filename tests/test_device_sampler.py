"""The batch sampler against its plain twin, `Sampler`: same distribution, same filters, greedy
rows equal the argmax, and seeded draws that do not depend on the rest of the batch."""

from __future__ import annotations

import random

import pytest
import torch

from strata_mgpu.engine.device_sampler import BatchSampler, draw_keys, mix32, uniforms
from strata_mgpu.engine.sampler import SamplingParams
from tests.sampling_twin import Sampler

ALPHA = 1e-3  # significance of the chi-square tests; seeds are fixed, so each test is deterministic
V_SMALL = 12
CONFIGS = {  # every filter alone, and all at once
    "plain": SamplingParams(max_tokens=9, temperature=0.7),
    "top_k": SamplingParams(max_tokens=9, temperature=1.3, top_k=5),
    "top_p": SamplingParams(max_tokens=9, temperature=0.9, top_p=0.8),
    "min_p": SamplingParams(max_tokens=9, temperature=1.0, min_p=0.1),
    "all": SamplingParams(max_tokens=9, temperature=0.8, top_k=8, top_p=0.9, min_p=0.05),
}


def small_logits() -> torch.Tensor:
    return torch.randn(V_SMALL, generator=torch.Generator().manual_seed(3)) * 1.5


def reference_probs(params: SamplingParams, logits: torch.Tensor, counts: dict[int, int] | None = None) -> torch.Tensor:
    """The distribution the twin draws from."""
    ref = Sampler(params)
    ref.counts.update(counts or {})
    return ref.filtered(ref.penalized(logits) / params.temperature)


def chi_square_p(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of counts `observed` [V] under `probs` [V]; bins expected below 5 are merged."""
    expected = probs.double() * observed.sum()
    small = expected < 5
    obs = torch.cat([observed[~small].double(), observed[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def draw_once(sampler: BatchSampler, logits: torch.Tensor, params: list[SamplingParams], seed0: int = 0
              ) -> torch.Tensor:
    """One draw per row, row i with seed seed0 + i; logits [V] shared by every row."""
    states = [sampler.open(SamplingParams(**{**p.__dict__, "seed": seed0 + i})) for i, p in enumerate(params)]
    return sampler.sample(logits.expand(len(states), -1).contiguous(), states)


def test_mix32_on_tensors_equals_python_ints():
    xs = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, *random.Random(0).sample(range(2**32), 200)]
    want = [mix32(x) for x in xs]
    got = mix32(torch.tensor(xs, dtype=torch.long)).tolist()
    assert got == want and all(0 <= w < 2**32 for w in want)


def test_uniforms_are_uniform():
    keys = torch.tensor([draw_keys(seed, step) for seed in range(50) for step in range(4)])  # [200, 2]
    u = uniforms(keys, mix32(torch.arange(1000)))  # [200, 1000]
    assert float(u.min()) > 0 and float(u.max()) < 1
    counts = torch.histc(u.float(), bins=20, min=0, max=1)
    assert chi_square_p(counts, torch.full((20,), 1 / 20)) > ALPHA
    # neighbouring draws of one request and neighbouring vocab ids are not correlated
    assert abs(float(torch.corrcoef(torch.stack([u[0], u[1]]))[0, 1])) < 0.1
    assert abs(float(torch.corrcoef(torch.stack([u[:, 0], u[:, 1]]))[0, 1])) < 0.25


def test_distribution_matches_twin_per_row_in_one_mixed_batch():
    """Rows of five configurations, interleaved with greedy rows, drawn in one call: each
    configuration's draws fit the twin's distribution, each greedy row is the argmax."""
    logits = small_logits()
    per_config = 20_000
    greedy = SamplingParams(max_tokens=9, temperature=0)
    names = list(CONFIGS)
    params = [CONFIGS[names[i % len(names)]] if i % 7 else greedy for i in range(per_config * len(names))]
    tokens = draw_once(BatchSampler(), logits, params)
    is_greedy = torch.tensor([p.temperature == 0 for p in params])
    assert bool((tokens[is_greedy] == logits.argmax()).all())
    for name in names:
        rows = torch.tensor([p is CONFIGS[name] for p in params])
        observed = torch.bincount(tokens[rows], minlength=V_SMALL)
        probs = reference_probs(CONFIGS[name], logits)
        assert int(observed[probs == 0].sum()) == 0, f"{name}: drew a token the twin filters out"
        assert chi_square_p(observed, probs) > ALPHA, f"{name}: draws do not fit the twin's distribution"


def test_chi_square_catches_top_p_off_by_one():
    """The test above has power: draws that fit top-p are rejected against a top-p that keeps one
    token more, the mistake a `>` for `>=` would make."""
    logits = small_logits()
    params = CONFIGS["top_p"]
    tokens = draw_once(BatchSampler(), logits, [params] * 20_000)
    observed = torch.bincount(tokens, minlength=V_SMALL)
    probs = torch.softmax(logits / params.temperature, -1)
    sorted_p, order = probs.sort(descending=True)
    n_keep = int(((sorted_p.cumsum(0) - sorted_p) < params.top_p).sum())
    assert torch.equal(reference_probs(params, logits) > 0, torch.zeros(V_SMALL).index_fill(0, order[:n_keep], 1) > 0)
    wrong = torch.zeros(V_SMALL).index_fill(0, order[:n_keep + 1], 1) * probs
    assert chi_square_p(observed, wrong / wrong.sum()) < 1e-6
    assert chi_square_p(observed, reference_probs(params, logits)) > ALPHA


def test_penalized_distribution_matches_twin():
    """After a forced first token, the second draw's distribution is the twin's with that count."""
    first = torch.full((V_SMALL,), -50.0)
    first[4] = 50.0
    logits = small_logits()
    params = SamplingParams(max_tokens=9, temperature=0.9, top_p=0.95, presence_penalty=0.7, frequency_penalty=0.6)
    sampler = BatchSampler()
    states = [sampler.open(SamplingParams(**{**params.__dict__, "seed": i})) for i in range(20_000)]
    assert bool((sampler.sample(first.expand(len(states), -1).contiguous(), states) == 4).all())
    tokens = sampler.sample(logits.expand(len(states), -1).contiguous(), states)
    observed = torch.bincount(tokens, minlength=V_SMALL)
    probs = reference_probs(params, logits, {4: 1})
    assert chi_square_p(observed, probs) > ALPHA
    assert chi_square_p(observed, reference_probs(params, logits)) < 1e-6  # the penalty is felt


def test_greedy_with_penalties_equals_twin_over_steps():
    g = torch.Generator().manual_seed(1)
    params = [SamplingParams(max_tokens=50, temperature=0, presence_penalty=pp, frequency_penalty=fp)
              for pp, fp in [(0.0, 0.0), (1.5, 0.0), (0.0, 0.8), (0.9, 0.9), (-0.5, 0.3)]]
    sampler = BatchSampler()
    states = [sampler.open(p) for p in params]
    twins = [Sampler(p) for p in params]
    base = torch.randn(300, generator=g) * 2
    for _ in range(40):
        logits = base + 0.3 * torch.randn(len(params), 300, generator=g)  # [B, V]: a few tokens stay on top
        got = sampler.sample(logits, states).tolist()
        assert got == [t.sample(row) for t, row in zip(twins, logits, strict=True)]
    assert len({tuple(t.counts.items()) for t in twins}) > 1  # the penalties changed the picks


def test_count_slots_are_reused_clean():
    sampler = BatchSampler()
    hot = torch.zeros(1, 20)
    hot[0, 2] = 1.0
    p = SamplingParams(max_tokens=9, temperature=0, presence_penalty=5.0)
    a = sampler.open(p)
    assert sampler.sample(hot, [a]).tolist() == [2]
    assert sampler.sample(hot, [a]).tolist() != [2]  # 2 is penalized now
    sampler.close(a)
    b = sampler.open(p)
    assert b.slot == 0  # a's slot, zeroed
    assert sampler.sample(hot, [b]).tolist() == [2]


def test_seeded_draws_do_not_depend_on_the_batch():
    """Same seed, same logits row: the same tokens alone, at another position among rows that
    need a sort, or among greedy rows; another seed gives other tokens."""
    g = torch.Generator().manual_seed(5)
    vocab = 1000
    rows = torch.randn(6, 8, vocab, generator=g)  # [steps, B, V]
    mine = SamplingParams(max_tokens=9, temperature=1.0, seed=42)
    others = [SamplingParams(max_tokens=9, temperature=0.5, top_p=0.7, seed=7),
              SamplingParams(max_tokens=9, temperature=0), SamplingParams(max_tokens=9, top_k=3, seed=8)]

    def run(position: int, neighbours: list[SamplingParams], params: SamplingParams = mine) -> list[int]:
        sampler = BatchSampler()
        states = [sampler.open(p) for p in neighbours]
        states.insert(position, sampler.open(params))
        out = []
        for step in rows:
            logits = step[:len(states)].clone()
            logits[position] = step[7]  # my row is the same at every position
            out.append(int(sampler.sample(logits, states)[position]))
        return out

    alone = run(0, [])
    assert run(3, [others[0], others[2], others[1], others[0]]) == alone
    assert run(1, [others[1], others[1]]) == alone
    assert run(0, [], SamplingParams(**{**mine.__dict__, "seed": 43})) != alone


@pytest.mark.parametrize("name, params, logit_scale", [
    ("top_k", SamplingParams(max_tokens=1, temperature=1.0, top_k=20), 1.0),
    ("top_p", SamplingParams(max_tokens=1, temperature=0.7, top_p=0.7), 5.0),
    ("min_p", SamplingParams(max_tokens=1, temperature=1.0, min_p=0.02), 4.0),
    ("all", SamplingParams(max_tokens=1, temperature=1.2, top_k=50, top_p=0.9, min_p=0.01), 4.0),
])
def test_filters_keep_the_twins_support_at_full_vocab(name, params, logit_scale):
    """At V = 151,936: every draw lies in the twin's support, and a narrow support is covered."""
    vocab = 151_936
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(11)) * logit_scale
    support = reference_probs(params, logits) > 0
    n_support = int(support.sum())
    assert 1 < n_support < 200, f"{name}: the case should cut the vocab to a narrow support"
    tokens = draw_once(BatchSampler(), logits, [params] * 48)
    assert bool(support[tokens].all()), f"{name}: drew outside the twin's support"
    if n_support <= 4:
        assert set(tokens.tolist()) == set(support.nonzero()[:, 0].tolist())
