"""A prompt's gated delta rule (the DeltaNet layers' chunked scan) on a GPU by fla-core's Triton
kernels (flash-linear-attention's `chunk_gated_delta_rule`: the WY form of a chunk's updates, the
chunks' states in one pass), where fla-core and Triton are installed. The plain twin, and the path
everywhere else, is `model.delta_net.delta_rule_chunked`; tests/test_gpu_hybrid.py compares them.

Both take the rule's inputs as `model.delta_net.delta_heads` makes them: q, k [T, H, Dk] (L2-normed,
q already scaled), v [T, H, Dv], g (log decay) and beta [T, H], all fp32, and the state [H, Dk, Dv]
fp32; both return (out [T, H, Dv] fp32, the state after the T tokens).
"""

from __future__ import annotations

import torch

from strata_mgpu.kernels.paths import PathCounter, warn_once
from strata_mgpu.model.delta_net import DeltaScan


def fla_delta_scan(device: torch.device, paths: PathCounter | None = None) -> DeltaScan | None:
    """fla-core's chunked scan for tensors on `device` (counted as "delta_scan:fla" in `paths`), or None
    where it cannot serve: not a CUDA device, or fla-core / Triton not importable (said once)."""
    if device.type != "cuda":
        return None
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # ImportError, or Triton failing to find its compiler at import
        warn_once("the DeltaNet layers' prompt scan runs in plain torch ops",
                  f"fla-core is not usable ({type(e).__name__}: {e}); pip install fla-core for its Triton kernels")
        return None

    def scan(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # one sequence as fla's batch of one: [1, T, H, D], contiguous (v is a view of the conv's output);
        # q is scaled already (scale 1)
        out, final = chunk_gated_delta_rule(*(x.contiguous()[None] for x in (q, k, v, g, beta)), scale=1.0,
                                            initial_state=state.contiguous()[None], output_final_state=True)
        if paths is not None:
            paths.ran("delta_scan", "fla")
        return out[0].float(), final[0].float()

    return scan
