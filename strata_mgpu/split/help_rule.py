"""How much of a one-chunk prompt's experts the idle stage's helper takes.

Three modes (`--prefill-help-frac` / STRATA_PREFILL_HELP_FRAC): `auto`, the default, the share the
rate model (`split.rate_model`) predicts fastest; `rule`, min(0.45, 0.5 - T/16384) off below 0.3
(fitted on two RTX 3090s, kept selectable); or a fixed share 0 < f < 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata_mgpu.split.rate_model import RateEstimate, StageLoad

MAX_SHARE = 0.45
MIN_SHARE = 0.3  # below this the hand-overs cost more than the second link brings (on the 3090s)


def default_share(tokens: int) -> float:
    """The rule: longer prompts compute longer per expert byte, and the helper's share must shrink to
    stay hidden."""
    share = min(MAX_SHARE, 0.5 - tokens / 16384)
    return share if share >= MIN_SHARE else 0.0


@dataclass(frozen=True)
class HelpPolicy:
    """Which share each busy stage's helper takes. A fixed share wins over the mode; `auto` and `rule`
    give 0 where helper and busy stage share a card (one link: the helper adds hand-overs and saves
    no link time), a fixed share still applies there (tests, the sweep)."""

    enabled: bool = True
    fixed_share: float | None = None  # overrides the mode
    mode: str = "auto"  # 'auto' or 'rule'
    estimate: RateEstimate = field(default_factory=RateEstimate, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "rule"):
            raise ValueError(f"help mode {self.mode!r}: auto or rule")

    @classmethod
    def fixed(cls, share: float) -> HelpPolicy:
        """The helper at `share` of each busy stage's streamed experts; 0: no helper (measurements)."""
        return cls(enabled=share > 0, fixed_share=share if share > 0 else None)

    @classmethod
    def of(cls, enabled: bool, share: float | str) -> HelpPolicy:
        if isinstance(share, float):
            return cls(enabled=enabled, fixed_share=share)
        return cls(enabled=enabled, mode=share)

    def share(self, tokens: int, across_cards: bool = True, load: StageLoad | None = None) -> float:
        """The helper's share for a one-chunk prompt of `tokens`; `auto` needs the busy stage's `load` and
        gives 0 without measured links (the CPU)."""
        if not self.enabled:
            return 0.0
        if self.fixed_share is not None:
            return self.fixed_share
        if not across_cards:
            return 0.0
        if self.mode == "rule":
            return default_share(tokens)
        if load is None:
            raise ValueError("the auto help share needs the busy stage's load")
        return self.estimate.share(load, tokens)

    def observe(self, tokens: int, share: float | None, seconds: float) -> None:
        if self.mode == "auto" and self.fixed_share is None:
            self.estimate.observe(tokens, share, seconds)
