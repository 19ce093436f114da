"""What `strata info` reports about a GGUF model: shapes, parameters, bytes, expert traffic, and
the quant mix (each class of tensors: its types, how many tensors and bytes of each)."""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from gguf.constants import MODEL_TENSOR, TENSOR_NAMES

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import EXPERT_TENSORS, ModelSpec, T, spec_from_gguf, tname

# The classes the quant mix is counted in, in the order shown, and the tensors of each.
TENSOR_CLASSES: dict[str, tuple[MODEL_TENSOR, ...]] = {
    "embeddings": (T.TOKEN_EMBD,),
    "attention": (T.ATTN_Q, T.ATTN_K, T.ATTN_V, T.ATTN_OUT),
    "linear attention": (T.ATTN_QKV, T.ATTN_GATE, T.SSM_CONV1D, T.SSM_DT, T.SSM_A, T.SSM_BETA, T.SSM_ALPHA,
                         T.SSM_BETA_ALPHA, T.SSM_OUT),
    "router": (T.FFN_GATE_INP,),
    "experts gate": (T.FFN_GATE_EXP,),
    "experts up": (T.FFN_UP_EXP,),
    "experts down": (T.FFN_DOWN_EXP,),
    "dense FFN / shared": (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN, T.FFN_GATE_SHEXP, T.FFN_UP_SHEXP, T.FFN_DOWN_SHEXP,
                           T.FFN_GATE_INP_SHEXP),
    "norms": (T.ATTN_NORM, T.FFN_NORM, T.ATTN_POST_NORM, T.ATTN_Q_NORM, T.ATTN_K_NORM, T.SSM_NORM, T.OUTPUT_NORM),
    "output": (T.OUTPUT,),
    "multi-token prediction": (T.NEXTN_EH_PROJ, T.NEXTN_ENORM, T.NEXTN_HNORM, T.NEXTN_SHARED_HEAD_NORM,
                               T.NEXTN_EMBED_TOKENS, T.NEXTN_SHARED_HEAD_HEAD),
}
OTHER = "other"
_CLASS_OF = {TENSOR_NAMES[k]: cls for cls, kinds in TENSOR_CLASSES.items() for k in kinds}


def tensor_class(name: str) -> str:
    """'blk.3.ffn_down_exps.weight' -> 'experts down'; a name of no class -> 'other'."""
    base = re.sub(r"^blk\.\d+\.", "blk.{bid}.", name.removesuffix(".weight").removesuffix(".bias"))
    return _CLASS_OF.get(base, OTHER)


@dataclass(frozen=True)
class TypeCount:
    tensors: int
    nbytes: int


@dataclass(frozen=True)
class ModelInfo:
    spec: ModelSpec
    file_bytes: int
    n_shards: int
    bytes_by_type: dict[str, int]  # ggml type name -> tensor bytes
    params_by_type: dict[str, int]
    expert_bytes_per_layer: list[int]  # gate + up + down of all experts, per layer
    quant_mix: dict[str, dict[str, TypeCount]]  # tensor class -> ggml type name -> its tensors, in TENSOR_CLASSES order

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
    mix: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # [tensors, bytes]
    for t in f.tensors.values():
        by_type[t.ggml_type.name] += t.nbytes
        params[t.ggml_type.name] += t.n_elements
        count = mix[tensor_class(t.name)][t.ggml_type.name]
        count[0] += 1
        count[1] += t.nbytes
    per_layer = [sum(f.tensor(tname(k, i)).nbytes for k in EXPERT_TENSORS if tname(k, i) in f.tensors)
                 for i in range(spec.n_layers)]  # a dense layer (glm4moe's first): none
    quant_mix = {cls: {ty: TypeCount(n, b) for ty, (n, b) in sorted(mix[cls].items(), key=lambda kv: -kv[1][1])}
                 for cls in (*TENSOR_CLASSES, OTHER) if cls in mix}
    return ModelInfo(spec=spec, file_bytes=f.file_bytes, n_shards=len(f.shard_paths), bytes_by_type=dict(by_type),
                     params_by_type=dict(params), expert_bytes_per_layer=per_layer, quant_mix=quant_mix)
