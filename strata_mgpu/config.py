"""Runtime configuration: frozen dataclasses built once by the CLI from its flags and the environment
(`env.EnvOptions`); the model's own shapes live in `model.spec.ModelSpec`, read from the GGUF.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Self

from gguf.constants import GGMLQuantizationType

from strata_mgpu.env import EnvOptions, parse_help_frac

# What a KV cache may store keys or values as (--cache-type-k / --cache-type-v, llama.cpp's names
# lower-cased): BF16 is the plain cell in the compute dtype, Q8_0 ggml's 8-bit blocks (`model.kv_cache`)
KV_CACHE_TYPES = (GGMLQuantizationType.BF16, GGMLQuantizationType.Q8_0)
KV_CACHE_TYPE_NAMES = tuple(t.name.lower() for t in KV_CACHE_TYPES)


def parse_cache_type(text: str, option: str) -> GGMLQuantizationType:
    """'bf16' or 'q8_0' (any case) -> its type; ValueError naming `option` otherwise."""
    if text.strip().lower() not in KV_CACHE_TYPE_NAMES:
        raise ValueError(f"{option} {text!r}: one of {', '.join(KV_CACHE_TYPE_NAMES)}")
    return GGMLQuantizationType[text.strip().upper()]


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int | None = None  # tokens per sequence; None: the model's context length
    chunk_size: int = 8192  # prompt tokens per prefill call
    max_running: int = 16  # sequences decoded together in one batch
    # An idle engine's first arrival waits while more come in at most this far apart (at most
    # ARRIVAL_WINDOW_TURNS of them), so a burst packs into one prefill: 0 turns it off
    arrival_gap_ms: float = 2.0
    prefix_cache: bool = True  # keep full KV blocks of conversations for the next turn (--no-prefix-cache)
    cache_ram_gib: float = 8.0  # the prefix cache's host-RAM tier (--cache-ram), llama-server's default
    prefix_block_tokens: int = 64  # tokens a block of the KV pool holds: a cached continuation recomputes fewer
    kv_tokens: int | None = None  # KV cells in VRAM for all sequences together (--kv-tokens); None: one context

    def __post_init__(self) -> None:
        if self.ctx_size is not None and self.ctx_size < 1:
            raise ValueError(f"ctx size must be positive, got {self.ctx_size}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk size must be positive, got {self.chunk_size}")
        if self.max_running < 1:
            raise ValueError(f"max running must be positive, got {self.max_running}")
        if not 0 <= self.arrival_gap_ms <= 100:
            raise ValueError(f"arrival gap {self.arrival_gap_ms} ms: expected 0 to 100")
        if self.cache_ram_gib < 0:
            raise ValueError(f"--cache-ram {self.cache_ram_gib:g}: expected 0 or more GiB")
        if self.prefix_block_tokens < 1:
            raise ValueError(f"prefix block of {self.prefix_block_tokens} tokens: expected 1 or more")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"--kv-tokens {self.kv_tokens}: expected 1 or more")

    def n_ctx(self, model_context: int) -> int:
        return min(self.ctx_size, model_context) if self.ctx_size else model_context

    def kv_cells(self, model_context: int) -> int:
        """KV cells a stage plans in VRAM for all sequences together: `kv_tokens`, never fewer than one
        context (a sequence of the whole context must fit)."""
        return max(self.kv_tokens or 0, self.n_ctx(model_context))

    def for_model(self, model_context: int) -> EngineConfig:
        """The context cut to the model's, the chunk to the context: a longer chunk would never fill (the
        KV holds one context in all) but its activations would be planned for, VRAM taken from experts."""
        n_ctx = self.n_ctx(model_context)
        return replace(self, ctx_size=n_ctx, chunk_size=min(self.chunk_size, n_ctx))


@dataclass(frozen=True)
class LayerSplit:
    """`--layer-split`: the first layer of each later stage, increasing from 1 (`starts`), or auto
    (no starts: layers in proportion to the stages' budgets)."""

    starts: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if any(b <= a for a, b in zip((0, *self.starts), self.starts, strict=False)):
            raise ValueError(f"--layer-split '{self}': the first layer of each later stage, increasing from 1")

    @property
    def auto(self) -> bool:
        return not self.starts

    @classmethod
    def parse(cls, text: str) -> LayerSplit:
        """'auto' or 'K1[,K2..]'."""
        if text.strip().lower() == "auto":
            return cls()
        try:
            starts = tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            starts = ()
        if not starts:
            raise ValueError(f"--layer-split {text!r}: expected 'auto' or layer numbers like 24 or 16,32")
        return cls(starts)

    def __str__(self) -> str:
        return ",".join(map(str, self.starts)) if self.starts else "auto"


AUTO_SPLIT = LayerSplit()


@dataclass(frozen=True)
class HostShare:
    """`--cpu-experts`, resolved: off, a fixed share of the misses, or `auto` (from measured rates)."""

    mode: str  # "off", "fixed" or "auto"
    fraction: float = 0.0  # the fixed share, 0 < f <= 1

    @classmethod
    def parse(cls, text: str) -> HostShare:
        """'auto', 'off' or a share F with 0 < F <= 1 (ValueError naming the option otherwise)."""
        text = text.strip().lower()
        if text in ("auto", "off"):
            return cls(text)
        try:
            f = float(text)
        except ValueError:
            f = float("nan")
        if not 0 < f <= 1:
            raise ValueError(f"--cpu-experts {text!r}: auto, off, or the share of missing experts the host's cores "
                             f"compute, 0 < F <= 1")
        return cls("fixed", f)

    def __str__(self) -> str:
        return f"{self.fraction:g}" if self.mode == "fixed" else self.mode


@dataclass(frozen=True)
class StageSwitches:
    """How a stage runs, the same for every stage of a model: each switch declared once, here. A
    `Placement` is one, handed whole to every stage it builds; a stage a test or a tool builds alone
    gets its own."""

    dtype: str = "bf16"  # compute dtype on a GPU: bf16 or fp32 (a CPU stage computes in fp32)
    cuda_graphs: bool = True  # replay decode steps as captured graphs (one a batch-size bucket) where possible
    decode_graph_batch: int = 8  # the largest decode batch replayed as a graph (STRATA_DECODE_GRAPH_BATCH)
    resident_experts: int | None = None  # force K resident experts a layer (0: stream all); None: the VRAM plan
    kv_prefetch: bool = True  # spilled KV uploaded a layer ahead on a side stream (STRATA_KV_PREFETCH)
    cache_type_k: GGMLQuantizationType = GGMLQuantizationType.BF16  # how KV cells store keys (--cache-type-k)
    cache_type_v: GGMLQuantizationType = GGMLQuantizationType.BF16  # and values (--cache-type-v)
    # the share of a GPU stage's missing experts its host's cores compute in decode (--cpu-experts, whose
    # default is auto; a stage built alone hands none over unless asked); `fixed` also on a CPU stage's
    # device-path twins (tests)
    cpu_experts: HostShare = HostShare("off")
    host_prompt_help: bool = False  # few-row streamed prompts share experts with the host too (STRATA_HOST_PROMPT_HELP)
    # a bf16 GPU stage with the CUDA kernels keeps its projections and head as the file's blocks where
    # dense_q8 takes their type (`kernels.dense.DeviceDense`); False: bf16 copies (STRATA_DENSE_BLOCKS)
    dense_blocks: bool = True
    adapt_threads: bool = True  # a CPU stage computes on the count of --threads measured fastest (STRATA_ADAPT_THREADS)
    # where some experts stream, passes of this many rows or more stream whole layers; None: the break-even
    # from measured rates (STRATA_GATHER_ROWS, stage.experts.break_even)
    gather_rows: int | None = None
    residency_half_life: int = 512  # decode steps over which a pick count halves (STRATA_RESIDENCY_HALF_LIFE)
    residency_swaps: int = 4  # experts a decode step moves into VRAM at most (STRATA_RESIDENCY_SWAPS)
    delta_scan: str = "fla"  # a hybrid's DeltaNet prompt rows on a GPU: fla's kernels where installed, or torch

    def __post_init__(self) -> None:
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype {self.dtype!r}: bf16 or fp32")
        if self.resident_experts is not None and self.resident_experts < 0:
            raise ValueError(f"--resident-experts {self.resident_experts}: 0 or more")
        if not 1 <= self.decode_graph_batch <= 64:
            raise ValueError(f"decode graph batch {self.decode_graph_batch}: 1 to 64")
        if self.gather_rows is not None and self.gather_rows < 1:
            raise ValueError(f"gather rows {self.gather_rows}: 1 or more (None: from measured rates)")
        if self.residency_half_life < 1 or self.residency_swaps < 0:
            raise ValueError(f"residency half-life {self.residency_half_life} (1 or more), swaps "
                             f"{self.residency_swaps} (0 or more)")
        if self.delta_scan not in ("fla", "torch"):
            raise ValueError(f"delta scan {self.delta_scan!r}: fla or torch")
        for option, t in (("--cache-type-k", self.cache_type_k), ("--cache-type-v", self.cache_type_v)):
            if t not in KV_CACHE_TYPES:
                raise ValueError(f"{option} {t.name.lower()}: one of {', '.join(KV_CACHE_TYPE_NAMES)}")

    @classmethod
    def env_fields(cls, environment: EnvOptions) -> dict[str, Any]:
        return {"decode_graph_batch": environment.decode_graph_batch, "kv_prefetch": environment.kv_prefetch,
                "host_prompt_help": environment.host_prompt_help, "dense_blocks": environment.dense_blocks,
                "adapt_threads": environment.adapt_threads, "gather_rows": environment.gather_rows,
                "residency_half_life": environment.residency_half_life,
                "residency_swaps": environment.residency_swaps, "delta_scan": environment.delta_scan}

    @classmethod
    def from_env(cls, environment: EnvOptions, **fields: Any) -> Self:
        """Switches from the environment, `fields` (the flags) winning."""
        return cls(**{**cls.env_fields(environment), **fields})

    @property
    def kv_types(self) -> tuple[GGMLQuantizationType, GGMLQuantizationType]:
        return self.cache_type_k, self.cache_type_v


@dataclass(frozen=True)
class Placement(StageSwitches):
    """Where the model runs: devices (one stage each), how layers split, VRAM budgets and host cores, a
    split's helper; with the switches every stage runs by."""

    devices: tuple[str, ...] = ("auto",)  # 'auto', 'cpu', 'cuda:N' or 'N', one per stage
    layer_split: LayerSplit = AUTO_SPLIT
    max_vram_gib: tuple[float | None, ...] = (None,)  # one for all stages, or one per stage
    threads: int | None = None  # host cores computing a CPU stage's experts (--threads); None: engine.build's default
    prefill_help: bool = True  # the PeerPrefill helper of a split
    prefill_help_frac: float | str = "auto"  # 'auto', 'rule' or a fixed share 0 < f < 1
    help_halves: int = 0  # a helped prompt of this many tokens or more runs in two halves of rows; 0: never
    stage_threads: bool = True  # a host thread per GPU stage of a split
    cpu_experts: HostShare = HostShare("auto")  # as --cpu-experts: a placement is what a user runs

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.devices:
            raise ValueError("no devices given")
        if len(self.max_vram_gib) not in (1, len(self.devices)):
            raise ValueError(f"--max-vram gives {len(self.max_vram_gib)} values for {len(self.devices)} devices")
        if not self.layer_split.auto:
            if len(self.devices) == 1:
                raise ValueError(f"--layer-split '{self.layer_split}' needs several devices (--devices 0,1); with "
                                 f"one device leave it at auto")
            if len(self.layer_split.starts) != len(self.devices) - 1:
                raise ValueError(f"--layer-split '{self.layer_split}' makes {len(self.layer_split.starts) + 1} "
                                 f"stages, but {len(self.devices)} devices were given")
        parse_help_frac(self.prefill_help_frac, "--prefill-help-frac")  # EnvError is a ValueError
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"--threads {self.threads}: 1 or more")

    @classmethod
    def env_fields(cls, environment: EnvOptions) -> dict[str, Any]:
        return {**super().env_fields(environment), "prefill_help": environment.prefill_help,
                "prefill_help_frac": environment.prefill_help_frac, "help_halves": environment.help_halves,
                "stage_threads": environment.stage_threads}

    @classmethod
    def from_env(cls, environment: EnvOptions, *, prefill_help: bool | None = None,
                 prefill_help_frac: str | None = None, **fields: Any) -> Self:
        """Switches from the environment, the helper's flags winning where given; `fields` are the other
        options. Raises ValueError (EnvError for a bad `--prefill-help-frac`)."""
        if prefill_help is not None:
            fields["prefill_help"] = prefill_help
        if prefill_help_frac is not None:
            fields["prefill_help_frac"] = parse_help_frac(prefill_help_frac, "--prefill-help-frac")
        return super().from_env(environment, **fields)

    def budget(self, stage: int) -> float | None:
        return self.max_vram_gib[0] if len(self.max_vram_gib) == 1 else self.max_vram_gib[stage]


@dataclass(frozen=True)
class ServerConfig:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    alias: str | None = None  # the model name clients use; default: the file's stem
    engine: EngineConfig = field(default_factory=EngineConfig)
    placement: Placement = field(default_factory=Placement)
    log_level: str = "INFO"
    reasoning_format: str = "deepseek"  # deepseek: <think> blocks -> reasoning_content; none: left in the content
    tool_call_parser: str = "auto"  # the tool dialect (hermes, qwen3_coder); auto: from the chat template
    lenient_json_schema: bool = False  # an unstated additionalProperties admits any key (default: none)

    @property
    def model_name(self) -> str:
        """The alias, else the file's stem, a split model's shard suffix dropped
        (NAME-00001-of-00004.gguf serves as NAME)."""
        split = re.fullmatch(r"(.+)-\d{5}-of-\d{5}", self.model_path.stem)
        return self.alias or (split[1] if split else self.model_path.stem)
