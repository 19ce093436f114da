"""How one layer's routed experts sit in their GGUF bytes: the types and sizes of an expert's gate,
up and down matrices, as the host arena packs them ([gate | up | down] an expert) and every expert
kernel reads them."""

from __future__ import annotations

from dataclasses import dataclass

from gguf.constants import GGMLQuantizationType

from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import ModelSpec, T, tname
from strata_mgpu.quant.formats import block_format


@dataclass(frozen=True)
class ExpertLayout:
    """Where one layer's expert matrices sit inside an expert's bytes."""

    gate_type: GGMLQuantizationType  # gate and up share it
    down_type: GGMLQuantizationType
    gate_bytes: int  # one expert's gate (= its up)
    down_bytes: int
    gate_weights: int  # F * D
    down_weights: int  # D * F

    @property
    def expert_bytes(self) -> int:
        return 2 * self.gate_bytes + self.down_bytes

    @property
    def down_offset(self) -> int:
        return 2 * self.gate_bytes


def layer_layout(f: GGUFFile, spec: ModelSpec, layer: int) -> ExpertLayout:
    gate, up, down = (f.tensor(tname(k, layer)) for k in (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP))
    if gate.ggml_type != up.ggml_type:
        raise ValueError(f"layer {layer}: gate is {gate.ggml_type.name} but up is {up.ggml_type.name}; "
                         f"streamed experts need them alike")
    for t in (gate, down):
        block_format(t.ggml_type)
    return ExpertLayout(gate_type=gate.ggml_type, down_type=down.ggml_type,
                        gate_bytes=gate.nbytes // spec.n_experts, down_bytes=down.nbytes // spec.n_experts,
                        gate_weights=spec.expert_ffn * spec.hidden, down_weights=spec.hidden * spec.expert_ffn)
