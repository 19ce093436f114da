r"""Replay agent sessions against an OpenAI-compatible server, as an agent drives it: a session is a
system prompt and N turns, each appending a user message (or a tool's result) to the conversation
and then the model's answer, the whole conversation sent again every turn. Sessions run one at a
time or several at once, all sharing the one system prompt.

    strata serve MODEL.gguf --max-vram 16 &           # or: llama-server -m MODEL.gguf ...
    python3 -m strata_mgpu.tools.agent_trace http://127.0.0.1:8080 --sessions 1,4 --turns 10 \\
        --system-tokens 4096 --turn-tokens 1536 --answer-tokens 150 [--json trace.json]

Per turn: the client's time to first token, the prompt's tokens, how many the server took from its
cache and how many it computed. A fresh prompt as long as a turn's new tokens, sent alone, is the
reference the turns are held to. Texts are random English words (seeded), sized by the server's
`/tokenize`; answers are sampled with `ignore_eos`, so each is `--answer-tokens` long.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import httpx

from strata_mgpu.tools.http_client import connect, stream_chunks

WORDS = ("river", "mill", "bridge", "stone", "village", "evening", "boat", "harbour", "market", "bread", "window",
         "garden", "letter", "morning", "winter", "summer", "forest", "valley", "mountain", "road", "station",
         "engine", "signal", "lantern", "table", "chair", "kitchen", "candle", "paper", "pencil", "number", "answer",
         "question", "record", "report", "server", "client", "request", "function", "module", "object", "method",
         "value", "result", "error", "warning", "message", "system", "process", "thread", "queue", "buffer",
         "memory", "device", "driver", "kernel", "packet", "socket", "header", "footer", "layer", "model", "token",
         "vector", "matrix")


@dataclass
class Turn:
    ttft_ms: float  # client-side: request sent -> first streamed text
    wall_ms: float  # the whole request
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    answer_tokens: int


@dataclass
class Session:
    turns: list[Turn] = field(default_factory=list)
    wall_s: float = 0.0


@dataclass
class PoolPeak:
    """What a strata server's /metrics said of its KV pool while a run went (none from other servers): the
    most blocks in use, the most held more than once (shared prefixes), and the preemptions."""

    used_blocks: int = 0
    shared_blocks: int = 0
    free_blocks_least: int = -1
    preemptions: int = 0


@dataclass
class TraceRun:
    concurrent: int
    sessions: list[Session]
    wall_s: float  # all sessions, first request to last answer
    pool: PoolPeak | None = None


@dataclass
class TraceResult:
    url: str
    model: str
    system_tokens: int
    turn_tokens: int
    answer_tokens: int
    turns: int
    reference_ttft_ms: float  # a fresh prompt of one turn's new tokens, nothing cached
    runs: list[TraceRun] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)


class TraceClient:
    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 900):
        self.client, self.model = connect(url, api_key, timeout_s)
        sample = " ".join(WORDS)
        ids = self.client.post("/tokenize", json={"content": sample})
        ids.raise_for_status()
        self.tokens_per_word = len(ids.json()["tokens"]) / len(WORDS)

    def text(self, tokens: int, rng: random.Random) -> str:
        """Random words, about `tokens` tokens of the server's tokenizer."""
        return " ".join(rng.choice(WORDS) for _ in range(max(1, round(tokens / self.tokens_per_word))))

    def turn(self, messages: list[dict], answer_tokens: int, seed: int) -> tuple[Turn, str]:
        body = {"model": self.model, "messages": messages, "max_tokens": answer_tokens, "temperature": 0.8,
                "seed": seed, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        first = None
        text: list[str] = []
        usage: dict = {}
        timings: dict = {}
        for chunk in stream_chunks(self.client, "/v1/chat/completions", body):
            for choice in chunk.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
            usage = chunk.get("usage") or usage
            timings = chunk.get("timings") or timings
        end = time.perf_counter()
        prompt = int(usage.get("prompt_tokens", 0) or timings.get("prompt_n", 0) + timings.get("cache_n", 0))
        details = usage.get("prompt_tokens_details") or {}
        cached = int(details.get("cached_tokens", timings.get("cache_n", 0)) or 0)
        computed = int(timings["prompt_n"]) if "prompt_n" in timings else prompt - cached
        return Turn(ttft_ms=1e3 * ((first or end) - t0), wall_ms=1e3 * (end - t0), prompt_tokens=prompt,
                    cached_tokens=cached, computed_tokens=computed,
                    answer_tokens=int(usage.get("completion_tokens", 0))), "".join(text)


def run_session(client: TraceClient, system: str, turns: int, turn_tokens: int, answer_tokens: int,
                rng: random.Random, start: threading.Barrier | None = None) -> Session:
    messages: list[dict] = [{"role": "system", "content": system}]
    session = Session()
    if start is not None:
        start.wait()
    t0 = time.perf_counter()
    for k in range(turns):
        label = "Tool result" if k % 2 else "Request"
        messages.append({"role": "user", "content": f"{label}: {client.text(turn_tokens, rng)}"})
        turn, answer = client.turn(messages, answer_tokens, seed=rng.randrange(1 << 30))
        session.turns.append(turn)
        messages.append({"role": "assistant", "content": answer})
    session.wall_s = time.perf_counter() - t0
    return session


def run_trace(url: str, sessions: list[int], turns: int, system_tokens: int, turn_tokens: int,
              answer_tokens: int, api_key: str | None = None, seed: int = 0, say=print) -> TraceResult:
    client = TraceClient(url, api_key)
    rng = random.Random(seed)
    # warm-up (kernels, graphs), then the reference: one turn's new tokens as a fresh prompt
    client.turn([{"role": "user", "content": client.text(256, rng)}], 4, seed=1)
    fresh = [{"role": "user", "content": client.text(turn_tokens + answer_tokens, rng)}]
    reference, _ = client.turn(fresh, 2, seed=2)
    result = TraceResult(url=url, model=client.model, system_tokens=system_tokens, turn_tokens=turn_tokens,
                         answer_tokens=answer_tokens, turns=turns, reference_ttft_ms=reference.ttft_ms)
    say(f"fresh prompt of {reference.prompt_tokens:,} tokens (a turn's new ones): first token in "
        f"{reference.ttft_ms:,.0f} ms")
    for n in sessions:
        system = "You are an agent. " + client.text(system_tokens, rng)  # one per run: no run finds another's
        run = run_sessions(client, n, system, turns, turn_tokens, answer_tokens, [rng.randrange(1 << 30) for _ in
                                                                                   range(n)])
        result.runs.append(run)
        say(summary(run, reference.ttft_ms))
    return result


class PoolWatch:
    """Polls the server's /metrics for its KV pool's blocks (`strata_kv_pool_blocks`) while a run goes."""

    def __init__(self, client: httpx.Client, every_s: float = 0.25):
        self.client, self.every_s = client, every_s
        self.peak: PoolPeak | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> PoolWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()  # the preemptions at the end

    def _poll(self) -> None:
        while not self._stop.wait(self.every_s):
            if not self._read():
                return

    def _read(self) -> bool:
        try:
            r = self.client.get("/metrics")
        except httpx.HTTPError:
            return False
        if r.status_code != 200 or "strata_kv_pool_blocks" not in r.text:
            return False
        blocks, preempted = {}, 0
        for line in r.text.splitlines():
            if line.startswith("strata_kv_pool_blocks{"):
                state = line.split('state="', 1)[1].split('"', 1)[0]
                blocks[state] = int(float(line.rsplit(" ", 1)[1]))
            elif line.startswith("strata_preemptions_total "):
                preempted = int(float(line.rsplit(" ", 1)[1]))
        p = self.peak = self.peak or PoolPeak()
        p.used_blocks = max(p.used_blocks, blocks.get("held", 0) + blocks.get("shared", 0))
        p.shared_blocks = max(p.shared_blocks, blocks.get("shared", 0))
        free = blocks.get("free", 0)
        p.free_blocks_least = free if p.free_blocks_least < 0 else min(p.free_blocks_least, free)
        p.preemptions = preempted
        return True


def run_sessions(client: TraceClient, n: int, system: str, turns: int, turn_tokens: int, answer_tokens: int,
                 seeds: list[int]) -> TraceRun:
    """n sessions at once on one system prompt, each on its own thread, started together."""
    out: list[Session | None] = [None] * n
    errors: list[Exception] = []
    start = threading.Barrier(n)

    def work(i: int) -> None:
        try:
            out[i] = run_session(client, system, turns, turn_tokens, answer_tokens, random.Random(seeds[i]), start)
        except Exception as e:  # reported once the others are done
            errors.append(e)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    with PoolWatch(httpx.Client(base_url=client.client.base_url, headers=client.client.headers)) as watch:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return TraceRun(concurrent=n, sessions=[s for s in out if s is not None], wall_s=time.perf_counter() - t0,
                    pool=watch.peak)


def summary(run: TraceRun, reference_ttft_ms: float) -> str:
    turns = [t for s in run.sessions for t in s.turns]
    later = [t for s in run.sessions for t in s.turns[1:]]
    new = sum(t.prompt_tokens for s in run.sessions for t in s.turns[1:]) - sum(
        s.turns[k].prompt_tokens + s.turns[k].answer_tokens for s in run.sessions for k in range(len(s.turns) - 1))
    lines = [f"{run.concurrent} session(s) at once: wall {run.wall_s:.2f} s; each session "
             f"{', '.join(f'{s.wall_s:.2f}' for s in run.sessions)} s"]
    for k in range(len(run.sessions[0].turns)):
        ts = [s.turns[k] for s in run.sessions]
        lines.append(f"  turn {k + 1}: first token {statistics.mean(t.ttft_ms for t in ts):,.0f} ms mean, prompt "
                     f"{statistics.mean(t.prompt_tokens for t in ts):,.0f} tok, cached "
                     f"{statistics.mean(t.cached_tokens for t in ts):,.0f}, computed "
                     f"{statistics.mean(t.computed_tokens for t in ts):,.0f}")
    if later:
        lines.append(f"  turns 2+: computed {sum(t.computed_tokens for t in later):,} tokens for {new:,} new "
                     f"({sum(t.computed_tokens for t in later) / max(new, 1):.2f}x); first token "
                     f"{statistics.mean(t.ttft_ms for t in later) / reference_ttft_ms:.2f}x the fresh prompt's")
    lines.append(f"  all turns: {sum(t.computed_tokens for t in turns):,} tokens computed, "
                 f"{sum(t.cached_tokens for t in turns):,} cached")
    if run.pool is not None:
        p = run.pool
        lines.append(f"  KV pool: at most {p.used_blocks:,} blocks in use, {p.shared_blocks:,} of them shared, "
                     f"{p.free_blocks_least:,} free at the least; {p.preemptions} preemptions since start")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("--sessions", default="1,4", help="sessions at once, one run each (comma-separated)")
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=4096)
    ap.add_argument("--turn-tokens", type=int, default=1536, help="a turn's new message")
    ap.add_argument("--answer-tokens", type=int, default=150)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    try:
        sessions = [int(x) for x in args.sessions.split(",") if x.strip()]
        if not sessions or min(sessions) < 1 or args.turns < 1 or min(args.system_tokens, args.turn_tokens,
                                                                          args.answer_tokens) < 1:
            raise ValueError
    except ValueError:
        ap.error("--sessions: positive whole numbers, comma-separated; --turns and the token counts >= 1")
    try:
        result = run_trace(args.url, sessions, args.turns, args.system_tokens, args.turn_tokens, args.answer_tokens,
                           api_key=args.api_key, seed=args.seed)
    except httpx.HTTPError as e:
        sys.exit(f"agent_trace: {args.url}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())


if __name__ == "__main__":
    main()
