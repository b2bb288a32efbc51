"""Prometheus metrics of a gateway (its /metrics): its own requests, and the cluster as its
mirror of the directory sees it."""

from __future__ import annotations

import time
from collections import Counter as Tally
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from aenv.cluster.mirror import Mirror

# What a request was, by how the gateway routed it (a label of few values, never an id).
ROUTES = ("create", "list", "sandbox", "envd", "port", "websocket", "nodes", "own", "other")


class GatewayMetrics:
    """One registry per gateway (a process may hold more than one in tests)."""

    def __init__(self, mirror: Mirror) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aenv_gateway_requests_total",
            "Requests the gateway answered, by route and status class",
            ["route", "status"],
            registry=self.registry,
        )
        self.seconds = Histogram(
            "aenv_gateway_request_seconds",
            "Seconds from a request's arrival to its response's start (a stream's first byte)",
            ["route"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
            registry=self.registry,
        )
        self.registry.register(_ClusterGauges(mirror))

    def observe(self, route: str, status: int, seconds: float) -> None:
        self.requests.labels(route=route, status=f"{status // 100}xx").inc()
        self.seconds.labels(route=route).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _ClusterGauges(Collector):
    """Read from the mirror at each scrape: no state of its own to fall out of date."""

    def __init__(self, mirror: Mirror) -> None:
        self.mirror = mirror

    def collect(self) -> Iterator[Metric]:
        m = self.mirror
        nodes = GaugeMetricFamily("aenv_cluster_nodes", "Nodes in the directory, by readiness", labels=["state"])
        draining = sum(1 for n in m.nodes.values() if n.draining)
        nodes.add_metric(["ready"], len(m.nodes) - draining)
        nodes.add_metric(["draining"], draining)
        yield nodes
        states = Tally(e.state for e in m.sandboxes.values())
        # entries whose node left the cluster, but durable pauses (any node resumes them)
        lost = sum(1 for e in m.sandboxes.values() if e.node_id not in m.nodes and not e.durable)
        sandboxes = GaugeMetricFamily(
            "aenv_cluster_sandboxes", "Sandboxes in the directory, by state", labels=["state"]
        )
        for state in ("running", "paused"):
            sandboxes.add_metric([state], states.get(state, 0))
        sandboxes.add_metric(["lost"], lost)  # counted in their state too
        yield sandboxes
        yield GaugeMetricFamily(
            "aenv_cluster_capacity",
            "Sandboxes the ready nodes may still start",
            value=sum(n.room for n in m.nodes.values() if not n.draining),
        )
        yield GaugeMetricFamily(
            "aenv_gateway_directory_connected", "1 while the directory watch runs", value=int(m.connected)
        )
        age = time.monotonic() - m.synced_at if m.synced_at else float("nan")
        yield GaugeMetricFamily(
            "aenv_gateway_directory_age_seconds", "Seconds since the mirror last heard from etcd", value=age
        )
