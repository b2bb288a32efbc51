"""Routes of the snapshot repository: its status on this node, and garbage collection."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from aenv.api.sandboxes import node_of
from aenv.errors import InvalidRequest
from aenv.node import housekeeping, metrics

router = APIRouter()


@router.get("/repository", summary="The snapshot repository and what is not committed yet")
async def status(request: Request) -> dict[str, Any]:
    node = node_of(request)
    cache = node.artifacts
    pending = metrics.pending_commits(node)
    durable = sum(1 for s in node.snapshots.values() if not s.ephemeral)
    return {
        "url": cache.repo.url if cache.repo is not None else None,
        "templates": len(node.templates),
        "snapshots": durable,
        "committed": len(node.templates) + durable - len(pending),
        "pending": pending,
        "cacheBytes": await housekeeping.cache_bytes(node),
        "cacheBudgetBytes": node.settings.layer_cache_mb * 2**20,
    }


@router.post("/repository/gc", summary="Delete chunks and artifacts no template or snapshot needs")
async def collect(request: Request) -> dict[str, Any]:
    node = node_of(request)
    if node.artifacts.repo is None:
        raise InvalidRequest("this node has no snapshot repository (AENV_REPO=none)")
    return await node.artifacts.gc_repository()
