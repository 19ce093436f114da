"""What `strata info` reports about a GGUF model: shapes, parameters, bytes, expert traffic."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import EXPERT_TENSORS, ModelSpec, spec_from_gguf, tname


@dataclass(frozen=True)
class ModelInfo:
    spec: ModelSpec
    file_bytes: int
    n_shards: int
    bytes_by_type: dict[str, int]  # ggml type name -> tensor bytes
    params_by_type: dict[str, int]
    expert_bytes_per_layer: list[int]  # gate + up + down of all experts, per layer

    @property
    def expert_bytes(self) -> int:
        return sum(self.expert_bytes_per_layer)

    @property
    def tensor_bytes(self) -> int:
        return sum(self.bytes_by_type.values())

    @property
    def n_params(self) -> int:
        return sum(self.params_by_type.values())

    def expert_pass_seconds(self, link_gbps: float) -> float:
        """Time to move every expert byte once over a link of `link_gbps` GB/s (1e9 bytes/s)."""
        return self.expert_bytes / (link_gbps * 1e9)


def model_info(f: GGUFFile) -> ModelInfo:
    spec = spec_from_gguf(f)
    by_type: dict[str, int] = defaultdict(int)
    params: dict[str, int] = defaultdict(int)
    for t in f.tensors.values():
        by_type[t.ggml_type.name] += t.nbytes
        params[t.ggml_type.name] += t.n_elements
    per_layer = [sum(f.tensor(tname(k, i)).nbytes for k in EXPERT_TENSORS) for i in range(spec.n_layers)]
    return ModelInfo(spec=spec, file_bytes=f.file_bytes, n_shards=len(f.shard_paths), bytes_by_type=dict(by_type),
                     params_by_type=dict(params), expert_bytes_per_layer=per_layer)
