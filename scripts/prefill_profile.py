"""Where a short prompt's and a pack of short prompts' time goes, and the engine's first tokens.

    python3 scripts/prefill_profile.py OUT_DIR

Writes a model of 30B-A3B's layer shapes with 16 experts a layer (the host's work a layer is the
same as with 128, and it writes in seconds), builds one stage with every expert resident, and
times: one 20-token prompt, one 140-token prompt, a pack of 7 x 20 tokens (`prefill_many`), each
synchronized; cProfile of the pack (host functions by own time); the engine's first-token path
for 8 prompts piece by piece (new sequences, the pack, sampling and landing the tokens); then 8
requests of 20 prompt tokens through the engine (`tools.server_decode`), their times to first
token. A diagnosis tool.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from strata_mgpu import env
from strata_mgpu.model import synthetic
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.stage.build import build_stage
from strata_mgpu.stage.stage import StageOptions
from strata_mgpu.tools.server_decode import measure_server_decode


def main() -> None:
    environment = env.read_or_exit()  # every STRATA_* variable, checked at start-up
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    path = Path("/tmp/q30b_e16.gguf")
    if not path.exists():
        synthetic.PRESETS["30b-e16"] = replace(synthetic.PRESETS["30b-a3b"], n_experts=16)
        synthetic.write_model(path, "30b-e16", seed=0)
    f = GGUFFile(path)
    spec = spec_from_gguf(f)
    opts = StageOptions.from_env(environment, device=torch.device("cuda", 0), max_vram_gib=40, kv_tokens=8192)
    stage = build_stage(f, spec, opts)
    g = torch.Generator().manual_seed(0)
    toks = torch.randint(0, spec.vocab_size, (400,), generator=g)

    def timed(name: str, fn, n: int = 6) -> None:
        times = []
        for _ in range(n):
            stage.ctx.synchronize_device()
            t = time.perf_counter()
            fn()
            stage.ctx.synchronize_device()
            times.append(1e3 * (time.perf_counter() - t))
        times.sort()
        print(f"{name}: median {times[len(times) // 2]:.1f} ms (min {times[0]:.1f})", flush=True)

    timed("one 20-token prompt", lambda: stage.prefill(stage.new_sequence(64), toks[:20]))
    timed("one 140-token prompt", lambda: stage.prefill(stage.new_sequence(200), toks[:140]))
    chunks = [toks[20 * i:20 * (i + 1)] for i in range(7)]
    timed("a pack of 7 x 20 tokens", lambda: stage.prefill_many([stage.new_sequence(64) for _ in chunks], chunks))
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(3):
        stage.prefill_many([stage.new_sequence(64) for _ in chunks], chunks)
    stage.ctx.synchronize_device()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
    (out / "pack_profile.txt").write_text(text.getvalue())
    print("\n".join(text.getvalue().splitlines()[:45]), flush=True)
    # the engine's first-token path for a burst of 8, piece by piece (its prompt_ms is their sum)
    from strata_mgpu.engine.device_sampler import BatchSampler
    from strata_mgpu.engine.sampler import SamplingParams
    from strata_mgpu.engine.step_tokens import StepTokens

    sampler = BatchSampler()
    chunks8 = [toks[20 * i:20 * (i + 1)] for i in range(8)]
    held: dict[str, object] = {}
    timed("8 new sequences", lambda: held.__setitem__("kvs", [stage.new_sequence(150) for _ in range(8)]))
    timed("a pack of 8 x 20 tokens", lambda: held.__setitem__(
        "logits", stage.prefill_many([stage.new_sequence(150) for _ in range(8)], chunks8)))
    states = [sampler.open(SamplingParams(max_tokens=8, temperature=0.8, seed=i)) for i in range(8)]
    timed("sampling 8 rows and landing their tokens", lambda: StepTokens.send(
        list(range(8)), sampler.sample(held["logits"], states), 0, 0.0).wait())
    report = measure_server_decode(stage, tokenizer_from_gguf(f), 8, 8, prompt_tokens=20)
    print(report.summary())
    for r in report.requests:
        print(f"  {r.request_id}: first token {1e3 * r.ttft_s:.1f} ms (queued {r.queue_ms:.1f}, prompt "
              f"{r.prompt_ms:.1f})")


if __name__ == "__main__":
    main()
