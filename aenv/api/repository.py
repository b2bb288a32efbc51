"""Routes of the snapshot repository: its status on this node, and garbage collection."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from aenv.api.sandboxes import node_of

router = APIRouter()


@router.get("/repository", summary="The snapshot repository and what is not committed yet")
async def status(request: Request) -> dict[str, Any]:
    return await node_of(request).repository_status()


@router.post("/repository/gc", summary="Delete chunks and artifacts no template or snapshot needs")
async def collect(request: Request) -> dict[str, Any]:
    return await node_of(request).gc_repository()
