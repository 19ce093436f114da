"""Prometheus metrics of the engine, in a registry of its own (one per engine)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from strata_mgpu.engine.prefix_cache import PrefixCache
from strata_mgpu.model.kv_pool import BlockPool


class EngineMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("strata_prompt_tokens", "Prompt tokens computed (not those taken from the "
                                     "prefix cache)", registry=r)
        self.generated_tokens = Counter("strata_generated_tokens", "Tokens generated", registry=r)
        self.prompt_seconds = Counter("strata_prompt_seconds", "Time spent in prefill", registry=r)
        self.decode_seconds = Counter("strata_decode_seconds", "Time spent in decode steps", registry=r)
        self.requests = Counter("strata_requests", "Requests finished, by reason", ["finish_reason"], registry=r)
        self.prefill_tps = Gauge("strata_prefill_tokens_per_second",
                                 "Prompt tokens computed a second by the last prompt (from its first chunk to its "
                                 "first token)", registry=r)
        self.decode_tps = Gauge("strata_decode_tokens_per_second",
                                "Tokens a second of the last decode step, all its rows together: a batch rate, "
                                "the sum of the running requests' rates (a request's own is in its log line)",
                                registry=r)
        self.running = Gauge("strata_requests_running", "Requests being prefilled or decoded", registry=r)
        self.waiting = Gauge("strata_requests_waiting", "Requests queued for a slot", registry=r)
        self.preemptions = Counter("strata_preemptions", "Running requests sent back to the queue because the "
                                   "KV pool ran dry (computed again when readmitted)", registry=r)

    def watch_pool(self, pool: BlockPool) -> None:
        """Export the KV pool's blocks by state, read at each scrape."""
        self.registry.register(_PoolCollector(pool))

    def watch_prefix_cache(self, cache: PrefixCache) -> None:
        """Export the prefix cache's counters and tiers, read at each scrape."""
        self.registry.register(_PrefixCacheCollector(cache))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _PoolCollector(Collector):
    def __init__(self, pool: BlockPool):
        self.pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily]:
        refs = self.pool.refs
        shared = sum(1 for n in refs if n > 1)
        blocks = GaugeMetricFamily("strata_kv_pool_blocks", f"Blocks of the KV pool ({self.pool.block_tokens} "
                                   "tokens each): free, held once, held by more than one sequence or the prefix cache",
                                   labels=["state"])
        blocks.add_metric(["free"], self.pool.free_blocks)
        blocks.add_metric(["held"], self.pool.used_blocks - shared)
        blocks.add_metric(["shared"], shared)
        yield blocks


class _PrefixCacheCollector(Collector):
    def __init__(self, cache: PrefixCache):
        self.cache = cache

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        s = self.cache.stats
        yield CounterMetricFamily("strata_prefix_cache_queries", "Prompts matched against the prefix cache",
                                  value=s.queries)
        yield CounterMetricFamily("strata_prefix_cache_hits", "Prompts that started with cached blocks",
                                  value=s.hits)
        yield CounterMetricFamily("strata_prefix_cache_tokens", "Prompt tokens taken from the prefix cache",
                                  value=s.cached_tokens)
        blocks = GaugeMetricFamily("strata_prefix_cache_bytes", "Bytes of KV blocks the prefix cache holds, by tier",
                                   labels=["tier"])
        for tier, n in self.cache.tier_bytes().items():
            blocks.add_metric([tier], n)
        yield blocks
