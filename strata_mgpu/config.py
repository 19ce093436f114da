"""Runtime configuration: frozen dataclasses built once by the CLI (the model's own shapes live in
`model.spec.ModelSpec`, read from the GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int | None = None  # tokens per sequence; None: the model's context length
    chunk_size: int = 8192  # prompt tokens per prefill call
    max_running: int = 16  # sequences decoded together in one batch
    # An idle engine's first arrival waits while more come in at most this far apart (at most
    # ARRIVAL_WINDOW_TURNS of them), so a burst packs into one prefill: 0 turns it off
    arrival_gap_ms: float = 2.0

    def __post_init__(self) -> None:
        if self.ctx_size is not None and self.ctx_size < 1:
            raise ValueError(f"ctx size must be positive, got {self.ctx_size}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk size must be positive, got {self.chunk_size}")
        if self.max_running < 1:
            raise ValueError(f"max running must be positive, got {self.max_running}")
        if not 0 <= self.arrival_gap_ms <= 100:
            raise ValueError(f"arrival gap {self.arrival_gap_ms} ms: expected 0 to 100")

    def n_ctx(self, model_context: int) -> int:
        return min(self.ctx_size, model_context) if self.ctx_size else model_context


@dataclass(frozen=True)
class Placement:
    """Where the model runs: devices (one stage each), how layers split, VRAM budgets."""

    devices: tuple[str, ...] = ("auto",)  # 'auto', 'cpu', 'cuda:N' or 'N', one per stage
    layer_split: str = "auto"  # 'auto' or K1[,K2..]: the first layer of each later stage
    max_vram_gib: tuple[float | None, ...] = (None,)  # one for all stages, or one per stage
    dtype: str = "bf16"  # compute dtype on the GPU: bf16 or fp32
    cuda_graphs: bool = True
    prefill_help: bool | None = None  # the PeerPrefill helper; None: STRATA_PREFILL_HELP
    prefill_help_frac: float | str | None = None  # 'auto', 'rule' or a share; None: STRATA_PREFILL_HELP_FRAC, else auto
    resident_experts: int | None = None  # force K resident experts a layer (0: stream all); None: the VRAM plan

    def __post_init__(self) -> None:
        if not self.devices:
            raise ValueError("no devices given")
        if len(self.max_vram_gib) not in (1, len(self.devices)):
            raise ValueError(f"--max-vram gives {len(self.max_vram_gib)} values for {len(self.devices)} devices")
        if self.dtype not in ("bf16", "fp32"):
            raise ValueError(f"dtype {self.dtype!r}: bf16 or fp32")
        self._check_layer_split()
        if self.resident_experts is not None and self.resident_experts < 0:
            raise ValueError(f"--resident-experts {self.resident_experts}: 0 or more")
        if self.prefill_help_frac is not None:
            from strata_mgpu.env import parse_help_frac

            parse_help_frac(self.prefill_help_frac, "--prefill-help-frac")  # EnvError is a ValueError

    def _check_layer_split(self) -> None:
        """What can be told without the model: the form, and that an explicit split has stages to
        split across (with one device nothing reads it). Whether the layers exist is checked against
        the model in `runtime.split.plan_layers`."""
        text = self.layer_split.strip().lower()
        if text == "auto":
            return
        bad_form = ValueError(f"--layer-split {self.layer_split!r}: expected 'auto' or layer numbers like 24 or 16,32")
        try:
            starts = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise bad_form from None
        if not starts:
            raise bad_form
        if any(b <= a for a, b in zip([0, *starts], starts, strict=False)):
            raise ValueError(f"--layer-split {self.layer_split!r}: the first layer of each later stage, increasing "
                             f"from 1")
        if len(self.devices) == 1:
            raise ValueError(f"--layer-split {self.layer_split!r} needs several devices (--devices 0,1); with one "
                             f"device leave it at auto")

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

    @property
    def model_name(self) -> str:
        return self.alias or self.model_path.stem
