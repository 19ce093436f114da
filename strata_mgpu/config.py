"""Runtime configuration: frozen dataclasses built once by the CLI (the model's own shapes live in
`model.spec.ModelSpec`, read from the GGUF)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from strata_mgpu.runtime.stage import StageOptions


@dataclass(frozen=True)
class EngineConfig:
    ctx_size: int | None = None  # tokens per sequence; None: the model's context length
    chunk_size: int = 8192  # prompt tokens per prefill call
    max_running: int = 16  # sequences decoded together in one batch

    def __post_init__(self) -> None:
        if self.ctx_size is not None and self.ctx_size < 1:
            raise ValueError(f"ctx size must be positive, got {self.ctx_size}")
        if self.chunk_size < 1:
            raise ValueError(f"chunk size must be positive, got {self.chunk_size}")
        if self.max_running < 1:
            raise ValueError(f"max running must be positive, got {self.max_running}")

    def n_ctx(self, model_context: int) -> int:
        return min(self.ctx_size, model_context) if self.ctx_size else model_context


@dataclass(frozen=True)
class ServerConfig:
    model_path: Path
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    alias: str | None = None  # the model name clients use; default: the file's stem
    engine: EngineConfig = field(default_factory=EngineConfig)
    stage: StageOptions | None = None  # None or a CPU device: the fp32 reference forward on the CPU

    @property
    def model_name(self) -> str:
        return self.alias or self.model_path.stem
