r"""Measure a running `strata serve` as its users see it, over HTTP: prompt tok/s at given prompt
lengths (from the server's llama.cpp-style `timings`), decode tok/s of one request, and N chats
at once (client-side time to first token and tok/s each, from the streamed chunks).

    strata serve MODEL.gguf --devices 0,1 --layer-split auto --max-vram 16,16 &
    python3 -m strata_mgpu.tools.serve_probe http://127.0.0.1:8000 --prompt-tokens 1500,3000,6000 \\
        --max-tokens 128 --chats 8 [--json probe.json]

Prompts are real token ids of the server's tokenizer repeated to the length asked, so every length
is exact; `ignore_eos`, so each request produces `--max-tokens` tokens. A chat's tokens are counted
as the streamed chunks that carry text (a token that ends inside a UTF-8 character arrives with
the next one), so its tok/s can read a little low.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from strata_mgpu.tools.http_client import connect, stream_chunks

TEXT = ("The river ran past the old mill and under the stone bridge, where the children of the "
        "village gathered every evening to watch the boats come home with the day's catch. ")


@dataclass
class PromptRun:
    prompt_tokens: int
    prompt_per_second: float  # the server's timings
    predicted_per_second: float
    wall_s: float  # client-side, the whole request


@dataclass
class ChatRun:
    ttft_s: float  # client-side: request sent -> first streamed token
    tok_per_s: float  # (tokens - 1) / (last token - first token)
    tokens: int
    queue_ms: float = 0.0  # server-side (the last chunk's timings): submitted -> first prompt chunk launched
    prompt_ms: float = 0.0  # server-side: first chunk launched -> first token on the host


@dataclass
class ProbeResult:
    url: str
    model: str
    prompts: list[PromptRun] = field(default_factory=list)
    chats: list[ChatRun] = field(default_factory=list)
    chats_tok_per_s: float | None = None  # all chats' tokens over the span from first to last token

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class Probe:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600):
        self.url = url.rstrip("/")
        self.client, self.model = connect(url, api_key, timeout_s)
        ids = self.client.post("/tokenize", json={"content": TEXT * 8})
        ids.raise_for_status()
        self.ids: list[int] = ids.json()["tokens"]

    def prompt(self, n: int) -> list[int]:
        return (self.ids * (n // len(self.ids) + 1))[:n]

    def _body(self, n_prompt: int, max_tokens: int, seed: int, stream: bool) -> dict:
        return {"model": self.model, "prompt": self.prompt(n_prompt), "max_tokens": max_tokens,
                "temperature": 0.8, "seed": seed, "ignore_eos": True, "stream": stream}

    def prompt_run(self, n: int, max_tokens: int, seed: int = 0) -> PromptRun:
        t0 = time.perf_counter()
        r = self.client.post("/v1/completions", json=self._body(n, max_tokens, seed, stream=False))
        r.raise_for_status()
        timings = r.json().get("timings") or {}
        return PromptRun(prompt_tokens=n, prompt_per_second=float(timings.get("prompt_per_second", 0.0)),
                         predicted_per_second=float(timings.get("predicted_per_second", 0.0)),
                         wall_s=time.perf_counter() - t0)

    def chat(self, n_prompt: int, max_tokens: int, seed: int, start: threading.Barrier,
             stamps: list[float]) -> ChatRun:
        """One streamed request; `stamps` collects the arrival time of each token."""
        body = self._body(n_prompt, max_tokens, seed, stream=True)
        start.wait()
        t0 = time.perf_counter()
        arrivals: list[float] = []
        timings: dict = {}
        for chunk in stream_chunks(self.client, "/v1/completions", body):
            if any(c.get("text") for c in chunk.get("choices", [])):
                arrivals.append(time.perf_counter())
            timings = chunk.get("timings") or timings  # the last chunk carries them
        stamps.extend(arrivals)
        if not arrivals:
            raise RuntimeError("a streamed request returned no text")
        span = arrivals[-1] - arrivals[0]
        return ChatRun(ttft_s=arrivals[0] - t0, tok_per_s=(len(arrivals) - 1) / span if span > 0 else 0.0,
                       tokens=len(arrivals), queue_ms=float(timings.get("queue_ms", 0.0)),
                       prompt_ms=float(timings.get("prompt_ms", 0.0)))

    def chats(self, n: int, n_prompt: int, max_tokens: int) -> tuple[list[ChatRun], float]:
        """n streamed requests sent at once; each one's figures, and all tokens over their span."""
        start = threading.Barrier(n)
        stamps: list[float] = []
        out: list[ChatRun | None] = [None] * n
        errors: list[Exception] = []

        def run(i: int) -> None:
            try:
                out[i] = self.chat(n_prompt + i, max_tokens, seed=i, start=start, stamps=stamps)
            except Exception as e:  # reported after the others finish
                errors.append(e)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        span = max(stamps) - min(stamps)
        return out, (len(stamps) / span if span > 0 else 0.0)  # type: ignore[return-value]


def run_probe(url: str, prompt_tokens: list[int], max_tokens: int, chats: int, chat_prompt: int = 16,
              api_key: str | None = None, say=print) -> ProbeResult:
    probe = Probe(url, api_key)
    result = ProbeResult(url=url, model=probe.model)
    probe.prompt_run(min(prompt_tokens), 2)  # warm-up: kernels, the first graph capture
    for n in prompt_tokens:
        run = probe.prompt_run(n, max_tokens)
        result.prompts.append(run)
        say(f"{n:,} prompt tokens: prompt {run.prompt_per_second:,.0f} tok/s, decode "
            f"{run.predicted_per_second:,.1f} tok/s ({run.wall_s:.2f} s)")
    if chats:
        result.chats, result.chats_tok_per_s = probe.chats(chats, chat_prompt, max_tokens)
        ttft = [c.ttft_s for c in result.chats]
        say(f"{chats} chats at once: {result.chats_tok_per_s:,.1f} tok/s in all, "
            f"{min(c.tok_per_s for c in result.chats):,.1f}-{max(c.tok_per_s for c in result.chats):,.1f} each, "
            f"first token {1e3 * statistics.mean(ttft):,.0f} ms mean, {1e3 * max(ttft):,.0f} ms max (server: "
            f"queued {statistics.mean(c.queue_ms for c in result.chats):,.0f} ms, prompt "
            f"{statistics.mean(c.prompt_ms for c in result.chats):,.0f} ms mean; each chat's in the JSON)")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--prompt-tokens", default="1500,3000,6000")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--chats", type=int, default=8, help="streamed requests at once (0: none)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.prompt_tokens.split(",") if x.strip()]
        if not lengths or min(lengths) < 1 or args.max_tokens < 2 or args.chats < 0:
            raise ValueError
    except ValueError:
        ap.error("--prompt-tokens: positive whole numbers, comma-separated; --max-tokens >= 2; --chats >= 0")
    try:
        result = run_probe(args.url, lengths, args.max_tokens, args.chats, api_key=args.api_key)
    except httpx.HTTPError as e:
        sys.exit(f"serve_probe: {args.url}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())


if __name__ == "__main__":
    main()
