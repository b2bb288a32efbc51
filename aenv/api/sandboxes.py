"""Control-plane routes: sandboxes, snapshots, fork, templates (E2B paths where E2B has the concept)."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import re
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any
from urllib.parse import unquote

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel

from aenv.api import listing
from aenv.api.proxy import PORT_PLACEHOLDER
from aenv.api.schemas import (
    ConnectBody,
    ForkBody,
    ImageTemplate,
    NetworkUpdate,
    NewSandbox,
    PauseBody,
    RefreshBody,
    SnapshotBody,
    TemplatePatch,
    Timeout,
    WarmPoolSize,
    rfc3339,
    sandbox_detail,
    sandbox_json,
    snapshot_json,
    template_json,
)
from aenv.errors import (
    AenvError,
    Forbidden,
    InvalidRequest,
    SnapshotNotFound,
    TemplateNotFound,
    WrongState,
    error_body,
    snippet,
)
from aenv.node.service import (
    OWNER_FULL_HEADER,
    PUBLIC_STATE,
    Bucket,
    BuildHost,
    LiveSandbox,
    NodeService,
    Sample,
    SandboxSpec,
    SnapshotRecord,
    TemplateRecord,
    create_id_of,
    in_range,
)
from aenv.storage.confined import View, remove_tree
from aenv.teams import guard as team_guard
from aenv.teams.quotas import NodeQuotas
from aenv.templates import build, catalog, image_sources, images, uploads
from aenv.templates.catalog import TEMPLATE_NAME

router = APIRouter()
MAX_DOCKERFILE = 1 << 20
MAX_METRICS_SANDBOXES = 100  # E2B's bound on /sandboxes/metrics
LATEST_METRICS_TIME = 10_413_791_999  # E2B's (its metrics store's latest date, 2299-12-31)


def node_of(request: Request) -> NodeService:
    """The node as the request's team sees it (aenv/teams/guard.py)."""
    return team_guard.view_of(request.app.state.node)


def build_host_of(request: Request) -> BuildHost:
    """The node, for the routes that build or edit templates on it (as the request's team sees it)."""
    node: BuildHost = team_guard.view_of(request.app.state.node)  # type: ignore[assignment]
    return node


def quotas_of(request: Request) -> NodeQuotas:
    quotas: NodeQuotas = request.app.state.quotas
    return quotas


def domain_of(request: Request) -> str | None:
    node = node_of(request)
    return node.settings.domain


# Bodies are read by the routes themselves (``_body``: an empty body is ``{}``, errors are 400s); the
# OpenAPI document still describes them, with these models' schemas under components.
BODY_MODELS: dict[str, type[BaseModel]] = {}
BUILD_CONTEXT = {"requestBody": {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route whose JSON body is ``model``."""
    BODY_MODELS[model.__name__] = model
    required = any(field.is_required() for field in model.model_fields.values())
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(openapi: dict[str, Any]) -> None:
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for name, model in BODY_MODELS.items():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema


def declared_length(request: Request) -> int | None:
    """The body's Content-Length (None for a chunked body; the server has checked its syntax)."""
    value = request.headers.get("content-length")
    return int(value) if value is not None else None


async def _body(request: Request, model: type[Any]) -> Any:
    """The request's JSON body as ``model``; an empty body is ``{}`` (required fields still are)."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValueError as exc:
        raise InvalidRequest(_first_error(exc)) from exc


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        items = errors()
        if items:
            first = items[0]
            # a location may be a key the client sent: quoted short and printable
            where = ".".join(snippet(str(p), 64) for p in first.get("loc", ()))
            msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            return f"invalid request body: {where + ': ' if where else ''}{msg}"
    return f"invalid request body: {exc}"


def create_source(node: BuildHost, body: NewSandbox) -> AbstractAsyncContextManager[str]:
    """The template or snapshot a create restores: ``templateID`` as it names one, or the template
    made from the image it (or ``image``) names, built first if need be (image_sources); held
    (never evicted) until the block ends."""
    if body.image is None:
        return image_sources.held_source(node, body.template_id)
    if "template_id" in body.model_fields_set:
        raise InvalidRequest("invalid request body: give templateID or image, not both")
    return image_sources.held_source(node, body.image, image=True)


async def _create(request: Request) -> JSONResponse:
    node = node_of(request)
    body: NewSandbox = await _body(request, NewSandbox)
    auto_pause = bool(body.auto_pause)
    if body.lifecycle is not None and body.lifecycle.on_timeout is not None:
        if body.lifecycle.on_timeout not in ("pause", "kill"):
            raise InvalidRequest("lifecycle.onTimeout must be 'pause' or 'kill'")
        auto_pause = body.lifecycle.on_timeout == "pause"
    auto_resume = False
    if isinstance(body.auto_resume, bool):
        auto_resume = body.auto_resume
    elif body.auto_resume is not None:
        auto_resume = body.auto_resume.on
    if body.lifecycle is not None and body.lifecycle.auto_resume is not None:
        auto_resume = body.lifecycle.auto_resume
    auto_pause_memory = body.auto_pause_memory
    if auto_pause_memory is None and body.lifecycle is not None:
        auto_pause_memory = body.lifecycle.keep_memory
    unbuilt_features(body)
    secure = body.secure is not False
    limits = body.limits.model_dump(exclude_none=True) if body.limits else None
    network = egress_rules(body.network, known=CREATE_NETWORK_FIELDS)
    public_traffic, mask_request_host = ingress_options(body.network, secure=secure)

    spec = SandboxSpec(
        timeout=body.timeout,
        metadata=dict(body.metadata or {}),
        env_vars=dict(body.env_vars or {}),
        auto_pause=auto_pause,
        auto_resume=auto_resume,
        auto_pause_memory=auto_pause_memory is not False,
        limits=limits or {},
        allow_internet_access=body.allow_internet_access,
        network=network or {},
        secure=secure,
        public_traffic=public_traffic,
        mask_request_host=mask_request_host,
        grace=body.grace or 0,
    )

    async def create() -> str:
        async with create_source(build_host_of(request), body) as source:
            return await created(source)

    async def created(source: str) -> str:
        return (await node.create(source, spec)).id

    # A create sent again with its id (a gateway whose connection broke, an SDK's retry with its
    # Idempotency-Key) gets the first one's sandbox.
    create_id = create_id_of(request.headers)
    sandbox_id = await quotas_of(request).admitted(  # the team's rate, and ?wait for room
        request, lambda: node.create_ids.once(create_id, create) if create_id is not None else create()
    )
    if node.announce is not None:
        await node.announce([sandbox_id])
    return JSONResponse(sandbox_json(node, node.get(sandbox_id), domain_of(request)), status_code=201)


router.add_api_route(
    "/sandboxes",
    _create,
    methods=["POST"],
    status_code=201,
    summary="Create a sandbox",
    openapi_extra=json_body(NewSandbox),
)
router.add_api_route(
    "/v2/sandboxes",
    _create,
    methods=["POST"],
    status_code=201,
    summary="Create a sandbox (v2)",
    openapi_extra=json_body(NewSandbox),
)


def parse_metadata_query(raw: str | None) -> dict[str, str]:
    """E2B's nested encoding: unquote the value, split on & and =, unquote each part."""
    if not raw:
        return {}
    out: dict[str, str] = {}
    for pair in unquote(raw).split("&"):
        if not pair:
            continue
        key, sep, value = pair.partition("=")
        if not sep:
            raise InvalidRequest(f"metadata filter '{pair}' is not key=value")
        out[unquote(key)] = unquote(value)
    return out


def parse_states(values: list[str]) -> set[str] | None:
    states = {s.strip() for v in values for s in v.split(",") if s.strip()}
    allowed = {"running", "paused", "creating", "pausing", "resuming", "snapshotting", "forking", "killing"}
    bad = states - allowed
    if bad:
        raise InvalidRequest(f"unknown state filter(s): {', '.join(sorted(bad))}")
    return states or None


@router.get("/v2/sandboxes", summary="List sandboxes (paginated)")
async def list_v2(
    request: Request,
    state: list[str] = Query(default=[]),
    metadata: str | None = None,
    limit: int = Query(100, ge=1, le=100),
    next_token: str | None = Query(None, alias="nextToken"),
    template: str | None = None,
    order: str = "desc",
    started_after: str | None = Query(None, alias="startedAfter"),
) -> Response:
    """E2B's list: newest first (or ``order=asc``), keyset pages, ``startedAfter`` inclusive."""
    node = node_of(request)
    if order not in ("asc", "desc"):
        raise InvalidRequest(f"Invalid order parameter: unknown order '{order[:32]}'")
    pages = listing.SANDBOXES_OLDEST_FIRST if order == "asc" else listing.SANDBOXES_NEWEST_FIRST
    states = parse_states(state)
    items = node.list(states=states, metadata=parse_metadata_query(metadata))
    if started_after is not None:
        bound = listing.parse_time(started_after, "startedAfter")
        items = [sb for sb in items if listing.micros(sb.rec.started_at) >= bound]
    if template:
        wanted = _template_name(node, template)
        items = [sb for sb in items if sb.rec.template_id == wanted]
    headers = {}
    if states is None or "running" in states:
        headers["X-Total-Running"] = str(sum(1 for sb in items if PUBLIC_STATE[sb.state] == "running"))
    page, token = pages.page(items, _started, limit, next_token)
    if token is not None:
        headers["X-Next-Token"] = token
    body = [listed_item(node, sb, domain_of(request)) for sb in page]
    return JSONResponse(body, headers=headers)


def _started(sb: LiveSandbox) -> listing.Position:
    return listing.Position(listing.micros(sb.rec.started_at), sb.id)


def _template_name(node: NodeService, ref: str) -> str:
    """What sandboxes of the template ``ref`` (an id, name or alias) record as their template."""
    try:
        return node.find_template(ref).name
    except TemplateNotFound:
        return ref


@router.get("/sandboxes", summary="List sandboxes (legacy: running only)")
async def list_v1(request: Request, metadata: str | None = None) -> list[dict[str, Any]]:
    node = node_of(request)
    items = node.list(states={"running"}, metadata=parse_metadata_query(metadata))
    return [listed_item(node, sb, domain_of(request)) for sb in items]


def listed_item(node: NodeService, sb: LiveSandbox, domain: str | None) -> dict[str, Any]:
    """A list's item: the sandbox's detail, and the node it runs on when the node has an id
    (AENV_NODE_ID; a cluster's nodes do), as a gateway's lists say (not in E2B's ListedSandbox)."""
    item = sandbox_detail(node, sb, domain)
    if node.settings.node_id:
        item["nodeID"] = node.settings.node_id
    return item


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


@router.get("/sandboxes/{sandbox_id}", summary="Get a sandbox")
async def get_sandbox(request: Request, sandbox_id: str) -> dict[str, Any]:
    node = node_of(request)
    return sandbox_detail(node, node.get(sandbox_id), domain_of(request))


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


# What E2B's SandboxNetworkConfig has (the SDKs send each only when it is set).
CREATE_NETWORK_FIELDS = frozenset(
    {"allowOut", "denyOut", "allowPublicTraffic", "maskRequestHost", "rules", "egressProxy", "dnsServers", "httpsPorts"}
)


def unbuilt_features(body: NewSandbox) -> None:
    """E2B features aenv does not have, refused as E2B refuses them to a team without them (a
    sandbox without its volumes or workload tokens is not the one asked for); empty is fine."""
    if body.volume_mounts:
        raise InvalidRequest("Volume mounts are not enabled.")
    if body.iam is not None and body.iam.tokens:
        raise InvalidRequest("Sandbox IAM workload tokens are not available for your team.")


def egress_rules(
    network: Any, *, field: str = "network.egressProxy", known: frozenset[str] | None = None
) -> dict[str, Any]:
    """The part of E2B's `network` object that aenv enforces (allowOut, denyOut).

    Transform rules and an egress proxy are refused as E2B refuses them to a team without them
    (docs/architecture.md, Egress, says why aenv has neither); ``field`` names the proxy's field
    as E2B's message for that endpoint does. With ``known``, any other field is a 400."""
    if network is None:
        return {}
    if not isinstance(network, dict):
        raise InvalidRequest("network must be an object")
    unknown = sorted(set(network) - known) if known is not None else []
    if unknown:
        raise InvalidRequest(f"invalid request body: network.{snippet(unknown[0], 64)}: Extra inputs are not permitted")
    _dns_servers(network.get("dnsServers"))
    if network.get("httpsPorts"):
        # a port proxy that speaks TLS to the sandbox's server: not built (the proxy speaks HTTP)
        raise InvalidRequest("HTTPS sandbox ports (network.httpsPorts) are not available for your team.")
    if network.get("rules") is not None:
        raise InvalidRequest("Network transform rules are not available for your team.")
    if network.get("egressProxy") is not None:
        raise Forbidden(f"Egress proxy ({field}) is not enabled for this team.")
    out = {}
    for key in ("allowOut", "denyOut"):
        value = network.get(key)
        if value is None:
            continue
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise InvalidRequest(f"network.{key} must be a list of strings")
        out[key] = value
    return out


MAX_DNS_SERVERS = 16


def _dns_servers(servers: Any) -> None:
    """E2B's ``dnsServers`` (name servers a sandbox may reach when ``allowOut`` names a domain),
    checked as E2B checks them. Nothing to open here: a sandbox's names are looked up by its node."""
    if servers is None:
        return
    if not isinstance(servers, list) or len(servers) > MAX_DNS_SERVERS:
        raise InvalidRequest(f"network.dnsServers must be a list of at most {MAX_DNS_SERVERS} IPv4 addresses")
    for server in servers:
        try:
            if not isinstance(server, str):
                raise ValueError(server)  # IPv4Address takes an int too
            ipaddress.IPv4Address(server)
        except ValueError:
            shown = snippet(server, 64) if isinstance(server, str) else type(server).__name__
            raise InvalidRequest(f"network.dnsServers: {shown!r} is not an IPv4 address") from None


MAX_MASK_REQUEST_HOST = 255
# What may stand in the Host header a port receives: a name or an [IPv6] literal, and a port.
MASK_REQUEST_HOST = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def ingress_options(network: Any, *, secure: bool) -> tuple[bool, str]:
    """(public traffic, mask request host) from E2B's `network` object, checked as E2B checks them."""
    if not isinstance(network, dict):
        return True, ""
    public = network.get("allowPublicTraffic", True)
    if public is None:
        public = True
    if not isinstance(public, bool):
        raise InvalidRequest("network.allowPublicTraffic must be a boolean")
    mask = network.get("maskRequestHost")
    if mask is None:
        mask = ""
    if not isinstance(mask, str):
        raise InvalidRequest("network.maskRequestHost must be a string")
    if not mask.isascii():
        raise InvalidRequest(f"mask request host '{snippet(mask)}' is not ASCII. Please use ASCII characters only.")
    # ${PORT} becomes a port number on each request; what it makes must be a host, whatever the port
    if mask and (
        len(mask) > MAX_MASK_REQUEST_HOST or not MASK_REQUEST_HOST.fullmatch(mask.replace(PORT_PLACEHOLDER, "1"))
    ):
        raise InvalidRequest(f"mask request host is not valid: {snippet(mask)}")
    if not public and not secure:
        raise InvalidRequest(
            "You cannot create a sandbox without public access unless you enable secure envd access via 'secure' flag."
        )
    return public, mask


@router.put(
    "/sandboxes/{sandbox_id}/network",
    status_code=204,
    summary="Replace the sandbox's egress rules",
    openapi_extra=json_body(NetworkUpdate),
)
async def update_network(request: Request, sandbox_id: str) -> Response:
    body: NetworkUpdate = await _body(request, NetworkUpdate)
    update = body.model_dump(by_alias=True)
    # E2B's update has no ingress fields and would ignore them; refused instead, so nobody believes
    # a running sandbox's ports were made private (or its Host masked) when they were not.
    if update.get("allowPublicTraffic") is False or update.get("maskRequestHost") is not None:
        raise InvalidRequest("network.allowPublicTraffic and network.maskRequestHost are set when a sandbox is created")
    internet = update.pop("allow_internet_access", None)
    rules = egress_rules(update, field="egressProxy")
    # The update replaces the whole egress configuration, internet access included: left out, it
    # is the default again (Harbor's `{}` for a public phase after a no-network one).
    node = node_of(request)
    await node.set_network(sandbox_id, rules, node.settings.internet_by_default if internet is None else internet)
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
    if isinstance(body.count, int) and 1 <= body.count <= node.settings.max_fork:
        quotas_of(request).check_fork(node.get(sandbox_id).rec, body.count)  # the team's fork size and room
    results = await node.fork(sandbox_id, count=body.count, timeout=body.timeout, metadata=metadata)
    if node.announce is not None:
        await node.announce([r.sandbox.id for r in results if r.sandbox is not None])
    out: list[dict[str, Any]] = []
    for r in results:
        if r.sandbox is not None:
            out.append({"sandbox": sandbox_json(node, node.get(r.sandbox.id), domain_of(request))})
        elif r.error is not None:
            out.append({"error": error_body(r.error)})
    return JSONResponse(out, status_code=201)


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


@router.get("/templates", summary="List templates")
async def list_templates(request: Request) -> list[dict[str, Any]]:
    node = node_of(request)
    return [template_json(t, node) for t in sorted(node.templates.values(), key=lambda t: t.created_at)]


@router.post(
    "/templates/from-image",
    status_code=201,
    summary="Make a template from an OCI image",
    openapi_extra=json_body(ImageTemplate),
)
async def template_from_image(request: Request) -> Response:
    """The template (201) once pulled and committed; with ``Accept: application/x-ndjson``, NDJSON
    lines as the build's: ``{"log"}``, ``{"progress": {layer, layers, done, total}}`` as each
    layer downloads, then ``{"template"}`` or ``{"error"}``."""
    body: ImageTemplate = await _body(request, ImageTemplate)
    team_guard.claim_template_name(request.app.state.node, body.name)
    node = build_host_of(request)
    login = (body.username, body.password or "") if body.username else None
    if "application/x-ndjson" in request.headers.get("accept", ""):

        async def pulled(emit: Emit) -> dict[str, Any]:
            def progress(layer: int, layers: int, done: int, total: int) -> None:
                emit({"progress": {"layer": layer, "layers": layers, "done": done, "total": total}})

            rec = await images.template_from_image(
                node, body.name, body.image, login=login, on_log=lambda line: emit({"log": line}), on_progress=progress
            )
            return {"template": template_json(rec, node)}

        return _streamed_job(node, pulled)
    # A shielded task: the pull and commit finish even if the client gives up waiting.
    task = asyncio.ensure_future(images.template_from_image(node, body.name, body.image, login=login))
    rec = await asyncio.shield(task)
    return JSONResponse(template_json(rec, node), status_code=201)


Emit = Callable[[dict[str, Any]], None]


def _streamed_job(
    node: BuildHost, work: Callable[[Emit], Awaitable[dict[str, Any]]], cleanup: Callable[[], None] | None = None
) -> StreamingResponse:
    """Run ``work`` on the node (it finishes even if the client goes away), streaming the lines it
    emits as NDJSON, then the line it returns (``{"template": ...}``) or ``{"error": {code,
    message, step?, output?}}``."""
    lines: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

    async def run() -> None:
        try:
            lines.put_nowait(await work(lines.put_nowait))
        except AenvError as exc:
            body = error_body(exc)
            body.update({k: getattr(exc, k) for k in ("step", "output") if hasattr(exc, k)})
            lines.put_nowait({"error": body})
        except Exception as exc:  # noqa: BLE001 - reported to the client, then logged by the task
            lines.put_nowait({"error": {"code": 500, "message": f"failed: {exc}"}})
            raise
        finally:
            lines.put_nowait(None)
            if cleanup is not None:
                cleanup()

    node.spawn(run())

    async def stream() -> AsyncIterator[bytes]:
        while (line := await lines.get()) is not None:
            yield (json.dumps(line) + "\n").encode()

    return StreamingResponse(stream(), media_type="application/x-ndjson")


@router.post(
    "/templates/build",
    summary="Build a template from a Dockerfile (streams NDJSON build logs)",
    openapi_extra=BUILD_CONTEXT,
)
async def build_template(
    request: Request,
    name: str = Query(..., pattern=f"^{TEMPLATE_NAME}$"),
    dockerfile: str = Query("Dockerfile"),
    build_arg: list[str] = Query([], alias="buildArg"),
) -> StreamingResponse:
    """The body is the build context as a tar (gzip or not). Each response line is
    ``{"log": ...}``, then ``{"template": ...}`` or ``{"error": {code, message, step?, output?}}``."""
    team_guard.claim_template_name(request.app.state.node, name)  # never another team's template
    node = build_host_of(request)
    args = dict(arg.split("=", 1) for arg in build_arg if "=" in arg)
    limits = node.uploads.limits
    workdir = Path(tempfile.mkdtemp(prefix="aenv-build-", dir=node.files.tmp))
    try:
        raw = workdir / "context.tar"
        await limits.receive(request.stream(), raw, declared_length(request), "the build context")
        context = workdir / "context"
        await asyncio.to_thread(uploads.unpack_context, raw, context, limits)
        raw.unlink()  # the build reads the unpacked context only
        recipe = View([context]).read(dockerfile, limit=MAX_DOCKERFILE)  # links resolve inside the context
        if recipe is None:
            raise InvalidRequest(f"no {dockerfile} in the build context")
        text = recipe.decode(errors="replace")
    except BaseException:
        remove_tree(workdir, ignore_errors=True)
        raise

    async def built(emit: Emit) -> dict[str, Any]:
        log = lambda line: emit({"log": line})  # noqa: E731
        rec = await build.build(node, name=name, dockerfile=text, context=context, build_args=args, on_log=log)
        return {"template": template_json(rec, node)}

    return _streamed_job(node, built, cleanup=lambda: remove_tree(workdir, ignore_errors=True))


@router.post("/templates/{template_id}/fetch", summary="Bring a template's or snapshot's files into this node's cache")
async def fetch_template(request: Request, template_id: str) -> Response:
    """Fetch from the repository what of a committed template or snapshot this node lacks, ahead
    of its first create. The answer: ``{"template" | "snapshot": ..., "fetchedBytes": N}``; with
    ``Accept: application/x-ndjson``, ``{"progress": {done, total}}`` lines (bytes) before it."""
    node = build_host_of(request)
    try:
        rec: TemplateRecord | SnapshotRecord = node.find_snapshot(template_id)
    except SnapshotNotFound:
        rec = node.find_template(template_id)

    async def fetched(emit: Emit) -> dict[str, Any]:
        progress = lambda done, total: emit({"progress": {"done": done, "total": total}})  # noqa: E731
        size = await node.artifacts.prefetch(rec, on_progress=progress)
        if isinstance(rec, SnapshotRecord):
            return {"snapshot": snapshot_json(rec), "fetchedBytes": size}
        return {"template": template_json(rec, node), "fetchedBytes": size}

    if "application/x-ndjson" in request.headers.get("accept", ""):
        return _streamed_job(node, fetched)
    return JSONResponse(await fetched(lambda line: None))


@router.delete("/templates/{template_id:path}", status_code=204, summary="Delete a template or a snapshot")
async def delete_template(request: Request, template_id: str, force: bool = False) -> Response:
    """E2B's SDKs delete snapshots here too (``Sandbox.delete_snapshot``)."""
    node = build_host_of(request)
    try:
        await node.delete_snapshot(template_id)
    except SnapshotNotFound:
        await catalog.delete_template(node, template_id, force=force)
    return Response(status_code=204)


@router.patch(
    "/templates/{template_id}",
    summary="Replace a template's aliases (name:tag for tags)",
    openapi_extra=json_body(TemplatePatch),
)
async def patch_template(request: Request, template_id: str) -> dict[str, Any]:
    body: TemplatePatch = await _body(request, TemplatePatch)
    node = build_host_of(request)
    template = node.find_template(template_id)
    if body.aliases is not None:
        for alias in body.aliases:
            team_guard.claim_template_name(request.app.state.node, alias)
        template = await catalog.set_aliases(node, template_id, body.aliases)
    if body.public is not None and body.public != template.public:  # E2B's TemplateUpdateRequest
        template.public = body.public
        await node.save_template(template)
    return template_json(template, node)


@router.get("/templates/{template_id}/warm-pool", summary="A template's warm pool")
async def get_warm_pool(request: Request, template_id: str) -> dict[str, Any]:
    return node_of(request).warm_pool(template_id)


@router.put(
    "/templates/{template_id}/warm-pool",
    summary="Set how many idle sandboxes a template's warm pool keeps at most",
    openapi_extra=json_body(WarmPoolSize),
)
async def set_warm_pool(request: Request, template_id: str) -> dict[str, Any]:
    body: WarmPoolSize = await _body(request, WarmPoolSize)
    return await node_of(request).set_warm_pool(template_id, body.size)


@router.get("/templates/{template_id}", summary="Get a template")
async def get_template(request: Request, template_id: str) -> dict[str, Any]:
    node = node_of(request)
    return template_json(node.find_template(template_id), node)
