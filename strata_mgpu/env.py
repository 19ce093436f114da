"""Every STRATA_* environment variable, typed, with its default and meaning. Nothing else reads os.environ.

The variables are read once, at start-up, into a frozen `EnvOptions` (`read()`); every command of
the CLI does so before anything else, whatever it goes on to do, so a bad value is a one-line error
at once rather than wherever its reader would have run. The runtime takes the values from there
(`config.StageSwitches` and `config.Placement`), never from the environment.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


class EnvError(ValueError):
    """An environment variable holds a value that cannot be used."""


@dataclass(frozen=True)
class EnvVar:
    name: str
    default: str | None
    meaning: str

    def raw(self, environ: Mapping[str, str]) -> str | None:
        """The value set, or the default where unset or empty."""
        v = environ.get(self.name)
        return self.default if v is None or v == "" else v


CACHE_DIR = EnvVar("STRATA_CACHE_DIR", None, "where the built-in demo model is written (default: the user cache dir)")
LOG_LEVEL = EnvVar("STRATA_LOG_LEVEL", "INFO", "logging level of the server and engine (DEBUG, INFO, WARNING, ...)")

PREFILL_HELP = EnvVar("STRATA_PREFILL_HELP", "1",
                      "0 turns the PeerPrefill helper off (the idle stage streaming a share of a one-chunk prompt)")
PREFILL_HELP_FRAC = EnvVar("STRATA_PREFILL_HELP_FRAC", "auto",
                           "the helper's share of each layer's experts: auto (the rate model, default), rule "
                           "(min(0.45, 0.5 - T/16384), off below 0.3) or a fixed share 0 < f < 1")
HELP_HALVES = EnvVar("STRATA_HELP_HALVES", "0",
                     "a helped one-chunk prompt of at least this many tokens runs each layer in two halves of "
                     "rows, so the busy stage works on one half while the other's hand-over is in flight; 0 "
                     "(default): never (where the host's launches bind a helped layer, halves add to them)")

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

HOST_PROMPT_HELP = EnvVar("STRATA_HOST_PROMPT_HELP", "0",
                          "1 lets a GPU stage whose decode hands experts to the host's cores (--cpu-experts) also "
                          "give a streamed prompt pass of at most 64 rows a share of each layer's streamed experts "
                          "there (the link streams fewer); 0 (default): on one H200 it made such prompts 3-6x slower")

DENSE_BLOCKS = EnvVar("STRATA_DENSE_BLOCKS", "1",
                      "1 (default) keeps a GPU stage's attention projections and head as the file's blocks where "
                      "they are Q4_0, Q8_0, Q4_K, Q5_K, Q6_K or MXFP4 (decode multiplies them in place, prompts "
                      "through a transient bf16 copy); 0: bf16 copies of every one (twice Q8_0's VRAM)")

ADAPT_THREADS = EnvVar("STRATA_ADAPT_THREADS", "1",
                       "1 (default): a CPU stage computes on the count of its --threads its calls measure fastest "
                       "(probing one fewer or more now and then, at once when its threads wait for cores), fewer "
                       "while other processes keep the cores busy; 0: always on --threads")

GATHER_ROWS = EnvVar("STRATA_GATHER_ROWS", "auto",
                     "where some experts stream, a pass of at least this many rows streams whole layers and a "
                     "shorter one gathers only its picked experts; auto (default): the break-even of the link "
                     "probe's rate, the mapped reads' and the expert cache's hit rate (docs/ARCHITECTURE.md)")

RESIDENCY_HALF_LIFE = EnvVar("STRATA_RESIDENCY_HALF_LIFE", "512",
                             "decode steps over which an expert's pick count halves: which experts stay resident "
                             "follows the picks of about this many recent steps")

RESIDENCY_SWAPS = EnvVar("STRATA_RESIDENCY_SWAPS", "4",
                         "experts a decode step moves into VRAM at most (uploads on the upload stream, beside the "
                         "step); 0 keeps the experts resident at load")

DELTA_SCAN = EnvVar("STRATA_DELTA_SCAN", "fla",
                    "what computes a hybrid model's DeltaNet rows of a prompt on a GPU: fla (default; fla-core's "
                    "Triton kernels where `pip install fla-core` put them, else torch, said once) or torch (the "
                    "plain chunked scan, the CPU's path)")

ALL = (CACHE_DIR, LOG_LEVEL, PREFILL_HELP, PREFILL_HELP_FRAC, HELP_HALVES, KV_PREFETCH, STAGE_THREADS,
       DECODE_GRAPH_BATCH, HOST_PROMPT_HELP, DENSE_BLOCKS, ADAPT_THREADS, GATHER_ROWS, RESIDENCY_HALF_LIFE,
       RESIDENCY_SWAPS, DELTA_SCAN)

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def parse_help_frac(raw: str | float, source: str) -> float | str:
    """'auto', 'rule' or a share strictly between 0 and 1; `source` names the setting in the error
    (the variable, or `--prefill-help-frac`: the one parser of both)."""
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


def _on_off(raw: str, name: str) -> bool:
    text = raw.strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise EnvError(f"{name}={raw!r}: expected 0 or 1")


def _choice(raw: str, name: str, choices: tuple[str, ...]) -> str:
    text = raw.strip().lower()
    if text not in choices:
        raise EnvError(f"{name}={raw!r}: expected {' or '.join(choices)}")
    return text


def _zero_or_one(raw: str, name: str) -> bool:
    if raw.strip() not in ("0", "1"):
        raise EnvError(f"{name}={raw!r}: expected 0 or 1")
    return raw.strip() == "1"


def _whole_number(raw: str, name: str, low: int, high: int | None, expected: str) -> int:
    text = raw.strip()
    # isdecimal alone admits digits int() reads but a user did not mean (a superscript is isdigit only)
    if not (text.isascii() and text.isdecimal()) or int(text) < low or (high is not None and int(text) > high):
        raise EnvError(f"{name}={raw!r}: expected {expected}")
    return int(text)


def _log_level(raw: str, name: str) -> str:
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise EnvError(f"{name}={raw!r}: expected DEBUG, INFO, WARNING, ERROR or CRITICAL")
    return level


@dataclass(frozen=True)
class EnvOptions:
    """Every STRATA_* variable, parsed and checked; the defaults are the variables' own."""

    cache_dir: Path | None = None  # None: the user cache dir
    log_level: str = "INFO"
    prefill_help: bool = True
    prefill_help_frac: float | str = "auto"  # 'auto', 'rule' or a share 0 < f < 1
    help_halves: int = 0  # tokens from which a helped prompt runs in two halves; 0: never
    kv_prefetch: bool = True
    stage_threads: bool = True
    decode_graph_batch: int = 8
    host_prompt_help: bool = False
    dense_blocks: bool = True
    adapt_threads: bool = True
    gather_rows: int | None = None  # None: auto
    residency_half_life: int = 512
    residency_swaps: int = 4
    delta_scan: str = "fla"  # fla or torch

    @property
    def demo_dir(self) -> Path:
        """Where the built-in demo model is written."""
        if self.cache_dir is not None:
            return self.cache_dir
        from platformdirs import user_cache_dir

        return Path(user_cache_dir("strata-mgpu"))


def read(environ: Mapping[str, str] | None = None) -> EnvOptions:
    """Every variable of `environ` (default: the process's), parsed; the first bad value raises
    a one-line EnvError naming the variable."""
    environ = os.environ if environ is None else environ

    def raw(var: EnvVar) -> str:
        value = var.raw(environ)
        assert value is not None, f"{var.name} has a default"
        return value

    cache = CACHE_DIR.raw(environ)
    return EnvOptions(
        cache_dir=Path(cache).expanduser() if cache else None,
        log_level=_log_level(raw(LOG_LEVEL), LOG_LEVEL.name),
        prefill_help=_on_off(raw(PREFILL_HELP), PREFILL_HELP.name),
        prefill_help_frac=parse_help_frac(raw(PREFILL_HELP_FRAC), PREFILL_HELP_FRAC.name),
        help_halves=_whole_number(raw(HELP_HALVES), HELP_HALVES.name, 0, None, "a whole number of tokens (0: never)"),
        kv_prefetch=_zero_or_one(raw(KV_PREFETCH), KV_PREFETCH.name),
        stage_threads=_zero_or_one(raw(STAGE_THREADS), STAGE_THREADS.name),
        decode_graph_batch=_whole_number(raw(DECODE_GRAPH_BATCH), DECODE_GRAPH_BATCH.name, 1, 64,
                                         "a whole number from 1 to 64"),
        host_prompt_help=_zero_or_one(raw(HOST_PROMPT_HELP), HOST_PROMPT_HELP.name),
        dense_blocks=_zero_or_one(raw(DENSE_BLOCKS), DENSE_BLOCKS.name),
        adapt_threads=_zero_or_one(raw(ADAPT_THREADS), ADAPT_THREADS.name),
        gather_rows=(None if raw(GATHER_ROWS).strip().lower() == "auto" else
                     _whole_number(raw(GATHER_ROWS), GATHER_ROWS.name, 1, None, "auto or a whole number of rows")),
        residency_half_life=_whole_number(raw(RESIDENCY_HALF_LIFE), RESIDENCY_HALF_LIFE.name, 1, None,
                                          "a whole number of decode steps, at least 1"),
        residency_swaps=_whole_number(raw(RESIDENCY_SWAPS), RESIDENCY_SWAPS.name, 0, None,
                                      "a whole number of experts (0: none)"),
        delta_scan=_choice(raw(DELTA_SCAN), DELTA_SCAN.name, ("fla", "torch")),
    )


def read_or_exit() -> EnvOptions:
    """`read()` for a tool's own main: a bad value ends the process with its one-line message
    and exit status 1, as the CLI's commands do."""
    try:
        return read()
    except EnvError as e:
        raise SystemExit(f"error: {e}") from None


OMP_WAIT, OMP_SPIN = "OMP_WAIT_POLICY", "GOMP_SPINCOUNT"
# libgomp's spins before an idle OpenMP thread sleeps: long enough to catch the next parallel region of
# a decode step on a quiet host, short enough that threads sleep while other processes want the cores
# (its own default, 300,000, and ACTIVE's unbounded spinning collapse decode under load; PASSIVE's
# sleeping at once halves it on a quiet host: docs/BENCHMARKS.md, "A CPU stage on a shared host")
OMP_SPINS = "20000"


def default_omp_wait_policy() -> None:
    """Bound how long torch's OpenMP threads spin between parallel regions (ACTIVE, OMP_SPINS spins,
    then they sleep) unless the user set either variable (docs/CONFIG.md). libgomp reads them once,
    when torch loads it: the package sets them on import, before anything of it imports torch."""
    if OMP_WAIT not in os.environ and OMP_SPIN not in os.environ:
        os.environ[OMP_WAIT], os.environ[OMP_SPIN] = "ACTIVE", OMP_SPINS


ALLOC_CONF = "PYTORCH_CUDA_ALLOC_CONF"


def default_allocator_config() -> None:
    """Give torch's CUDA allocator expandable segments unless the user configured it: under a
    --max-vram budget, prompts of changing lengths fragment fixed segments until a long prompt
    runs out of memory with memory reserved but unusable (docs/CONFIG.md). Call before the first
    CUDA allocation (the CLI's entry does)."""
    os.environ.setdefault(ALLOC_CONF, "expandable_segments:True")
