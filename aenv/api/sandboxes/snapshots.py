"""Snapshots: taking one of a running sandbox, and listing, reading and deleting them (E2B's
paginated list, newest first).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from aenv.api import listing
from aenv.api.sandboxes.requests import _body, json_body, node_of
from aenv.api.schemas import SnapshotBody, snapshot_json
from aenv.errors import InvalidRequest
from aenv.node.service import SnapshotRecord

router = APIRouter()


@router.post(
    "/sandboxes/{sandbox_id}/snapshots",
    status_code=201,
    summary="Snapshot a running sandbox",
    openapi_extra=json_body(SnapshotBody),
)
async def create_snapshot(request: Request, sandbox_id: str) -> JSONResponse:
    body: SnapshotBody = await _body(request, SnapshotBody)
    snap = await node_of(request).snapshot(sandbox_id, name=body.name, durable=body.durable)
    return JSONResponse(snapshot_json(snap), status_code=201)


@router.get("/snapshots", summary="List snapshots")
async def list_snapshots(
    request: Request,
    sandbox_id: str | None = Query(None, alias="sandboxID"),
    name: str | None = None,
    limit: int = Query(100, ge=1, le=100),
    next_token: str | None = Query(None, alias="nextToken"),
) -> Response:
    """E2B's list: newest first, keyset pages; ``name`` matches a snapshot's name or id."""
    snaps = [s for s in node_of(request).snapshots.values() if not s.ephemeral]
    if sandbox_id is not None:
        source = listing.short_sandbox_id(sandbox_id)
        snaps = [s for s in snaps if s.sandbox_id == source]
    if name is not None:
        if not name:
            raise InvalidRequest("Invalid name: the name is empty")
        snaps = [s for s in snaps if name in (s.id, s.name)]
    page, token = listing.SNAPSHOTS.page(snaps, _created, limit, next_token)
    headers = {"X-Next-Token": token} if token is not None else {}
    return JSONResponse([snapshot_json(s) for s in page], headers=headers)


def _created(snap: SnapshotRecord) -> listing.Position:
    return listing.Position(listing.micros(snap.created_at), snap.id)


@router.get("/snapshots/{snapshot_id}", summary="Get a snapshot")
async def get_snapshot(request: Request, snapshot_id: str) -> dict[str, Any]:
    return snapshot_json(node_of(request).find_snapshot(snapshot_id))


@router.delete("/snapshots/{snapshot_id}", status_code=204, summary="Delete a snapshot")
async def delete_snapshot(request: Request, snapshot_id: str) -> Response:
    await node_of(request).delete_snapshot(snapshot_id)
    return Response(status_code=204)
