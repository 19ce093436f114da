"""How far decode's fused expert kernels land from their twin over many random passes, per type pair.

    python3 scripts/tol_probe.py [passes]

`tests/test_gpu_quant.py` holds one random pass a run to FUSED_TOL; this prints the distribution
of that error (median, 99th percentile, max) over many, so the tolerance is set from data. A
diagnosis tool; needs a CUDA device.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from strata_mgpu.kernels.experts import TorchKernels, select_kernels
from tests.test_gpu_quant import FUSED_PAIRS, expert_case, random_pass, rel_err


class _Factory:  # what expert_case needs of pytest's tmp_path_factory
    def mktemp(self, name):
        import tempfile
        from pathlib import Path
        return Path(tempfile.mkdtemp(prefix=name))


def main() -> None:
    passes = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    kernels = select_kernels(torch.device("cuda", 0))
    twin = TorchKernels()
    for types in FUSED_PAIRS:
        spec, cache, lay = expert_case(_Factory(), types, seed=1)
        for rows in (1, 3):
            errs = []
            for seed in range(passes):
                h, weights, experts, w_gu, w_d = random_pass(spec, rows, spec.n_experts, seed)
                got = kernels.moe_gathered(cache, 1, lay, h, weights, experts, w_gu, w_d)
                want = twin.moe_fused_reference(cache, 1, lay, h, weights, experts, w_gu, w_d)
                errs.append(rel_err(got, want))
            e = np.array(errs)
            print(f"{types[0].name:>5}-{types[1].name:<5} rows {rows}: median {np.median(e):.2e} "
                  f"p99 {np.percentile(e, 99):.2e} max {e.max():.2e}", flush=True)


if __name__ == "__main__":
    main()
