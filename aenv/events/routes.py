"""E2B's lifecycle events and webhooks over HTTP, with its paths and shapes.

``GET /events/sandboxes`` and ``GET /events/sandboxes/{id}`` (offset, limit, orderAsc, types):
the team's events, newest first unless asked, a killed sandbox's included (for the retention); a
sandbox with none (another team's, or unknown) is a 404.
``POST|GET /events/webhooks`` and ``GET|PATCH|DELETE /events/webhooks/{id}``: the team's webhooks;
a webhook's signature secret is taken, used and never answered. Another team's webhook or
sandbox is one that does not exist.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.sandboxes import _body, json_body
from aenv.errors import InvalidRequest, NotFound, SandboxNotFound
from aenv.events import model
from aenv.events.service import Events
from aenv.teams.model import DEFAULT_TEAM, team_in_view

router = APIRouter()
MAX_WEBHOOKS = 100  # a team's


class NewWebhook(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=model.MAX_NAME)
    url: str = Field(..., min_length=1, max_length=model.MAX_URL)
    events: list[str] = Field(..., max_length=len(model.TYPES) * 4)
    signature_secret: str = Field(
        ..., alias="signatureSecret", min_length=model.MIN_SECRET, max_length=model.MAX_SECRET
    )
    enabled: bool = True


class WebhookPatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str | None = Field(None, min_length=1, max_length=model.MAX_NAME)
    url: str | None = Field(None, min_length=1, max_length=model.MAX_URL)
    events: list[str] | None = Field(None, max_length=len(model.TYPES) * 4)
    signature_secret: str | None = Field(
        None, alias="signatureSecret", min_length=model.MIN_SECRET, max_length=model.MAX_SECRET
    )
    enabled: bool | None = None


def events_of(request: Request) -> Events:
    events: Events = request.app.state.events
    return events


def _types(types: list[str] | None, what: str = "types") -> list[str]:
    chosen = list(dict.fromkeys(types or []))
    unknown = [t for t in chosen if t not in model.TYPES]
    if unknown:
        raise InvalidRequest(f"{what}: {unknown[0][:100]!r} is not an event type (one of {', '.join(model.TYPES)})")
    return chosen


async def _page(
    request: Request, sandbox_id: str | None, offset: int, limit: int, order_asc: bool, types: list[str] | None
) -> list[dict[str, Any]]:
    store = events_of(request).store
    found = await store.query(
        team_in_view(), sandbox_id=sandbox_id, types=_types(types), offset=offset, limit=limit, ascending=order_asc
    )
    return [e.api() for e in found]


@router.get("/events/sandboxes", summary="The team's sandboxes' lifecycle events")
async def team_events(
    request: Request,
    offset: int = Query(0, ge=0, le=1_000_000),
    limit: int = Query(10, ge=1, le=model.MAX_LIMIT),
    order_asc: bool = Query(False, alias="orderAsc"),
    types: list[str] | None = Query(None),
) -> list[dict[str, Any]]:
    return await _page(request, None, offset, limit, order_asc, types)


@router.get("/events/sandboxes/{event_sandbox_id}", summary="One sandbox's lifecycle events (killed ones too)")
async def sandbox_events(
    request: Request,
    event_sandbox_id: str,
    offset: int = Query(0, ge=0, le=1_000_000),
    limit: int = Query(10, ge=1, le=model.MAX_LIMIT),
    order_asc: bool = Query(False, alias="orderAsc"),
    types: list[str] | None = Query(None),
) -> list[dict[str, Any]]:
    if len(event_sandbox_id) > 128:
        raise InvalidRequest("sandboxID: longer than 128 characters")
    page = await _page(request, event_sandbox_id, offset, limit, order_asc, types)
    if not page:  # none at all (not the team's, never made, past the retention): not found
        known = await events_of(request).store.query(
            team_in_view(), sandbox_id=event_sandbox_id, types=(), offset=0, limit=1, ascending=True
        )
        if not known:
            raise SandboxNotFound(f"sandbox {event_sandbox_id} has no events", sandbox_id=event_sandbox_id)
    return page


# -- webhooks ---------------------------------------------------------------------------------------------
async def _hook(request: Request, webhook_id: str) -> model.Webhook:
    team = team_in_view()
    for hook in await events_of(request).store.webhooks():
        if hook.id == webhook_id and (team is None or hook.team == team):
            return hook
    raise NotFound(f"webhook {webhook_id[:100]!r} not found")


@router.post("/events/webhooks", status_code=201, summary="Register a webhook", openapi_extra=json_body(NewWebhook))
async def create_webhook(request: Request) -> JSONResponse:
    body: NewWebhook = await _body(request, NewWebhook)
    events = events_of(request)
    team = team_in_view() or DEFAULT_TEAM
    await events.rule.check_registration(body.url)
    if sum(h.team == team for h in await events.store.webhooks()) >= MAX_WEBHOOKS:
        raise InvalidRequest(f"team {team} has {MAX_WEBHOOKS} webhooks, the most it may; delete one first")
    hook = model.Webhook(
        id=model.new_id(),
        team=team,
        name=body.name,
        url=body.url,
        events=tuple(_types(body.events, "events")),
        secret=body.signature_secret,
        enabled=body.enabled,
        created_at=time.time(),
    )
    await events.add_webhook(hook)
    return JSONResponse(hook.api(), status_code=201)


@router.get("/events/webhooks", summary="The team's webhooks")
async def list_webhooks(request: Request) -> list[dict[str, Any]]:
    team = team_in_view()
    hooks = await events_of(request).store.webhooks()
    return [h.api() for h in sorted(hooks, key=lambda h: h.created_at) if team is None or h.team == team]


@router.get("/events/webhooks/{webhook_id}", summary="A webhook")
async def get_webhook(request: Request, webhook_id: str) -> dict[str, Any]:
    return (await _hook(request, webhook_id)).api()


@router.patch("/events/webhooks/{webhook_id}", summary="Change a webhook", openapi_extra=json_body(WebhookPatch))
async def patch_webhook(request: Request, webhook_id: str) -> dict[str, Any]:
    body: WebhookPatch = await _body(request, WebhookPatch)
    events = events_of(request)
    hook = await _hook(request, webhook_id)
    changes: dict[str, Any] = {}
    if body.url is not None:
        await events.rule.check_registration(body.url)
        changes["url"] = body.url
    if body.name is not None:
        changes["name"] = body.name
    if body.events is not None:
        changes["events"] = tuple(_types(body.events, "events"))
    if body.signature_secret is not None:
        changes["secret"] = body.signature_secret
    if body.enabled is not None:
        changes["enabled"] = body.enabled
    hook = hook.changed(**changes)
    await events.put_webhook(hook)
    return hook.api()


@router.delete("/events/webhooks/{webhook_id}", summary="Delete a webhook: no more deliveries")
async def delete_webhook(request: Request, webhook_id: str) -> Response:
    hook = await _hook(request, webhook_id)
    await events_of(request).delete_webhook(hook.id)
    return Response(status_code=200)
