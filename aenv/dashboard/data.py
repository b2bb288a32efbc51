"""What the dashboard and ``aenv top`` show of one node, as JSON; a gateway merges its nodes' answers.

- ``node_summary``: the node's state, load, capacity and cache use;
- ``stats``: the counters behind the charts (operations, failures by reason, latency histograms,
  commands by outcome and their start latency), cumulative since the node started: a viewer takes
  rates and percentiles from two readings;
- ``artifacts``: templates and snapshots, their size, commit state and where they are cached;
- ``family``: a sandbox's fork family on this node.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from prometheus_client import REGISTRY

from aenv import __version__
from aenv.api.schemas import rfc3339
from aenv.node import metrics
from aenv.node.service import BuildHost, LiveSandbox, NodeService, SandboxState, SnapshotRecord, TemplateRecord

MAX_FAMILY = 200  # sandboxes a family lists (a fork of 100 children, twice)
MAX_ANCESTORS = 32  # parents walked up from a sandbox


def node_id(node: NodeService) -> str:
    return node.settings.node_id or socket.gethostname()


def node_summary(node: NodeService) -> dict[str, Any]:
    running = paused = starting = 0
    for sb in list(node.sandboxes.values()):
        if sb.state == SandboxState.RUNNING:
            running += 1
        elif sb.state == SandboxState.PAUSED:
            paused += 1
        elif sb.state != SandboxState.KILLED:
            starting += 1
    settings = node.settings
    return {
        "nodeID": node_id(node),
        "status": "ready",
        "version": __version__,
        "driver": settings.driver,
        "running": running,
        "paused": paused,
        "starting": starting,
        "maxSandboxes": settings.max_sandboxes,
        "load1": round(os.getloadavg()[0], 2),
        "cpuCount": os.cpu_count() or 1,
        "cacheBytes": int(REGISTRY.get_sample_value("aenv_layer_cache_bytes") or 0),
        "cacheBudgetBytes": settings.layer_cache_mb * 2**20,
        "repoPending": len(metrics.pending_commits(node)),
        "templates": len(node.templates),
        "startedAt": node.started_at,
    }


def stats(node: NodeService) -> dict[str, Any]:
    node.observe_metrics()
    return {"at": time.time(), "nodes": 1, **registry_stats()}


def registry_stats() -> dict[str, Any]:
    """The lifecycle counters and histograms of this process's Prometheus registry."""
    operations: dict[str, dict[str, float]] = {}
    failures: dict[str, dict[str, float]] = {}
    latency: dict[str, dict[str, Any]] = {}
    sandboxes: dict[str, float] = {}
    commands: dict[str, float] = {}
    command_start: dict[str, Any] = {"buckets": {}, "count": 0.0, "sum": 0.0}
    for family in REGISTRY.collect():
        for sample in family.samples:
            labels = sample.labels
            if sample.name == "aenv_operations_total":
                operations.setdefault(labels["op"], {})[labels["outcome"]] = sample.value
            elif sample.name == "aenv_operation_failures_total":
                failures.setdefault(labels["op"], {})[labels["reason"]] = sample.value
            elif sample.name == "aenv_sandboxes":
                sandboxes[labels["state"]] = sample.value
            elif sample.name.startswith("aenv_operation_seconds_"):
                _histogram_sample(latency.setdefault(labels["op"], {"buckets": {}, "count": 0.0, "sum": 0.0}), sample)
            elif sample.name == "aenv_commands_total":
                commands[labels["outcome"]] = sample.value
            elif sample.name.startswith("aenv_command_start_seconds_"):
                _histogram_sample(command_start, sample)
    for hist in [*latency.values(), command_start]:
        hist["buckets"] = sorted(hist["buckets"].items(), key=lambda b: float(b[0]))
    return {
        "operations": operations,
        "failures": failures,
        "latency": latency,
        "sandboxes": sandboxes,
        "commands": commands,
        "commandStart": command_start,
    }


def _histogram_sample(hist: dict[str, Any], sample: Any) -> None:
    if sample.name.endswith("_bucket"):
        hist["buckets"][sample.labels["le"]] = sample.value
    elif sample.name.endswith("_count"):
        hist["count"] = sample.value
    elif sample.name.endswith("_sum"):
        hist["sum"] = sample.value


def artifacts(node: BuildHost) -> list[dict[str, Any]]:
    here = node_id(node)
    records: list[TemplateRecord | SnapshotRecord] = [
        *node.templates.values(),
        *(s for s in node.snapshots.values() if not s.ephemeral),
    ]
    return [_artifact(node, rec, here) for rec in records]


def _artifact(node: BuildHost, rec: TemplateRecord | SnapshotRecord, here: str) -> dict[str, Any]:
    local = all(item.path.exists() for item in node.artifacts.items_of(rec))
    logical = rec.commit.get("logical_bytes") if rec.committed_at else None
    return {
        "kind": "snapshot" if isinstance(rec, SnapshotRecord) else "template",
        "id": rec.id,
        "name": rec.name,
        "source": rec.sandbox_id if isinstance(rec, SnapshotRecord) else "",
        "createdAt": rfc3339(rec.created_at),
        "committed": bool(rec.committed_at),
        "sizeBytes": logical if isinstance(logical, int) else None,
        "cachedOn": [here] if local else [],
    }


def family(node: NodeService, sb: LiveSandbox) -> dict[str, Any]:
    """The sandbox's ancestors (those still on this node) and every descendant of its oldest one."""
    ancestors: list[str] = []
    current = sb
    while current.rec.parent_id and len(ancestors) < MAX_ANCESTORS:
        ancestors.append(current.rec.parent_id)
        parent = node.sandboxes.get(current.rec.parent_id)
        if parent is None:
            break
        current = parent
    root = current.id
    children: dict[str, list[LiveSandbox]] = {}
    for other in list(node.sandboxes.values()):
        if other.rec.parent_id:
            children.setdefault(other.rec.parent_id, []).append(other)
    members: list[dict[str, Any]] = []
    queue = [node.sandboxes[root]] if root in node.sandboxes else []
    while queue and len(members) < MAX_FAMILY:
        member = queue.pop(0)
        members.append(
            {
                "sandboxID": member.id,
                "parentID": member.rec.parent_id or None,
                "state": member.state.value,
                "startedAt": rfc3339(member.rec.started_at),
            }
        )
        queue += sorted(children.get(member.id, []), key=lambda c: c.rec.started_at)
    return {"sandboxID": sb.id, "ancestors": ancestors, "members": members, "truncated": bool(queue)}
