"""The server's Prometheus metrics (prometheus_client), in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

PREFIX = "transmuter_jax"
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class Metrics:
    """Counters of requests and tokens, histograms of latencies, gauges of the queue."""

    def __init__(self, waiting: Callable[[], float], running: Callable[[], float]):
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

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return generate_latest(self.registry)
