"""Teams and API keys over HTTP, with E2B's paths and shapes where E2B has them.

E2B's: ``GET /teams`` (Team), ``GET|POST /api-keys`` and ``PATCH|DELETE /api-keys/{apiKeyID}``
(TeamAPIKey, CreatedTeamAPIKey), the admin's ``POST /admin/teams/{teamID}/api-keys`` and
``DELETE /admin/teams/{teamID}/api-keys/{apiKeyID}``, ``GET /teams/{teamID}/metrics``.
aenv's, for the admin key: ``POST /teams``, ``GET|PATCH|DELETE /teams/{teamID}`` (name, quotas).
A key manages its own team's keys; the admin key its team's (X-Team-ID names another).
An operator lists every team with the admin key (``GET /teams``, ``aenv teams list``) and every
team's sandboxes with the admin key and ``X-Team-ID: *`` (``aenv list --all-teams``). A key is
shown once, in the answer that made it.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.sandboxes import _body, json_body
from aenv.errors import Conflict, Forbidden, InvalidRequest, NotFound
from aenv.teams.model import DEFAULT_TEAM, MAX_NAME, Principal, Quotas, Team, check_name, current, rfc3339
from aenv.teams.registry import Teams

router = APIRouter()


class NewTeamAPIKey(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(..., max_length=MAX_NAME)


class NewTeam(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(..., max_length=MAX_NAME)
    team_id: str | None = Field(None, alias="teamID", max_length=63)
    quotas: dict[str, Any] | None = None


class TeamPatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str | None = Field(None, max_length=MAX_NAME)
    quotas: dict[str, Any] | None = None


def teams_of(request: Request) -> Teams:
    teams: Teams = request.app.state.teams
    return teams


def principal() -> Principal:
    who = current()
    return who if who is not None else Principal(DEFAULT_TEAM, admin=True)  # a node without a key


def admin_only(what: str) -> Principal:
    who = principal()
    if not who.admin:
        raise Forbidden(f"{what} needs the deployment's admin key")
    return who


async def visible_team(request: Request, team_id: str) -> Team:
    """A team the request may read: its own, or any for the admin key. Another team's id is
    answered as one that does not exist."""
    who = principal()
    team = await teams_of(request).find_team(team_id)
    if team is None or not (who.admin or who.team == team.id):
        raise NotFound(f"team {team_id[:64]!r} not found")
    return team


def team_json(team: Team, api_key: str = "") -> dict[str, Any]:
    """E2B's Team (``apiKey``: only in the answer that made the team; a key is shown once, and
    kept as a digest: no listing, the caller's own included, echoes one), plus aenv's quotas and
    creation time."""
    return {
        "teamID": team.id,
        "name": team.name,
        "apiKey": api_key,
        "isDefault": team.id == DEFAULT_TEAM,
        "createdAt": rfc3339(team.created_at),
        "quotas": team.quotas.wire(),
    }


@router.get("/teams", summary="The teams this key sees (E2B's Team; every team for the admin key)")
async def list_teams(request: Request) -> list[dict[str, Any]]:
    who = principal()
    teams = teams_of(request)
    if who.admin:
        if teams.store.shared:
            await teams.reload()
        shown = sorted(teams.teams.values(), key=lambda t: (t.id != DEFAULT_TEAM, t.created_at))
    else:
        team = await teams.find_team(who.team)
        shown = [team] if team is not None else []
    return [team_json(t) for t in shown]


@router.post(
    "/teams", status_code=201, summary="Make a team and its first API key (admin)", openapi_extra=json_body(NewTeam)
)
async def create_team(request: Request) -> JSONResponse:
    admin_only("making a team")
    body: NewTeam = await _body(request, NewTeam)
    quotas = Quotas.parse(body.quotas) if body.quotas is not None else Quotas()
    team, raw = await teams_of(request).create_team(check_name(body.name, "name"), quotas, body.team_id)
    return JSONResponse(team_json(team, raw), status_code=201)


@router.get("/teams/{team_id}", summary="A team: its name and quotas")
async def get_team(request: Request, team_id: str) -> dict[str, Any]:
    return team_json(await visible_team(request, team_id))


@router.patch(
    "/teams/{team_id}", summary="Rename a team or change its quotas (admin)", openapi_extra=json_body(TeamPatch)
)
async def patch_team(request: Request, team_id: str) -> dict[str, Any]:
    admin_only("changing a team")
    body: TeamPatch = await _body(request, TeamPatch)
    teams = teams_of(request)
    team = await visible_team(request, team_id)
    quotas = Quotas.parse(body.quotas, team.quotas) if body.quotas is not None else None
    name = check_name(body.name, "name") if body.name is not None else None
    return team_json(await teams.update_team(team.id, name=name, quotas=quotas))


@router.delete("/teams/{team_id}", status_code=204, summary="Delete a team with nothing left (admin)")
async def delete_team(request: Request, team_id: str) -> Response:
    admin_only("deleting a team")
    team = await visible_team(request, team_id)
    holds = await request.app.state.team_holdings(team.id)
    if holds:
        raise Conflict(f"team {team.id!r} still has {holds}: kill or delete them first")
    await teams_of(request).delete_team(team.id)
    return Response(status_code=204)


# -- API keys -------------------------------------------------------------------------------------------
@router.get("/api-keys", summary="The team's API keys (E2B's TeamAPIKey: masked, never the key)")
async def list_keys(request: Request) -> list[dict[str, Any]]:
    return [k.wire() for k in await teams_of(request).list_keys(principal().team)]


async def _create_key(request: Request, team_id: str) -> JSONResponse:
    body: NewTeamAPIKey = await _body(request, NewTeamAPIKey)
    raw, rec = await teams_of(request).create_key(team_id, check_name(body.name, "name"))
    return JSONResponse({**rec.wire(), "key": raw}, status_code=201)


@router.post(
    "/api-keys",
    status_code=201,
    summary="Make an API key of the team (shown once)",
    openapi_extra=json_body(NewTeamAPIKey),
)
async def create_key(request: Request) -> JSONResponse:
    return await _create_key(request, principal().team)


@router.patch("/api-keys/{api_key_id}", summary="Rename an API key", openapi_extra=json_body(NewTeamAPIKey))
async def rename_key(request: Request, api_key_id: str) -> dict[str, Any]:
    body: NewTeamAPIKey = await _body(request, NewTeamAPIKey)
    renamed = await teams_of(request).rename_key(principal().team, api_key_id, check_name(body.name, "name"))
    return renamed.wire()


@router.delete("/api-keys/{api_key_id}", status_code=204, summary="Delete an API key: it stops working")
async def delete_key(request: Request, api_key_id: str) -> Response:
    await teams_of(request).delete_key(principal().team, api_key_id)
    return Response(status_code=204)


@router.post(
    "/admin/teams/{team_id}/api-keys",
    status_code=201,
    summary="Make an API key of any team (admin)",
    openapi_extra=json_body(NewTeamAPIKey),
)
async def admin_create_key(request: Request, team_id: str) -> JSONResponse:
    admin_only("making another team's key")
    team = await visible_team(request, team_id)
    return await _create_key(request, team.id)


@router.delete(
    "/admin/teams/{team_id}/api-keys/{api_key_id}", status_code=204, summary="Delete any team's API key (admin)"
)
async def admin_delete_key(request: Request, team_id: str, api_key_id: str) -> Response:
    admin_only("deleting another team's key")
    team = await visible_team(request, team_id)
    await teams_of(request).delete_key(team.id, api_key_id)
    return Response(status_code=204)


@router.get("/teams/{team_id}/metrics", summary="The team's usage over time (E2B's TeamMetric, plus usage)")
async def team_metrics(
    request: Request,
    team_id: str,
    start: int | None = Query(None, ge=0, le=10_413_791_999),
    end: int | None = Query(None, ge=0, le=10_413_791_999),
) -> list[dict[str, Any]]:
    team = await visible_team(request, team_id)
    if start is not None and end is not None and start > end:
        raise InvalidRequest("Invalid time range for metrics")
    metrics = request.app.state.team_metrics
    result: list[dict[str, Any]] = await metrics(team.id, start, end)
    return result


@router.get("/teams/{team_id}/usage", summary="The team's usage so far: sandbox-, CPU-, memory and storage-seconds")
async def team_usage(request: Request, team_id: str) -> dict[str, Any]:
    team = await visible_team(request, team_id)
    result: dict[str, Any] = await request.app.state.team_usage(team.id)
    return result


@router.get("/teams/{team_id}/metrics/max", summary="The team's highest concurrent sandboxes or start rate (E2B's)")
async def team_metrics_max(
    request: Request,
    team_id: str,
    metric: str = Query(...),
    start: int | None = Query(None, ge=0, le=10_413_791_999),
    end: int | None = Query(None, ge=0, le=10_413_791_999),
) -> dict[str, Any]:
    """E2B's MaxTeamMetric: the highest ``concurrent_sandboxes`` or ``sandbox_start_rate`` in the
    range, and when (0 at the range's start when nothing was counted)."""
    field = {"concurrent_sandboxes": "concurrentSandboxes", "sandbox_start_rate": "sandboxStartRate"}.get(metric)
    if field is None:
        raise InvalidRequest("metric must be concurrent_sandboxes or sandbox_start_rate")
    team = await visible_team(request, team_id)
    if start is not None and end is not None and start > end:
        raise InvalidRequest("Invalid time range for metrics")
    points: list[dict[str, Any]] = await request.app.state.team_metrics(team.id, start, end)
    best = max(points, key=lambda p: p[field], default=None)
    at = best["timestampUnix"] if best is not None else (start or 0)
    return {"timestamp": rfc3339(at), "timestampUnix": at, "value": best[field] if best is not None else 0}
