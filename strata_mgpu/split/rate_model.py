"""The helper's share from measured rates: what bounds one layer of a helped one-chunk prompt.

Per layer of the busy stage (the helper takes the share s of its E experts, T prompt tokens):

- busy link:   (1 - s) * bytes / link_busy + T * back / mapped        its experts, the sums read back
- helper link: s * bytes / link_helper + T * to_helper / mapped       its experts, h and routing read
               + helper_latency                                       the lock-step: h_i before layer i
- chain:       chain_latency + other * T                              attention, router (busy only)
               + T * (to_helper + back) / mapped     [in line only]   the busy stream's publish + collect
               + max((1 - s) * expert * T,                            the busy's own rows
                     T * (to_helper + back) / mapped + s * expert * T)  the helper's: in, rows, out

A layer takes the largest of the three (uploads run two layers ahead, so links and compute
overlap). "In line": hand-over copies are kernels on a compute stream; `overlapped=True` models
the busy stage's two copies leaving it. Mapped-memory reads take link time at `mapped` bytes/s.
Unhelped, a layer takes max(bytes / link_busy, (other + expert) * T). Each stage adds its last
layer's compute once and `fixed_s`.

The defaults are a least-squares fit on log time to the two-H200 share sweep of issue #13;
docs/MULTI_GPU.md has the sweep, the fit and its error.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from strata_mgpu.stage.host.link import link_rate, measure_link_rate
from strata_mgpu.stage.stage import Stage

# issue #13's H200s, see the module docstring
H200_OTHER_S_PER_TOKEN = 0.30e-6
H200_EXPERT_S_PER_TOKEN = 0.15e-6
H200_MAPPED_BYTES_PER_S = 23e9
H200_HELPER_LATENCY_S = 0.12e-3
H200_CHAIN_LATENCY_S = 0.52e-3
H200_FIXED_S = -2.5e-3  # per stage: the later stage's ring loads its first layers while the earlier runs

MIN_GAIN = 0.02  # help only where the model promises this much: about its error on the H200 table


@dataclass(frozen=True)
class StageLoad:
    """What one busy stage streams and over which links (from its arena and the link probes)."""

    first_layer: int  # names the stage
    layers: int
    streamed_bytes: float  # expert bytes streamed per layer (the non-resident ones), mean over layers
    n_experts: int
    link_busy: float | None  # bytes/s, pinned H2D of the busy stage's card; None: not measured (CPU)
    link_helper: float | None  # bytes/s, of the helper's card
    to_helper_bytes: int  # per token per layer: h [D] and the routing [A] (int64 experts, fp32 weights)
    back_bytes: int  # per token per layer: the helper's weighted sums [D]


@dataclass(frozen=True)
class ComputeRates:
    """What the prompt times say beyond the links (defaults: the H200 fit; refined by observation)."""

    other_s_per_token: float = H200_OTHER_S_PER_TOKEN  # attention, norms, router: one layer
    expert_s_per_token: float = H200_EXPERT_S_PER_TOKEN  # all A routed rows of a token: one layer
    mapped_bytes_per_s: float = H200_MAPPED_BYTES_PER_S  # hand-over copies through mapped memory
    helper_latency_s: float = H200_HELPER_LATENCY_S  # per layer, on the helper's link
    chain_latency_s: float = H200_CHAIN_LATENCY_S  # per layer, on the compute chain
    fixed_s: float = H200_FIXED_S  # per stage and prompt
    overlapped: bool = False  # the busy stage's hand-over copies off its compute stream


def layer_seconds(load: StageLoad, rates: ComputeRates, share: float, tokens: int) -> float:
    t, s = tokens, share
    compute = (rates.other_s_per_token + rates.expert_s_per_token) * t
    assert load.link_busy is not None
    if s <= 0:
        return max(load.streamed_bytes / load.link_busy, compute)
    assert load.link_helper is not None
    back = t * load.back_bytes / rates.mapped_bytes_per_s
    to_helper = t * load.to_helper_bytes / rates.mapped_bytes_per_s
    busy_link = (1 - s) * load.streamed_bytes / load.link_busy + back
    helper_link = s * load.streamed_bytes / load.link_helper + to_helper + rates.helper_latency_s
    in_line = 0.0 if rates.overlapped else to_helper + back
    chain = (rates.chain_latency_s + rates.other_s_per_token * t + in_line
             + max((1 - s) * rates.expert_s_per_token * t, to_helper + back + s * rates.expert_s_per_token * t))
    return max(busy_link, helper_link, chain)


def stage_seconds(load: StageLoad, rates: ComputeRates, share: float, tokens: int) -> float:
    tail = (rates.other_s_per_token + rates.expert_s_per_token) * tokens
    return load.layers * layer_seconds(load, rates, share, tokens) + tail + rates.fixed_s


def binding_term(load: StageLoad, rates: ComputeRates, share: float, tokens: int) -> str:
    """'link' or 'chain' (helped), 'link' or 'compute' (not)."""
    assert load.link_busy is not None
    if share <= 0:
        compute = (rates.other_s_per_token + rates.expert_s_per_token) * tokens
        return "compute" if compute > load.streamed_bytes / load.link_busy else "link"
    assert load.link_helper is not None
    busy = (1 - share) * load.streamed_bytes / load.link_busy + tokens * load.back_bytes / rates.mapped_bytes_per_s
    helper = (share * load.streamed_bytes / load.link_helper + tokens * load.to_helper_bytes / rates.mapped_bytes_per_s
              + rates.helper_latency_s)
    return "chain" if layer_seconds(load, rates, share, tokens) > max(busy, helper) else "link"


def best_share(load: StageLoad, rates: ComputeRates, tokens: int, min_gain: float = MIN_GAIN) -> float:
    """The share n/E (n = 0..E-1) with the least predicted time; 0 when none saves `min_gain` of the
    unhelped time, or a link is unmeasured."""
    if load.link_busy is None or load.link_helper is None:
        return 0.0
    off = stage_seconds(load, rates, 0.0, tokens)
    n_best = min(range(1, load.n_experts), key=lambda n: stage_seconds(load, rates, n / load.n_experts, tokens))
    share = n_best / load.n_experts
    return share if stage_seconds(load, rates, share, tokens) <= (1 - min_gain) * off else 0.0


def link_bounds(load: StageLoad, tokens: int) -> tuple[float, float]:
    """Lower bounds of the busy stage's part from its links alone (every byte at DMA rate): unhelped,
    its streamed bytes over its link; helped, the larger of the two links' loads at the balancing share."""
    assert load.link_busy is not None and load.link_helper is not None
    total = load.layers * load.streamed_bytes
    off = total / load.link_busy
    back = load.layers * tokens * load.back_bytes / load.link_busy
    to_helper = load.layers * tokens * load.to_helper_bytes / load.link_helper
    # (1-s) total / Lb + back = s total / Lh + to_helper, solved for s in [0, 1]
    s = (total / load.link_busy + back - to_helper) / (total / load.link_busy + total / load.link_helper)
    s = min(1.0, max(0.0, s))
    return off, min(off, one_chunk_link_bound([(load, s, True, 0.0, 0.0)], tokens))


def one_chunk_link_bound(stages: list[tuple[StageLoad, float, bool, float, float]], tokens: int) -> float:
    """Lower bound (s) of a one-chunk prompt on a split from its links alone (every byte at DMA rate),
    summed over the busy stages. Each is given as (its load, the fraction f of its streamed bytes its
    helper took, whether the helper's card is another, the bytes its rings may take in before its
    turn). Helped, the larger of the two links' loads, or their sum where they share one card; each
    side less what its ring may hold early (more only loosens the bound)."""
    total = 0.0
    for load, f, across, early_busy, early_helper in stages:
        assert load.link_busy is not None and load.link_helper is not None
        streamed = load.layers * load.streamed_bytes
        busy = max(0.0, (1 - f) * streamed - early_busy)
        if f <= 0:
            total += busy / load.link_busy
            continue
        busy += load.layers * tokens * load.back_bytes
        helper = max(0.0, f * streamed - early_helper) + load.layers * tokens * load.to_helper_bytes
        total += max(busy / load.link_busy, helper / load.link_helper) if across else (busy + helper) / load.link_busy
    return total


def stage_load(busy: Stage, idle: Stage) -> StageLoad:
    """The load of `busy` (a Stage) helped by `idle`'s card (runs the link probes where the Stage did not)."""
    spec = busy.spec
    elem = busy.model.w.dtype.itemsize
    # only the experts that are not resident stream (and only those can be helped with)
    return StageLoad(first_layer=busy.layers.start, layers=len(busy.layers),
                     streamed_bytes=busy.experts.pass_bytes() / len(busy.layers), n_experts=spec.n_experts,
                     link_busy=link_rate(busy.ctx) or measure_link_rate(busy.ctx),
                     link_helper=link_rate(idle.ctx) or measure_link_rate(idle.ctx),
                     to_helper_bytes=spec.hidden * elem + spec.n_experts_used * (8 + 4),
                     back_bytes=spec.hidden * elem)


# --- refining the rates from timed prompts ----------------------------------------------------

STEP_WEIGHT = 0.5  # how far one prompt moves an estimate toward what it says
MAX_STEP = 2.0  # one prompt moves a rate by at most this factor (a host hiccup is not a new card)


class RateEstimate:
    """The `ComputeRates` the auto share uses, refined by timed one-chunk prompts.

    `observe` compares a prompt's time with the stages' predictions and moves halfway the one term
    that bound it: compute rates (unhelped, compute-bound), the fixed cost (unhelped, link-bound),
    the hand-over (helped, chain-bound) or the helper's latency (helped, link-bound). Terms no prompt
    exercised keep their defaults.
    """

    def __init__(self, rates: ComputeRates | None = None):
        self.rates = rates or ComputeRates()
        self.loads: dict[int, StageLoad] = {}  # first layer -> the busy stage's load, as last seen
        self.observed = 0

    def share(self, load: StageLoad, tokens: int) -> float:
        self.loads[load.first_layer] = load
        return best_share(load, self.rates, tokens)

    def _measured_loads(self) -> list[StageLoad]:
        return [x for x in self.loads.values() if x.link_busy is not None and x.link_helper is not None]

    def predict(self, tokens: int, share: float | None = None) -> float | None:
        """Seconds of a one-chunk prompt over the stages seen, at `share` (None: each stage's pick)."""
        loads = self._measured_loads()
        if not loads:
            return None
        return sum(stage_seconds(x, self.rates, best_share(x, self.rates, tokens) if share is None else share,
                                 tokens) for x in loads)

    def observe(self, tokens: int, share: float | None, seconds: float) -> None:
        """A one-chunk prompt of `tokens` took `seconds` (host clock, end to end, not the first prompt:
        it carries warm-up) with every stage's helper at `share` (None: the picks)."""
        predicted = self.predict(tokens, share)
        if predicted is None or predicted <= 0 or not 0 < seconds < float("inf"):
            return
        loads = self._measured_loads()
        first = loads[0]
        s = best_share(first, self.rates, tokens) if share is None else share
        ratio = min(MAX_STEP, max(1 / MAX_STEP, seconds / predicted))
        step = ratio ** STEP_WEIGHT
        r = self.rates
        layers = sum(x.layers for x in loads)
        residual = STEP_WEIGHT * (seconds - predicted)
        residual = min(abs(residual), (MAX_STEP - 1) * predicted) * (1 if residual >= 0 else -1)
        term = binding_term(first, r, s, tokens)
        if s <= 0 and term == "compute":
            r = replace(r, other_s_per_token=r.other_s_per_token * step, expert_s_per_token=r.expert_s_per_token * step)
        elif s <= 0:
            r = replace(r, fixed_s=r.fixed_s + residual / len(loads))
        elif term == "chain":
            r = replace(r, mapped_bytes_per_s=r.mapped_bytes_per_s / step, chain_latency_s=r.chain_latency_s * step)
        else:
            link_layer = first.streamed_bytes / min(first.link_busy or 1.0, first.link_helper or 1.0)
            r = replace(r, helper_latency_s=min(link_layer, max(0.0, r.helper_latency_s + residual / layers)))
        self.rates = r
        self.observed += 1
