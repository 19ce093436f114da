"""What structured output costs decode: tok/s of N requests decoding together through the real
`Engine`, free against each under a JSON-schema grammar (an array of small objects that cannot
end before max_tokens, so both runs make the same tokens), on the runner `strata serve` builds.

A constrained row's mask is the host's work; on a GPU the forward just queued hides it, on the CPU
it does not. Runs alternate free / constrained `--rounds` times and the medians are reported.

    python -m strata_mgpu.tools.grammar_cost [MODEL.gguf | --preset tiny|small] [--batch 1,8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

from strata_mgpu import env
from strata_mgpu.config import EngineConfig, Placement
from strata_mgpu.engine.build import build_runner
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.grammar import Grammar, GrammarCompiler, allowed_tokens, fill_bitmasks, mask_words
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.gguf_reader import GGUFFile
from strata_mgpu.model.spec import spec_from_gguf
from strata_mgpu.model.tokenizer import tokenizer_from_gguf
from strata_mgpu.tools.server_decode import bench_prompts

ITEM = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                         "name": {"type": "string", "maxLength": 12},
                                         "ok": {"type": "boolean"}},
        "required": ["id", "name", "ok"], "additionalProperties": False}
STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def endless_schema(min_items: int) -> dict:
    return {"type": "array", "items": ITEM, "minItems": min_items, "x-guidance": STYLE}


def decode_rate(engine: Engine, prompts: list[list[int]], max_tokens: int, grammar: Grammar | None,
                seed: int, constrained_rows: int | None = None) -> float:
    """Tokens per second landed in the window in which every request is past its first token; the first
    `constrained_rows` requests (None: all) under `grammar`."""
    done = threading.Event()
    arrivals: dict[str, list[tuple[float, int]]] = {f"r{i}": [] for i in range(len(prompts))}
    ended: dict[str, str | None] = {}
    lock = threading.Lock()

    def on_output(out: RequestOutput) -> None:  # the engine's thread: note, never raise
        with lock:
            arrivals[out.request_id].append((time.perf_counter(), len(out.token_ids)))
            if out.finished:
                ended[out.request_id] = out.finish_reason
                if len(ended) == len(prompts):
                    done.set()

    with lock:
        for i, prompt in enumerate(prompts):
            constrained = constrained_rows is None or i < constrained_rows
            params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=seed + i, ignore_eos=True,
                                    grammar=grammar if constrained else None)
            engine.submit(prompt, params, on_output, request_id=f"r{i}")
    if not done.wait(600):
        raise RuntimeError("the run did not finish in 600 s")
    early = {rid: reason for rid, reason in ended.items() if reason != "length"}
    if early:
        raise RuntimeError(f"requests ended before max_tokens, not a fair measure: {early}")
    start = max(a[0][0] for a in arrivals.values())
    end = max(a[-1][0] for a in arrivals.values())
    landed = sum(n for a in arrivals.values() for t, n in a if t > start)
    return landed / (end - start) if end > start else float("nan")


def host_cost_us(grammar: Grammar, vocab_size: int, rows: int, steps: int, seed: int = 0) -> float:
    """Microseconds of host work a step costs `rows` constrained rows: the work a GPU's forward must hide."""
    gen = torch.Generator().manual_seed(seed)
    matchers = [grammar.matcher() for _ in range(rows)]
    bits = torch.empty((rows, mask_words(vocab_size)), dtype=torch.int32)
    spent = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        fill_bitmasks(matchers, bits)
        allowed = allowed_tokens(bits, vocab_size)
        spent += time.perf_counter() - t0
        picks = torch.multinomial(allowed.float(), 1, generator=gen)[:, 0].tolist()  # the draw: not counted
        t0 = time.perf_counter()
        for m, t in zip(matchers, picks, strict=True):
            assert m.accept(t)
        spent += time.perf_counter() - t0
    return 1e6 * spent / steps


def main() -> None:
    environment = env.read_or_exit()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?")
    ap.add_argument("--preset", default="tiny", help="a synthetic preset, written to a temporary file (no MODEL)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--devices", default="cpu")
    ap.add_argument("--max-vram", type=float, default=None, help="GiB, as strata serve's")
    ap.add_argument("--constrained-rows", type=int, default=None,
                    help="rows of each batch under the grammar (default: all), the rest free")
    args = ap.parse_args()
    if args.constrained_rows is not None and args.constrained_rows < 1:
        ap.error(f"--constrained-rows {args.constrained_rows}: 1 or more")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(args.model) if args.model else Path(tmp) / f"{args.preset}.gguf"
        if not args.model:
            from strata_mgpu.model.synthetic import write_model

            write_model(path, args.preset, seed=0)
        f = GGUFFile(path)
        spec = spec_from_gguf(f)
        tok = tokenizer_from_gguf(f)
        batches = [int(b) for b in args.batch.split(",")]
        placement = Placement.from_env(environment, devices=tuple(args.devices.split(",")),
                                       max_vram_gib=(args.max_vram,))
        runner = build_runner(f, spec, placement, 256, kv_tokens=64 + args.tokens + 8, cpu_reference=True)
        grammar = GrammarCompiler(tok, spec.vocab_size).compile(
            "start: %json " + json.dumps(endless_schema(args.tokens)) + "\n")
        print(f"{path.name} on {args.devices} ({type(runner).__name__}), {args.tokens} tokens a request, "
              f"{args.rounds} rounds, medians")
        for batch in batches:
            engine = Engine(runner, tok, EngineConfig(max_running=batch, prefix_cache=False, arrival_gap_ms=0))
            engine.start()
            try:
                prompts = bench_prompts(tok, batch, 32)
                decode_rate(engine, prompts, 8, None, 0)  # warm-up
                free, constrained = [], []
                for r in range(args.rounds):
                    free.append(decode_rate(engine, prompts, args.tokens, None, 100 * r))
                    constrained.append(decode_rate(engine, prompts, args.tokens, grammar, 100 * r,
                                                   args.constrained_rows))
            finally:
                engine.shutdown()
            a, b = statistics.median(free), statistics.median(constrained)
            rows = batch if args.constrained_rows is None else min(batch, args.constrained_rows)
            host = host_cost_us(grammar, spec.vocab_size, rows, args.tokens)
            print(f"batch {batch}: free {a:.1f} tok/s, json-schema on {rows} row(s) {b:.1f} tok/s: "
                  f"{100 * (1 - b / a):+.1f}% "
                  f"(free runs {', '.join(f'{x:.1f}' for x in free)}; constrained "
                  f"{', '.join(f'{x:.1f}' for x in constrained)}); host work {host:.0f} us a step "
                  f"(masks, their bits on the CPU, advancing), a step free {1e6 * batch / a:.0f} us")


if __name__ == "__main__":
    main()
