"""Prometheus metrics of the engine, in a registry of its own (one per engine)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated", registry=r)
        self.prompt_seconds = Counter("strata_prompt_seconds", "Time spent in prefill", registry=r)
        self.decode_seconds = Counter("strata_decode_seconds", "Time spent in decode steps", registry=r)
        self.requests = Counter("strata_requests", "Requests finished, by reason", ["finish_reason"], registry=r)
        self.prefill_tps = Gauge("strata_prefill_tokens_per_second", "Prompt tok/s of the last prefill", registry=r)
        self.decode_tps = Gauge("strata_decode_tokens_per_second", "Generated tok/s of the last decode step",
                                registry=r)
        self.running = Gauge("strata_requests_running", "Requests being prefilled or decoded", registry=r)
        self.waiting = Gauge("strata_requests_waiting", "Requests queued for a slot", registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
