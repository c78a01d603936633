"""The server's Prometheus metrics (prometheus_client), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "transmuter_jax"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters of requests and tokens, histograms of latencies, gauges of the queue."""

    def __init__(
        self,
        waiting: Callable[[], float],
        running: Callable[[], float],
        prefix: Callable[[], Any] | None = None,
        speculative: Callable[[], tuple[int, int]] | None = None,
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            f"{PREFIX}_requests",
            "requests answered, by route and status",
            ["route", "status"],
            registry=r,
        )
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens", registry=r)
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "generated tokens", registry=r
        )
        self.ttft = Histogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "time from arrival to the first token",
            buckets=_SECONDS,
            registry=r,
        )
        self.tpot = Histogram(
            f"{PREFIX}_time_per_output_token_seconds",
            "time per output token after the first",
            buckets=_SECONDS,
            registry=r,
        )
        self.latency = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "time from arrival to the last token",
            buckets=_SECONDS,
            registry=r,
        )
        self.waiting = Gauge(f"{PREFIX}_num_requests_waiting", "requests queued", registry=r)
        self.waiting.set_function(waiting)
        self.running = Gauge(f"{PREFIX}_num_requests_running", "requests in flight", registry=r)
        self.running.set_function(running)
        if prefix is not None:  # the prefix cache's PrefixStats
            self._prefix_gauges(prefix)
        if speculative is not None:  # (drafted, accepted) tokens of finished requests
            for i, name in enumerate(("drafted", "accepted")):
                gauge = Gauge(
                    f"{PREFIX}_speculative_{name}_tokens",
                    f"draft tokens {name} in speculative decoding, over the finished requests",
                    registry=r,
                )
                gauge.set_function(lambda i=i: speculative()[i])

    def _prefix_gauges(self, stats: Callable[[], Any]) -> None:
        r = self.registry
        gauges = {
            "queries": ("prompt tokens looked up in the prefix cache", "query_tokens"),
            "hits": ("prompt tokens whose KV rows came from the prefix cache", "hit_tokens"),
            "bytes": ("bytes of KV rows the prefix cache holds", "bytes"),
        }
        for name, (doc, field) in gauges.items():
            gauge = Gauge(f"{PREFIX}_prefix_cache_{name}", doc, registry=r)
            gauge.set_function(lambda field=field: getattr(stats(), field))
        rate = Gauge(
            f"{PREFIX}_prefix_cache_hit_rate",
            "prompt tokens from the prefix cache / prompt tokens looked up",
            registry=r,
        )
        rate.set_function(lambda: stats().hit_tokens / max(stats().query_tokens, 1))

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
