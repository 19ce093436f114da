"""How much of a one-chunk prompt's experts the idle stage's helper takes."""

from __future__ import annotations

from dataclasses import dataclass

from strata_mgpu import env

MAX_SHARE = 0.45
MIN_SHARE = 0.3  # below this the hand-overs cost more than the second link brings


def default_share(tokens: int) -> float:
    """min(0.45, 0.5 - T/16384), off below 0.3 (prompts over about 3.3K tokens): longer prompts
    compute longer per expert byte, and the helper's share must shrink to stay hidden."""
    share = min(MAX_SHARE, 0.5 - tokens / 16384)
    return share if share >= MIN_SHARE else 0.0


@dataclass(frozen=True)
class HelpPolicy:
    enabled: bool = True
    fixed_share: float | None = None  # overrides the rule

    @classmethod
    def resolve(cls, flag: bool | None, frac: float | None) -> HelpPolicy:
        """CLI flags win over the environment, which wins over the defaults (raises EnvError)."""
        enabled = env.prefill_help() if flag is None else flag
        fixed = env.prefill_help_frac() if frac is None else frac
        return cls(enabled=enabled, fixed_share=fixed)

    def share(self, tokens: int, across_cards: bool = True) -> float:
        """The helper's share for a one-chunk prompt of `tokens`. Where helper and busy stage sit
        on one card there is no second link to use and the rule says 0 (measured: 6-12% slower
        on one H200); a fixed share still applies (tests, the sweep)."""
        if not self.enabled:
            return 0.0
        if self.fixed_share is not None:
            return self.fixed_share
        return default_share(tokens) if across_cards else 0.0
