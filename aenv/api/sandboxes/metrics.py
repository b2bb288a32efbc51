"""A sandbox's resource usage, as E2B's metrics answer it: the latest sample of several sandboxes
(``/sandboxes/metrics``) and one sandbox's samples over time, bucketed as E2B buckets them.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request

from aenv.api import listing
from aenv.api.sandboxes.requests import node_of
from aenv.api.schemas import rfc3339
from aenv.errors import InvalidRequest
from aenv.node.service import Bucket, LiveSandbox, NodeService, Sample, in_range

router = APIRouter()


MAX_METRICS_SANDBOXES = 100  # E2B's bound on /sandboxes/metrics
LATEST_METRICS_TIME = 10_413_791_999  # E2B's (its metrics store's latest date, 2299-12-31)


@router.get("/sandboxes/metrics", summary="Latest resource usage of several sandboxes")
async def latest_metrics(request: Request, sandbox_ids: list[str] = Query(...)) -> dict[str, Any]:
    """E2B's ``SandboxesWithMetrics``: the latest sample of each sandbox named (comma-separated, at
    most 100); sandboxes unknown or not sampled yet are left out."""
    ids = [listing.short_sandbox_id(i) for value in sandbox_ids for i in value.split(",")]
    if len(set(ids)) > MAX_METRICS_SANDBOXES:
        raise InvalidRequest(f"Too many sandboxes requested, maximum is {MAX_METRICS_SANDBOXES}")
    node = node_of(request)
    out = {}
    for sandbox_id in dict.fromkeys(ids):
        sb = node.sandboxes.get(sandbox_id)
        history = node.usage_of(sandbox_id)
        latest = history.latest() if history is not None else None
        if sb is not None and latest is not None:
            out[sandbox_id] = _metric(node, sb, latest.ts, latest)
    return {"sandboxes": out}


@router.get("/sandboxes/{sandbox_id}/metrics", summary="Resource usage of a sandbox over time")
async def metrics(
    request: Request,
    sandbox_id: str,
    start: int | None = Query(None, ge=0, le=LATEST_METRICS_TIME),
    end: int | None = Query(None, ge=0, le=LATEST_METRICS_TIME),
) -> list[dict[str, Any]]:
    """The samples in ``[start, end]`` (Unix seconds, either open), bucketed as E2B buckets them."""
    if start is not None and end is not None and start > end:
        raise InvalidRequest("Invalid time range for metrics")
    node = node_of(request)
    sb = node.get(sandbox_id)
    history = node.usage_of(sb.id)
    return [_metric(node, sb, bucket.start, bucket) for bucket in in_range(history, start, end)]


def _metric(node: NodeService, sb: LiveSandbox, at: float, sample: Bucket | Sample) -> dict[str, Any]:
    """E2B's ``SandboxMetric``."""
    limits = node.limits_of(sb.rec)
    return {
        "timestamp": rfc3339(at),
        "timestampUnix": int(at),
        "cpuCount": max(1, int(limits.cpu_count)),
        "cpuUsedPct": round(sample.cpu_used_pct, 2),
        "memUsed": sample.mem_used,
        "memTotal": limits.memory_mb * 2**20,
        "memCache": sample.mem_cache,
        "diskUsed": sample.disk_used,
        "diskTotal": limits.disk_mb * 2**20,
    }
