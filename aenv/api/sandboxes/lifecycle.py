"""One sandbox's lifecycle after its create: get, kill, its timeout, pause, resume and connect
(which may take a durable pause over from another node), and fork.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse

from aenv.api.sandboxes.requests import _body, domain_of, json_body, node_of, quotas_of
from aenv.api.schemas import ConnectBody, ForkBody, PauseBody, RefreshBody, Timeout, sandbox_detail, sandbox_json
from aenv.errors import InvalidRequest, WrongState, error_body
from aenv.node.service import OWNER_FULL_HEADER

router = APIRouter()


@router.get("/sandboxes/{sandbox_id}", summary="Get a sandbox")
async def get_sandbox(request: Request, sandbox_id: str) -> dict[str, Any]:
    node = node_of(request)
    detail = sandbox_detail(node, node.get(sandbox_id), domain_of(request))
    if node.settings.node_id:  # the node it runs on, as its list item and a gateway's answer say
        detail["nodeID"] = node.settings.node_id
    return detail


@router.delete("/sandboxes/{sandbox_id}", status_code=204, summary="Kill a sandbox")
async def kill_sandbox(request: Request, sandbox_id: str) -> Response:
    await node_of(request).kill(sandbox_id)
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/timeout",
    status_code=204,
    summary="Set the sandbox's timeout",
    openapi_extra=json_body(Timeout),
)
async def set_timeout(request: Request, sandbox_id: str) -> Response:
    body: Timeout = await _body(request, Timeout)
    await node_of(request).set_timeout(sandbox_id, body.timeout)
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/refreshes",
    status_code=204,
    summary="Extend the timeout",
    openapi_extra=json_body(RefreshBody),
)
async def refresh(request: Request, sandbox_id: str) -> Response:
    body: RefreshBody = await _body(request, RefreshBody)
    node = node_of(request)
    sb = node.get(sandbox_id)
    await node.set_timeout(sandbox_id, max(body.duration, int(sb.rec.end_at - time.time())))
    return Response(status_code=204)


@router.post(
    "/sandboxes/{sandbox_id}/pause",
    status_code=204,
    summary="Pause a sandbox (memory: false keeps only its file system; the resume reboots it)",
    openapi_extra=json_body(PauseBody),
)
async def pause(request: Request, sandbox_id: str) -> Response:
    body: PauseBody = await _body(request, PauseBody)
    async with quotas_of(request).pausing_one(sandbox_id):  # the team's paused quota
        await node_of(request).pause(sandbox_id, keep_memory=body.memory)
    return Response(status_code=204)


async def _connect(request: Request, sandbox_id: str) -> JSONResponse:
    node = node_of(request)
    body: ConnectBody = await _body(request, ConnectBody)
    rec, resumed = await node.resume(
        sandbox_id, timeout=body.timeout, memory=body.memory, owner_full=_owner_full(request)
    )
    return JSONResponse(sandbox_json(node, node.get(rec.id), domain_of(request)), status_code=201 if resumed else 200)


def _owner_full(request: Request) -> bool:
    """A gateway's word (OWNER_FULL_HEADER) that the sandbox's own node refused its resume for
    room: this node may take a durable pause over from a node that is up. Only where the cluster
    goes next: a taker claims only while the entry says durably paused, and the owner resumes only
    after taking that mark off, so whoever sends it gets one instance, wherever it runs."""
    return request.headers.get(OWNER_FULL_HEADER, "") == "1"


router.add_api_route(
    "/sandboxes/{sandbox_id}/connect",
    _connect,
    methods=["POST"],
    summary="Connect (resumes if paused)",
    openapi_extra=json_body(ConnectBody),
)
router.add_api_route(
    "/v2/sandboxes/{sandbox_id}/connect",
    _connect,
    methods=["POST"],
    summary="Connect (v2)",
    openapi_extra=json_body(ConnectBody),
)


@router.post(
    "/sandboxes/{sandbox_id}/resume",
    status_code=201,
    summary="Resume a paused sandbox (legacy)",
    openapi_extra=json_body(ConnectBody),
)
async def resume(request: Request, sandbox_id: str) -> JSONResponse:
    node = node_of(request)
    body: ConnectBody = await _body(request, ConnectBody)
    running = sandbox_id in node.sandboxes and node.get(sandbox_id).state.value == "running"
    if running:
        raise WrongState(f"sandbox {sandbox_id} is already running", sandbox_id=sandbox_id)
    # One this node does not hold may be a lost or draining node's durable pause: the resume takes it over.
    rec, _ = await node.resume(sandbox_id, timeout=body.timeout, memory=body.memory, owner_full=_owner_full(request))
    return JSONResponse(sandbox_json(node, node.get(rec.id), domain_of(request)), status_code=201)


@router.post(
    "/sandboxes/{sandbox_id}/fork",
    status_code=201,
    summary="Fork a running sandbox into N children",
    openapi_extra=json_body(ForkBody),
)
async def fork(request: Request, sandbox_id: str) -> JSONResponse:
    node = node_of(request)
    body: ForkBody = await _body(request, ForkBody)
    try:
        metadata = body.children_metadata(node.get(sandbox_id).rec.metadata)
    except ValueError as exc:
        raise InvalidRequest(f"invalid request body: {exc}") from None
    source = node.get(sandbox_id).rec
    if isinstance(body.count, int) and 1 <= body.count <= node.settings.max_fork:
        quotas_of(request).check_fork(source, body.count)  # the team's fork size and room
    clones = None
    if body.volumes == "clone" and source.volume_mounts and 1 <= body.count <= node.settings.max_fork:
        limit = request.app.state.teams.quotas(source.team).volumes
        clones = await request.app.state.volumes.fork_clones(source.volume_mounts, body.count, source.team, limit)
    results = await node.fork(
        sandbox_id, count=body.count, timeout=body.timeout, metadata=metadata, volume_clones=clones
    )
    if node.announce is not None:
        await node.announce([r.sandbox.id for r in results if r.sandbox is not None])
    out: list[dict[str, Any]] = []
    for r in results:
        if r.sandbox is not None:
            out.append({"sandbox": sandbox_json(node, node.get(r.sandbox.id), domain_of(request))})
        elif r.error is not None:
            out.append({"error": error_body(r.error)})
    return JSONResponse(out, status_code=201)
