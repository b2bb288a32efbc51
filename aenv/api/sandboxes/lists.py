"""Listing sandboxes: E2B's paginated ``/v2/sandboxes`` and the legacy ``/sandboxes``, with their
state, metadata, template and time filters (which a gateway's merged lists parse alike).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import unquote

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse

from aenv.api import listing
from aenv.api.sandboxes.requests import domain_of, node_of
from aenv.api.schemas import sandbox_detail
from aenv.errors import InvalidRequest, TemplateNotFound
from aenv.node.service import PUBLIC_STATE, LiveSandbox, NodeService

router = APIRouter()


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
    """A list's item: the sandbox's detail, and the node it runs on (AENV_NODE_ID, else the id kept
    in the data dir: every served node has one), as a gateway's lists say (not in E2B's ListedSandbox)."""
    item = sandbox_detail(node, sb, domain)
    if node.settings.node_id:
        item["nodeID"] = node.settings.node_id
    return item
