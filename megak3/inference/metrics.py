"""The server's Prometheus metrics (``GET /metrics``, text exposition format, prometheus_client).

Each server has its own registry (several servers in one process do not share counters):

``megak3_requests_running``            sequences (prompts / choices) admitted to the engine's batch now
``megak3_requests_waiting``            sequences queued for the engine thread or waiting for pages
``megak3_requests_total{status}``      finished HTTP generation requests by status code
``megak3_prompt_tokens_total``         prompt tokens of answered requests
``megak3_generation_tokens_total``     generated tokens
``megak3_generation_tokens_per_second`` generated tokens / wall seconds of the last engine step that made any
``megak3_prefix_cache_hit_rate``       prefix-cache hits / lookups since start (0 before any lookup)
``megak3_prefix_cache_hit_tokens_total`` prompt tokens served from the prefix cache
``megak3_cache_pages_used``            device pages in use (running sequences + cached prefixes), as
                                       of the engine thread's last snapshot (after each engine step)
``megak3_cache_pages_peak``            most device pages in use at once since start
``megak3_cache_pages_total``           the page pool
``megak3_time_to_first_token_seconds`` histogram, arrival to the engine's first token of every
                                       sequence (each prompt / choice), streamed or not
``megak3_request_latency_seconds``     histogram, arrival to the last byte of the response body

With engine replicas (megak3/inference/replicas.py) the cache series are the replicas' sums
(``megak3_cache_pages_peak``: the sum of their peaks), and each replica has, labelled
``replica="k"``: ``megak3_replica_up``, ``megak3_replica_requests_running``,
``megak3_replica_requests_waiting``, ``megak3_replica_prefix_cache_hit_tokens_total`` (its engine's),
``megak3_replica_routed_prefix_hit_tokens_total`` (what the router expected it to restore),
``megak3_replica_restarts_total``, ``megak3_replica_calls`` (requests its worker holds) and
``megak3_replica_cache_pages_available`` (pages a new sequence can still get there, as of its engine's
last request end).
"""
from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The gauges, counters and histograms above; ``cache_stats`` is a zero-argument callable returning
    ``Engine.cache_stats()``'s dict (read at scrape time) and ``num_pages`` the pool size."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, cache_stats, num_pages: int):
        r = self.registry = CollectorRegistry()
        self.running = Gauge("megak3_requests_running", "sequences in the engine's batch", registry=r)
        self.waiting = Gauge("megak3_requests_waiting", "sequences queued or waiting for pages", registry=r)
        self.requests = Counter("megak3_requests", "finished generation requests", ["status"], registry=r)
        self.prompt_tokens = Counter("megak3_prompt_tokens", "prompt tokens of answered requests", registry=r)
        self.gen_tokens = Counter("megak3_generation_tokens", "generated tokens", registry=r)
        self.tps = Gauge("megak3_generation_tokens_per_second",
                         "generated tokens / wall seconds of the last engine step", registry=r)
        self.ttft = Histogram("megak3_time_to_first_token_seconds", "arrival to first token (every sequence)",
                              buckets=BUCKETS, registry=r)
        self.latency = Histogram("megak3_request_latency_seconds", "arrival to the end of the response",
                                 buckets=BUCKETS, registry=r)

        def hit_rate():
            s = cache_stats()
            return s["hits"] / s["lookups"] if s.get("lookups") else 0.0

        Gauge("megak3_prefix_cache_hit_rate", "prefix-cache hits / lookups", registry=r).set_function(hit_rate)
        Gauge("megak3_prefix_cache_hit_tokens_total", "prompt tokens served from the prefix cache",
              registry=r).set_function(lambda: cache_stats().get("hit_tokens", 0))
        Gauge("megak3_cache_pages_used", "device pages in use", registry=r).set_function(
            lambda: cache_stats().get("device_pages_used", 0))
        Gauge("megak3_cache_pages_peak", "most device pages in use at once since start", registry=r).set_function(
            lambda: cache_stats().get("peak_pages", 0))
        Gauge("megak3_cache_pages_total", "device pages in the pool", registry=r).set(num_pages)

    def finished(self, tokens: int, requests: int, seconds: float) -> None:
        """An engine step produced ``tokens`` in ``seconds`` (``requests``: unused, kept for callers)."""
        self.gen_tokens.inc(tokens)
        self.tps.set(tokens / seconds if seconds > 0 else 0.0)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
