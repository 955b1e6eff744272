"""The gateway's Prometheus metrics (``GET /metrics``, text format 0.0.4).

Per request, labelled by env and endpoint (the route name: create, step, close, envs, health, ...):
    cope_gateway_requests_total{env,endpoint,code}     answered requests by HTTP status
    cope_gateway_errors_total{env,endpoint,error}      error answers by error name
    cope_gateway_request_seconds{env,endpoint}         time inside the gateway handler
    cope_gateway_backend_seconds{env,endpoint}         time spent waiting on backend calls (requests that made one)
    cope_gateway_queue_wait_seconds{env,endpoint}      time waiting for a replica slot (requests that waited)
    cope_gateway_overhead_seconds{env,endpoint}        gateway-added time = request - backend - queue wait
Per env: sessions opened / reaped (idle TTL) / failed (backend error), create retries on another replica.
Read from live state at scrape time, per env and replica: open sessions, in-flight and queued requests,
replica up (1) or down (0), restarts of spawned replicas. The ``replica`` label is the replica's URL, or its
position in its env ("0", "1", ...) in a scrape rendered with ``show_urls=False`` (a caller without the gateway's
token: where backends run is for the token's holders).
"""

from __future__ import annotations

from typing import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

# From 10 us: the gateway's own time per request is tens of microseconds, and with 100 us as the first bound
# its p50 could only be read as "under 100 us".
LATENCY_BUCKETS = (0.00001, 0.000025, 0.00005, 0.000075, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.002, 0.005,
                   0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _LiveState:
    """Collector that reads gauges from the gateway at scrape time (no per-request gauge updates)."""

    def __init__(self, snapshot: Callable[[], Iterable[dict]]):
        self.snapshot = snapshot
        self.show_urls = True

    def collect(self):
        sessions = GaugeMetricFamily("cope_gateway_open_sessions", "open sessions", labels=["env"])
        inflight = GaugeMetricFamily("cope_gateway_inflight", "requests in flight to a replica", labels=["env", "replica"])
        queued = GaugeMetricFamily("cope_gateway_queue_depth", "requests waiting for a replica slot",
                                   labels=["env", "replica"])
        up = GaugeMetricFamily("cope_gateway_replica_up", "1 when the replica passes health checks",
                               labels=["env", "replica"])
        restarts = GaugeMetricFamily("cope_gateway_replica_restarts", "restarts of a spawned replica",
                                     labels=["env", "replica"])
        for env in self.snapshot():
            sessions.add_metric([env["name"]], env["open_sessions"])
            for i, r in enumerate(env["replicas"]):
                labels = [env["name"], r["url"] if self.show_urls else str(i)]
                inflight.add_metric(labels, r["inflight"])
                queued.add_metric(labels, r["queued"])
                up.add_metric(labels, 1.0 if r["healthy"] else 0.0)
                restarts.add_metric(labels, r["restarts"])
        yield from (sessions, inflight, queued, up, restarts)


class GatewayMetrics:
    def __init__(self, snapshot: Callable[[], Iterable[dict]]):
        self.registry = CollectorRegistry()
        r, le = self.registry, LATENCY_BUCKETS
        self.requests = Counter("cope_gateway_requests", "answered requests", ["env", "endpoint", "code"], registry=r)
        self.errors = Counter("cope_gateway_errors", "error answers", ["env", "endpoint", "error"], registry=r)
        self.request_s = Histogram("cope_gateway_request_seconds", "time inside the gateway handler",
                                   ["env", "endpoint"], buckets=le, registry=r)
        self.backend_s = Histogram("cope_gateway_backend_seconds", "time waiting on backend calls",
                                   ["env", "endpoint"], buckets=le, registry=r)
        self.queue_s = Histogram("cope_gateway_queue_wait_seconds", "time waiting for a replica slot",
                                 ["env", "endpoint"], buckets=le, registry=r)
        self.overhead_s = Histogram("cope_gateway_overhead_seconds", "gateway-added time (request - backend - queue)",
                                    ["env", "endpoint"], buckets=le, registry=r)
        self.opened = Counter("cope_gateway_sessions_opened", "sessions opened", ["env"], registry=r)
        self.reaped = Counter("cope_gateway_sessions_reaped", "sessions closed after the idle TTL", ["env"], registry=r)
        self.failed = Counter("cope_gateway_sessions_failed", "sessions ended by a backend failure", ["env"], registry=r)
        self.retries = Counter("cope_gateway_create_retries", "session creations retried on another replica",
                               ["env"], registry=r)
        self.live = _LiveState(snapshot)
        self.registry.register(self.live)
        self._children: dict[tuple, tuple] = {}

    def observe(self, env: str, endpoint: str, code: int, error: str | None, total: float, backend: float,
                queue: float) -> None:
        key = (env, endpoint, code)
        children = self._children.get(key)
        if children is None:  # label lookups cost more than the observations: cache the children
            children = self._children[key] = (
                self.requests.labels(env, endpoint, str(code)), self.request_s.labels(env, endpoint),
                self.backend_s.labels(env, endpoint), self.queue_s.labels(env, endpoint),
                self.overhead_s.labels(env, endpoint))
        children[0].inc()
        if error:
            self.errors.labels(env, endpoint, error).inc()
        children[1].observe(total)
        if backend:
            children[2].observe(backend)
        if queue:
            children[3].observe(queue)
        children[4].observe(max(total - backend - queue, 0.0))

    def render(self, show_urls: bool = True) -> bytes:
        """The text format; replicas labelled by URL, or by position when not ``show_urls``."""
        self.live.show_urls = show_urls  # read by collect(), which generate_latest calls before it returns
        try:
            return generate_latest(self.registry)
        finally:
            self.live.show_urls = True
