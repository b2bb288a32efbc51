"""Prometheus metrics of a node (served on /metrics)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram

if TYPE_CHECKING:
    from aenv.node.orchestrator import Node

SANDBOXES = Gauge("aenv_sandboxes", "Sandboxes on this node by state", ["state"])
TEMPLATES = Gauge("aenv_templates", "Templates on this node")
OPERATIONS = Counter("aenv_operations_total", "Lifecycle operations", ["op", "outcome"])
LAYER_CACHE = Gauge("aenv_layer_cache_bytes", "Disk held by cached image and build-step layers")
EGRESS = Counter("aenv_egress_connections_total", "Outbound connections asked for by sandboxes", ["outcome"])
OPERATION_SECONDS = Histogram(
    "aenv_operation_seconds",
    "Duration of lifecycle operations",
    ["op"],
    buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30),
)


def observe_node(node: Node) -> None:
    from aenv.node.state import SandboxState

    counts = {s.value: 0 for s in SandboxState if s != SandboxState.KILLED}
    for sb in node.sandboxes.values():
        if sb.state.value in counts:
            counts[sb.state.value] += 1
    for state, n in counts.items():
        SANDBOXES.labels(state=state).set(n)
    TEMPLATES.set(len(node.templates))
