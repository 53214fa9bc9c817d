"""Prometheus metrics of a server (``GET /metrics``, prometheus-client's text format).

- ``megalith_http_requests_total{path, status}``: answered requests (``path`` is an
  endpoint of the server or ``other``, so scanners cannot grow the label set);
- ``megalith_running_sequences``, ``megalith_queued_sequences``: rows being decoded and
  rows waiting, read from the current engine at each scrape;
- ``megalith_time_to_first_token_seconds``, ``megalith_inter_token_latency_seconds``:
  histograms, from a request's arrival to its row's first token, and between a row's
  tokens (as the engine's thread hands them over);
- ``megalith_prompt_tokens_total``, ``megalith_generation_tokens_total``;
- with an engine that has ``kv_stats()`` (a paged KV cache: a dict with ``blocks_used``,
  ``blocks_free``, ``prefix_hits``, ``prefix_queries``): ``megalith_kv_blocks_used``,
  ``megalith_kv_blocks_free``, ``megalith_prefix_cache_hits_total``,
  ``megalith_prefix_cache_queries_total`` and ``megalith_prefix_cache_hit_rate``; absent
  for an engine without one.

Each server has its own registry (several servers may share a process: the tests).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from deploy.request_body import ASGIApp, Message, Receive, Scope, Send

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class ServingMetrics:
    """The metrics of one server; ``engine()`` returns the engine serving now."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "megalith_http_requests", "HTTP requests answered", ["path", "status"],
            registry=self.registry,
        )  # fmt: skip
        self.time_to_first_token = Histogram(
            "megalith_time_to_first_token_seconds", "From a request's arrival to a row's first "
            "token", buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.inter_token_latency = Histogram(
            "megalith_inter_token_latency_seconds", "Between two tokens of a row",
            buckets=LATENCY_BUCKETS, registry=self.registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "megalith_prompt_tokens", "Prompt tokens queued (special tokens included)",
            registry=self.registry,
        )  # fmt: skip
        self.generation_tokens = Counter(
            "megalith_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.registry.register(EngineCollector(engine))

    def token(self, seconds: float, follows_another: bool) -> None:
        """A row's new token, ``seconds`` after its previous one (or the request's start)."""
        histogram = self.inter_token_latency if follows_another else self.time_to_first_token
        histogram.observe(seconds)
        self.generation_tokens.inc()

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class EngineCollector(Collector):
    """Gauges read from the engine at scrape time."""

    def __init__(self, engine: Callable[[], Any]) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self.engine()
        yield _gauge("megalith_running_sequences", "Rows being decoded", engine.running)
        yield _gauge("megalith_queued_sequences", "Rows waiting for the engine", engine.queued)
        kv_stats = getattr(engine, "kv_stats", None)
        stats = kv_stats() if kv_stats is not None else None
        if stats is None:  # a static engine (a process engine's says so with None)
            return
        yield _gauge("megalith_kv_blocks_used", "KV cache blocks in use", stats["blocks_used"])
        yield _gauge("megalith_kv_blocks_free", "KV cache blocks free", stats["blocks_free"])
        hits, queries = stats["prefix_hits"], stats["prefix_queries"]
        yield CounterMetricFamily(
            "megalith_prefix_cache_hits", "Prompt blocks found in the prefix cache", value=hits
        )
        yield CounterMetricFamily(
            "megalith_prefix_cache_queries", "Prompt blocks looked up in the prefix cache",
            value=queries,
        )  # fmt: skip
        rate = hits / queries if queries else 0.0
        yield _gauge("megalith_prefix_cache_hit_rate", "prefix hits / prefix queries", rate)


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)


class RequestCounter:
    """ASGI middleware counting answered HTTP requests by endpoint and status; outermost,
    so the refusals of the body guard count too."""

    def __init__(self, app: ASGIApp, metrics: ServingMetrics, paths: Collection[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"] if scope["path"] in self.paths else "other"

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.requests.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)
