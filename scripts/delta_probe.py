"""One DeltaNet layer's prompt scan on a GPU, the plain chunked scan against fla-core's kernels:
Qwen3.5-35B-A3B's heads (32 value heads, key and value dims 128), fp32 inputs and state, a state
carried in. Prints ms a call and what 30 such layers (35B-A3B's linear ones) take for the prompt.

    python3 scripts/delta_probe.py --tokens 1024,4096
"""

from __future__ import annotations

import argparse

import torch
from attn_probe import timed  # this folder's: run as `python3 scripts/delta_probe.py`

from strata_mgpu.kernels.delta_rule import fla_delta_scan
from strata_mgpu.model.delta_net import delta_rule_chunked, l2norm

LINEAR_LAYERS = 30


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,4096")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    fla = fla_delta_scan(dev)
    print(f"{torch.cuda.get_device_name(dev)}; fla-core: {'yes' if fla else 'not usable'}")
    for t in (int(x) for x in a.tokens.split(",")):
        g = torch.Generator(device=dev).manual_seed(t)
        q = l2norm(torch.randn(t, a.heads, a.dim, device=dev, generator=g)) * a.dim ** -0.5
        k = l2norm(torch.randn(t, a.heads, a.dim, device=dev, generator=g))
        v = torch.randn(t, a.heads, a.dim, device=dev, generator=g)
        decay = -torch.nn.functional.softplus(torch.randn(t, a.heads, device=dev, generator=g)) * 0.5
        beta = torch.sigmoid(torch.randn(t, a.heads, device=dev, generator=g))
        state = torch.randn(a.heads, a.dim, a.dim, device=dev, generator=g) * 0.1
        inputs = (q, k, v, decay, beta, state)
        plain = timed(delta_rule_chunked, *inputs, runs=a.runs, warmups=2)
        line = f"{t:>6} tokens: plain scan {plain:8.2f} ms ({plain * LINEAR_LAYERS / 1e3:.3f} s for 30 layers)"
        if fla is not None:
            fast = timed(fla, *inputs, runs=a.runs, warmups=2)
            line += f", fla {fast:7.2f} ms ({fast * LINEAR_LAYERS / 1e3:.3f} s), {plain / fast:.1f}x"
        print(line)


if __name__ == "__main__":
    main()
