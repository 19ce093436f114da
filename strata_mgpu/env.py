"""Every STRATA_* environment variable, typed, with its default and meaning. Nothing else reads os.environ."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    meaning: str

    def raw(self) -> str | None:
        v = os.environ.get(self.name)
        return self.default if v is None or v == "" else v


CACHE_DIR = EnvVar("STRATA_CACHE_DIR", None, "where the built-in demo model is written (default: the user cache dir)")
LOG_LEVEL = EnvVar("STRATA_LOG_LEVEL", "INFO", "logging level of the server and engine (DEBUG, INFO, WARNING, ...)")

PREFILL_HELP = EnvVar("STRATA_PREFILL_HELP", "1",
                      "0 turns the PeerPrefill helper off (the idle stage streaming a share of a one-chunk prompt)")
PREFILL_HELP_FRAC = EnvVar("STRATA_PREFILL_HELP_FRAC", None,
                           "the helper's share of each layer's experts: auto (the rate model, default), rule "
                           "(min(0.45, 0.5 - T/16384), off below 0.3) or a fixed share 0 < f < 1")
HELP_HALVES = EnvVar("STRATA_HELP_HALVES", "0",
                     "a helped one-chunk prompt of at least this many tokens runs each layer in two halves of "
                     "rows, so the busy stage works on one half while the other's hand-over is in flight; 0 "
                     "(default): never (on two H200s the helped layer is host-bound, and halves add launches)")

KV_PREFETCH = EnvVar("STRATA_KV_PREFETCH", "1",
                     "1 uploads the next attention layer's host KV prefix on a side stream while the current "
                     "layer computes")

STAGE_THREADS = EnvVar("STRATA_STAGE_THREADS", "1",
                       "1 gives each GPU stage of a --layer-split its own host thread queuing its work, so a "
                       "stage held up by its card's full launch queue does not hold up the others; 0: one "
                       "thread queues every stage in turn")

DECODE_GRAPH_BATCH = EnvVar("STRATA_DECODE_GRAPH_BATCH", "8",
                            "the largest decode batch replayed as a CUDA graph per stage (larger batches run "
                            "eagerly); where every expert is resident a batch takes the graph of the next power of "
                            "two (1, 2, 4, 8, ...), its spare rows padded, elsewhere the graph of its own size; "
                            "graphs are captured when the engine starts, or at a size's first use")

ALL = (CACHE_DIR, LOG_LEVEL, PREFILL_HELP, PREFILL_HELP_FRAC, HELP_HALVES, KV_PREFETCH, STAGE_THREADS,
       DECODE_GRAPH_BATCH)


def cache_dir() -> Path:
    raw = CACHE_DIR.raw()
    if raw:
        return Path(raw).expanduser()
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("strata-mgpu"))


def log_level() -> str:
    raw = (LOG_LEVEL.raw() or "INFO").upper()
    if raw not in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"):
        raise EnvError(f"{LOG_LEVEL.name}={raw!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return raw


def prefill_help() -> bool:
    raw = (PREFILL_HELP.raw() or "1").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{PREFILL_HELP.name}={raw!r}: expected 0 or 1")


def parse_help_frac(raw: str | float, source: str) -> float | str:
    """'auto', 'rule' or a share strictly between 0 and 1; `source` names the setting in the error."""
    text = str(raw).strip().lower()
    if text in ("auto", "rule"):
        return text
    try:
        frac = float(text)
    except ValueError:
        raise EnvError(f"{source}={raw!r}: expected auto, rule or a number between 0 and 1") from None
    if not 0 < frac < 1:
        raise EnvError(f"{source}={raw!r}: the share must lie strictly between 0 and 1")
    return frac


def prefill_help_frac() -> float | str | None:
    """None when unset (the policy's default, auto)."""
    raw = PREFILL_HELP_FRAC.raw()
    return None if raw is None else parse_help_frac(raw, PREFILL_HELP_FRAC.name)


def help_halves() -> int:
    """Tokens from which a helped prompt runs in two halves (0: never, the default: on two H200s halves
    beat all rows at once only at 6-8K and share 0.45, by 7%, and lost up to 24% at 1-4K)."""
    raw = (HELP_HALVES.raw() or HELP_HALVES.default).strip()
    if not raw.isdecimal() or not raw.isascii():
        raise EnvError(f"{HELP_HALVES.name}={raw!r}: expected a whole number of tokens (0: never)")
    return int(raw)


def _zero_or_one(var: EnvVar) -> bool:
    raw = (var.raw() or "").strip()  # the default where unset or empty
    if raw not in ("0", "1"):
        raise EnvError(f"{var.name}={raw!r}: expected 0 or 1")
    return raw == "1"


def kv_prefetch() -> bool:
    """On by default: a 32K prompt with spilled KV ran 26% shorter with it on the H200."""
    return _zero_or_one(KV_PREFETCH)


def stage_threads() -> bool:
    """On by default: one thread queuing both stages let them overlap 0.34 s of a 2 s prompt."""
    return _zero_or_one(STAGE_THREADS)


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def default_allocator_config() -> None:
    """Give torch's CUDA allocator expandable segments unless the user configured it: under a
    --max-vram budget, prompts of changing lengths fragmented the fixed segments until an 8K
    prompt at 8,8 GiB ran out of memory with 1 GB reserved but unusable (two H200s); with
    expandable segments it ran. Call before the first CUDA allocation (the CLI's entry does)."""
    os.environ.setdefault(ALLOC_CONF, "expandable_segments:True")


def decode_graph_batch() -> int:
    raw = (DECODE_GRAPH_BATCH.raw() or DECODE_GRAPH_BATCH.default).strip()
    if not (raw.isdecimal() and raw.isascii()) or not 1 <= int(raw) <= 64:
        raise EnvError(f"{DECODE_GRAPH_BATCH.name}={raw!r}: expected a whole number from 1 to 64")
    return int(raw)
