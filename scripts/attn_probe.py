"""A chunk's attention over a cached prefix on the GPU, timed three ways (run on the GPU machine):

    python3 scripts/attn_probe.py [--chunk 2048] [--cached 20000] [--heads 32] [--kv-heads 4] [--head-dim 128]

1. today's path (`model.ops.causal_attention`: KV heads repeated, a lower-right causal bias, so the
   memory-efficient kernel);
2. the same in two flash calls: the chunk over the prefix (no mask) and over itself (causal), merged
   by their log-sum-exps (aten's `_scaled_dot_product_flash_attention` returns them);
3. the same shapes with no mask at all: a ceiling, not a result.
Each checked against (1) (bf16, max abs error) and timed by CUDA events, median of 10 after 3 warm-ups,
for one layer; what a turn's prefill of `chunk` tokens spends is that times the model's layers.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from strata_mgpu.model.ops import causal_attention


def flash_two_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """q [T, H, Dh] the last T positions of k, v [S, Hkv, Dh] -> [T, H, Dh]."""
    t, h, _ = q.shape
    group = h // k.shape[1]
    qh = q.transpose(0, 1)[None]
    kh = k.transpose(0, 1)[None].repeat_interleave(group, dim=1)
    vh = v.transpose(0, 1)[None].repeat_interleave(group, dim=1)
    s = k.shape[0]
    flash = torch.ops.aten._scaled_dot_product_flash_attention
    o1, lse1 = flash(qh, kh[:, :, :s - t], vh[:, :, :s - t], 0.0, False)[:2]  # [1, H, T, Dh], [1, H, T]
    o2, lse2 = flash(qh, kh[:, :, s - t:], vh[:, :, s - t:], 0.0, True)[:2]
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    out = (o1.float() * w1[..., None] + o2.float() * w2[..., None]) / (w1 + w2)[..., None]
    return out.to(q.dtype)[0].transpose(0, 1)


def no_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                          enable_gqa=True)[0].transpose(0, 1)


def timed(fn, *args, runs: int = 10, warmups: int = 3) -> float:
    """Median ms of `runs` calls fn(*args) after `warmups`, by CUDA events."""
    for _ in range(warmups):
        fn(*args)
    times = []
    for _ in range(runs):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(*args)
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--cached", type=int, default=20000)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    t, s = args.chunk, args.cached + args.chunk
    q = torch.randn(t, args.heads, args.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(s, args.kv_heads, args.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    v = torch.randn(s, args.kv_heads, args.head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
    want = causal_attention(q, k, v)
    print(f"chunk {t} over {args.cached} cached keys, {args.heads} heads over {args.kv_heads}, head dim "
          f"{args.head_dim}: one layer")
    for name, fn in (("today (repeated heads, lower-right bias)", causal_attention), ("two flash calls + merge",
                                                                                     flash_two_part),
                     ("no mask (a ceiling)", no_mask)):
        try:
            err = (fn(q, k, v).float() - want.float()).abs().max().item()
            print(f"  {name}: {timed(fn, q, k, v):.3f} ms, max abs error against today's {err:.2e}")
        except RuntimeError as e:
            print(f"  {name}: failed ({str(e).splitlines()[0]})")


if __name__ == "__main__":
    main()
