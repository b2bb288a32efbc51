"""What a gateway says of a node (``GET /nodes``, ``GET /nodes/{id}``, an undrain's answer).

E2B's ``Node`` / ``NodeDetail`` where they apply (``nodeID`` and ``id``, ``status``, ``sandboxCount``,
``sandboxStartingCount``, ``createSuccesses``, ``createFails``, ``allocatedCPU``,
``allocatedMemoryMiB``, ``version``, ``cachedBuilds`` and its ``metrics``), then aenv's own,
camelCase as the rest of the API: from the node's directory entry, which the node rewrites every
second.
"""

from __future__ import annotations

import time

from aenv.api.schemas import rfc3339
from aenv.cluster.entries import NodeEntry

# The entry is rewritten every second: five beats missed (a node stopped, cut off from etcd, or
# starved) and it is unhealthy until its lease runs out and it leaves the list.
STALE_SECONDS = 5.0


def node_status(node: NodeEntry, now: float | None = None) -> str:
    """E2B's NodeStatus: ready, draining or unhealthy."""
    if node.updated_at and (now if now is not None else time.time()) - node.updated_at > STALE_SECONDS:
        return "unhealthy"
    return "draining" if node.draining else "ready"


def node_json(node: NodeEntry, now: float | None = None) -> dict[str, object]:
    cpus = node.cpu_count or 1.0
    return {
        "nodeID": node.node_id,
        "id": node.node_id,  # E2B's newer name for it
        "status": node_status(node, now),
        "sandboxCount": node.running,
        "sandboxStartingCount": node.starting,
        "createSuccesses": node.create_successes,
        "createFails": node.create_fails,
        "allocatedCPU": node.cpu_committed,
        "allocatedMemoryMiB": node.memory_committed_mb,
        "version": node.version,
        "cachedBuilds": list(node.cached),
        "metrics": {
            "allocatedCPU": node.cpu_committed,
            "allocatedMemoryBytes": node.memory_committed_mb * 2**20,
            "cpuCount": node.cpu_count,
            "cpuPercent": round(100 * node.cpu_used / cpus),
            "memoryTotalBytes": node.memory_mb * 2**20,
        },
        # aenv's own
        "address": node.address,
        "draining": node.draining,
        "sandboxPausedCount": node.paused,
        "maxSandboxes": node.max_sandboxes,
        "room": node.room,
        "cpuCount": node.cpu_count,
        "cpuUsed": node.cpu_used,
        "memoryMiB": node.memory_mb,
        "load1": node.load1,
        "driver": node.driver,
        "runtime": node.runtime,
        "startedAt": rfc3339(node.started_at),
        "updatedAt": rfc3339(node.updated_at),
    }
