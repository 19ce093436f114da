"""A sequence's gated DeltaNet state, beside its KV: per linear layer, the conv's last inputs and
the delta rule's recurrent state. The KV cache (`SequenceKV`) holds the full-attention layers only;
this holds the rest, at the same token boundary (`length`). `snapshot` / `restore` copy it out at
a boundary and back into a fresh sequence (what a prefix cache of a hybrid model keeps beside its
KV blocks); `HybridSequence` is the two together, as a runner over a hybrid decoder holds them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from strata_mgpu.model.kv_cache import SequenceKV
from strata_mgpu.model.spec import DeltaNetShape


@dataclass
class LayerState:
    conv: torch.Tensor  # [C, K - 1]: the conv's inputs before the next token, oldest first
    recurrent: torch.Tensor  # [Hv, Dk, Dv] fp32


@dataclass(frozen=True)
class LinearSnapshot:
    """Copies of every linear layer's state after `length` tokens."""

    length: int
    layers: dict[int, LayerState]

    @property
    def nbytes(self) -> int:
        return sum(s.conv.nbytes + s.recurrent.nbytes for s in self.layers.values())


class LinearState:
    """The DeltaNet state of one sequence for a decoder's linear layers (`layers`: their local
    indexes), zeros before its first token. A forward updates each layer's state in place
    (`layer(i)`) and then advances `length` by its rows; one that fails midway leaves some layers
    past `length`, so its sequence is dropped (as the engine drops a failed call's requests) or
    restored from a snapshot."""

    def __init__(self, shape: DeltaNetShape, layers: Sequence[int], device: torch.device | str,
                 dtype: torch.dtype = torch.float32):
        s = shape
        self.length = 0
        self._layers = {i: LayerState(conv=torch.zeros(s.conv_dim, s.conv_kernel - 1, device=device, dtype=dtype),
                                      recurrent=torch.zeros(s.n_v_heads, s.k_head_dim, s.v_head_dim, device=device,
                                                            dtype=torch.float32))
                        for i in layers}

    def layer(self, i: int) -> LayerState:
        return self._layers[i]

    @property
    def nbytes(self) -> int:
        return sum(s.conv.nbytes + s.recurrent.nbytes for s in self._layers.values())

    def advance(self, n: int) -> None:
        self.length += n

    def snapshot(self) -> LinearSnapshot:
        """Copies of the state as it is now, after `length` tokens."""
        return LinearSnapshot(self.length, {i: LayerState(s.conv.clone(), s.recurrent.clone())
                                            for i, s in self._layers.items()})

    def restore(self, snap: LinearSnapshot) -> None:
        """This state made the snapshot's (the sequence's KV must hold the same `snap.length` tokens)."""
        assert snap.layers.keys() == self._layers.keys(), "a snapshot of another decoder's layers"
        for i, s in self._layers.items():
            s.conv.copy_(snap.layers[i].conv)
            s.recurrent.copy_(snap.layers[i].recurrent)
        self.length = snap.length


@dataclass
class HybridSequence:
    """A hybrid model's sequence in a runner: its KV (the full-attention layers) and its DeltaNet state."""

    kv: SequenceKV
    linear: LinearState

    @property
    def length(self) -> int:
        return self.kv.length

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes + self.linear.nbytes
