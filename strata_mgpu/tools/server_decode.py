"""Decode measured the way the server decodes: N concurrent requests through the real `Engine`.

`strata bench` times the runner's decode call alone; a served request also pays for sampling, the
tokens' trip to the host, detokenizing, stop matching and its share of a batch. Sampling is on
(EOS ignored so every request makes max_tokens tokens).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import asdict, dataclass, replace
from importlib import resources

from strata_mgpu.config import EngineConfig
from strata_mgpu.engine.engine import Engine, RequestOutput
from strata_mgpu.engine.runner import ModelRunner
from strata_mgpu.engine.sampler import SamplingParams
from strata_mgpu.model.tokenizer import Tokenizer
from strata_mgpu.split.runner import SplitRunner
from strata_mgpu.stage.experts.cache import vram_share
from strata_mgpu.stage.stage import Stage


@dataclass(frozen=True)
class RequestDecode:
    request_id: str
    n_prompt_tokens: int
    n_generated: int
    ttft_s: float  # submit -> first token on the host
    decode_s: float  # first token -> last token on the host
    decode_tok_per_s: float | None  # (n_generated - 1) / decode_s; None with one token
    queue_ms: float = 0.0  # the engine's timings: submit -> its first prompt chunk launched
    prompt_ms: float = 0.0  # that launch -> the first token on the host


@dataclass(frozen=True)
class ServerDecodeReport:
    n_requests: int
    max_tokens: int
    prompt_tokens: int
    max_running: int  # the engine's batch limit; below n_requests, requests queue
    wall_s: float  # first submit -> last request finished
    n_generated: int  # all requests together
    aggregate_tok_per_s: float  # n_generated / wall_s (prefill and queueing included)
    steady_tok_per_s: float | None  # tokens landed while every request was decoding / that window
    mean_ttft_s: float
    max_ttft_s: float
    requests: tuple[RequestDecode, ...]
    # share of the run's expert picks (its prompts' included) read from VRAM; None: no expert cache.
    # The bench's decode feeds random tokens, the server its prompts and sampled ones: where not
    # every expert is resident the two hit rates, and so the two speeds, can differ.
    hit_rate: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        per = [r.decode_tok_per_s for r in self.requests if r.decode_tok_per_s is not None]
        steady = f"{self.steady_tok_per_s:.1f}" if self.steady_tok_per_s is not None else "n/a"
        each = f"{min(per):.1f}-{max(per):.1f}" if per else "n/a"
        hits = f", {100 * self.hit_rate:.0f}% of picks read from VRAM" if self.hit_rate is not None else ""
        n = len(self.requests)
        hits += (f" (engine: queued {sum(r.queue_ms for r in self.requests) / n:.0f} ms, prompt "
                 f"{sum(r.prompt_ms for r in self.requests) / n:.0f} ms mean)") if n else ""
        return (f"server decode, {self.n_requests} request(s) x {self.max_tokens} tokens: {steady} tok/s in all "
                f"while all decode ({self.aggregate_tok_per_s:.1f} over the whole run), {each} tok/s each, "
                f"time to first token {1e3 * self.mean_ttft_s:.0f} ms mean, {1e3 * self.max_ttft_s:.0f} ms max{hits}")


@dataclass
class _Track:

    t_submit: float
    n_prompt: int
    arrivals: list[tuple[float, int]]
    last: RequestOutput | None = None


def bench_prompts(tokenizer: Tokenizer, n: int, length: int) -> list[list[int]]:
    """n different prompts of `length` tokens each, cut from the bundled corpus (cycled)."""
    text = resources.files("strata_mgpu").joinpath("data/corpus.txt").read_text(encoding="utf-8")
    ids = tokenizer.encode(text, add_special=False)
    assert ids, "the corpus encodes to no tokens"
    stream = itertools.cycle(ids)
    return [[next(stream) for _ in range(length)] for _ in range(n)]


def measure_server_decode(runner: ModelRunner, tokenizer: Tokenizer, n_requests: int, max_tokens: int, *,
                          prompt_tokens: int = 32, config: EngineConfig | None = None, temperature: float = 0.8,
                          seed: int = 0, warmup_tokens: int = 8, timeout_s: float = 600.0) -> ServerDecodeReport:
    """Submit n_requests at once to an engine over `runner` and time them to their last token, after
    an untimed warm-up request. Raises RuntimeError if a request fails or the run exceeds timeout_s."""
    if n_requests < 1 or max_tokens < 1 or prompt_tokens < 1:
        raise ValueError("n_requests, max_tokens and prompt_tokens must be at least 1")
    config = config or EngineConfig(max_running=n_requests)
    engine = Engine(runner, tokenizer, config)
    stages = runner.stages if isinstance(runner, Stage | SplitRunner) else []  # the reference has no cache
    caches = [s.experts.cache for s in stages if s.experts.cache is not None]
    engine.start()
    try:
        if warmup_tokens:
            _run(engine, bench_prompts(tokenizer, 1, prompt_tokens), warmup_tokens, temperature, seed, timeout_s)
        prompts = bench_prompts(tokenizer, n_requests, prompt_tokens)
        before = [c.tally() for c in caches]  # the engine idles: no pass runs while these read
        t0 = time.perf_counter()
        tracks = _run(engine, prompts, max_tokens, temperature, seed, timeout_s)
        t_end = time.perf_counter()
    finally:
        engine.shutdown()
    after = [c.tally() for c in caches]
    vram = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    picks = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    report = _report(tracks, t0, t_end, max_tokens, prompt_tokens, config.max_running)
    return replace(report, hit_rate=vram_share(caches, vram, picks))


def _run(engine: Engine, prompts: list[list[int]], max_tokens: int, temperature: float, seed: int,
         timeout_s: float) -> dict[str, _Track]:
    tracks: dict[str, _Track] = {}
    lock = threading.Lock()
    all_done = threading.Event()

    def on_output(out: RequestOutput) -> None:  # the engine's thread
        now = time.perf_counter()
        with lock:
            track = tracks[out.request_id]
            track.arrivals.append((now, len(out.token_ids)))
            if out.finished:
                track.last = out
                if all(t.last is not None for t in tracks.values()):
                    all_done.set()

    with lock:  # no output is handled before every request is tracked
        for i, prompt in enumerate(prompts):
            rid = f"bench-{i}"
            tracks[rid] = _Track(t_submit=time.perf_counter(), n_prompt=len(prompt), arrivals=[])
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed + i, ignore_eos=True)
            engine.submit(prompt, params, on_output, request_id=rid)
    if not all_done.wait(timeout_s):
        for rid in tracks:
            engine.abort(rid)
        raise RuntimeError(f"the requests did not finish within {timeout_s:.0f} s")
    for rid, t in tracks.items():
        assert t.last is not None
        if t.last.finish_reason == "error":
            raise RuntimeError(f"request {rid} failed: {t.last.error}")
    return tracks


def _report(tracks: dict[str, _Track], t0: float, t_end: float, max_tokens: int, prompt_tokens: int,
            max_running: int) -> ServerDecodeReport:
    requests = []
    firsts, finishes = [], []
    for rid, t in tracks.items():
        assert t.last is not None
        with_tokens = [at for at, n in t.arrivals if n]
        t_first, t_last = with_tokens[0], with_tokens[-1]
        firsts.append(t_first)
        finishes.append(t.arrivals[-1][0])
        decode_s = t_last - t_first
        n = t.last.n_generated
        timings = t.last.timings
        requests.append(RequestDecode(request_id=rid, n_prompt_tokens=t.n_prompt, n_generated=n,
                                      ttft_s=t_first - t.t_submit, decode_s=decode_s,
                                      decode_tok_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else None,
                                      queue_ms=timings.queue_ms if timings else 0.0,
                                      prompt_ms=timings.prompt_ms if timings else 0.0))
    n_generated = sum(r.n_generated for r in requests)
    window_start, window_end = max(firsts), min(finishes)
    in_window = sum(n for t in tracks.values() for at, n in t.arrivals if window_start < at <= window_end)
    steady = in_window / (window_end - window_start) if window_end > window_start and in_window else None
    ttfts = [r.ttft_s for r in requests]
    return ServerDecodeReport(n_requests=len(requests), max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                              max_running=max_running, wall_s=t_end - t0, n_generated=n_generated,
                              aggregate_tok_per_s=n_generated / (t_end - t0), steady_tok_per_s=steady,
                              mean_ttft_s=sum(ttfts) / len(ttfts), max_ttft_s=max(ttfts), requests=tuple(requests))
