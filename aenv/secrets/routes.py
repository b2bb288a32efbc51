"""E2B's secrets over HTTP: ``POST|GET /secrets`` and ``GET|POST|DELETE /secrets/{id or name}``
(POST: a new version). A value is taken and never answered, logged or kept in the clear; another
team's secret is one that does not exist. Answers carry ``Cache-Control: no-store``.
"""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.sandboxes import _body, json_body
from aenv.config import Settings
from aenv.errors import Conflict, InvalidRequest, NotFound
from aenv.node.service import NodeService
from aenv.secrets.model import ID_PREFIX, MAX_VALUE, Secret, check_metadata, check_name, check_value
from aenv.secrets.sealing import Sealer
from aenv.secrets.store import EtcdSecretStore, NameTaken, SecretStore, SqliteSecretStore
from aenv.teams.model import DEFAULT_TEAM, team_in_view

router = APIRouter()
MAX_SECRETS = 1000  # a team's
NO_STORE = {"cache-control": "no-store"}


class NewSecret(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(..., min_length=1, max_length=256)
    value: str = Field(..., min_length=1, max_length=MAX_VALUE)
    metadata: dict[str, str] | None = None


class SecretUpdate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    value: str = Field(..., min_length=1, max_length=MAX_VALUE)
    metadata: dict[str, str] | None = None


class Secrets:
    def __init__(self, node: NodeService) -> None:
        settings: Settings = node.settings
        self.settings = settings
        self.store: SecretStore = _store_of(settings)
        self._sealer: Sealer | None = None
        self.lock = asyncio.Lock()  # one change of a team's secrets at a time on this node

    async def start(self) -> None:
        await self.store.open()

    async def stop(self) -> None:
        await self.store.close()

    def sealer(self) -> Sealer:
        """The key, read (alone: made) at first use: a deployment without one answers 403."""
        if self._sealer is None:
            settings = self.settings
            path = settings.secrets_key_file or settings.data_dir / "secrets.key"
            self._sealer = Sealer.from_file(path, make=not settings.cluster)
        return self._sealer

    async def find(self, ref: str, team: str | None) -> Secret:
        ref = ref.strip()
        by_id = ref.startswith(ID_PREFIX)
        name = ref if by_id else ref.lower()
        for secret in await self.store.all(team):
            if (secret.id if by_id else secret.name) == name:
                return secret
        raise NotFound("Secret not found")

    async def value_of(self, team: str, name: str) -> str | None:
        """The current value of ``team``'s secret ``name`` (lower case), or None: for the node's
        egress (network.rules), which alone ever holds it, per request."""
        for secret in await self.store.all(team):
            if secret.name == name:
                return self.sealer().open(secret.sealed, secret.id, secret.team, secret.version)
        return None


def secrets_of(request: Request) -> Secrets:
    found: Secrets = request.app.state.secrets
    return found


def _answer(body: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(body, status_code=status, headers=NO_STORE)


@router.post(
    "/secrets",
    status_code=201,
    summary="Keep a secret (its value is never answered)",
    openapi_extra=json_body(NewSecret),
)
async def create_secret(request: Request) -> JSONResponse:
    body: NewSecret = await _body(request, NewSecret)
    secrets = secrets_of(request)
    team = team_in_view() or DEFAULT_TEAM
    name, value, metadata = check_name(body.name), check_value(body.value), check_metadata(body.metadata)
    sealer = secrets.sealer()
    async with secrets.lock:
        if len(await secrets.store.all(team)) >= MAX_SECRETS:
            raise Conflict(f"team {team} has {MAX_SECRETS} secrets, the most it may keep: delete one first")
        now = time.time()
        secret_id = Secret.new_id()
        secret = Secret(secret_id, name, team, 1, sealer.seal(value, secret_id, team, 1), metadata, now, now)
        try:
            await secrets.store.add(secret)
        except NameTaken:
            raise Conflict(f"a secret named {name!r} already exists") from None
    return _answer(secret.api(), 201)


@router.get("/secrets", summary="The team's secrets (never their values)")
async def list_secrets(
    request: Request,
    limit: int = Query(100, ge=1, le=100),
    next_token: str | None = Query(None, alias="nextToken", max_length=200),
) -> JSONResponse:
    found = await secrets_of(request).store.all(team_in_view())
    if next_token:
        try:
            after = base64.urlsafe_b64decode(next_token + "=" * (-len(next_token) % 4)).decode()
        except ValueError:
            raise InvalidRequest("Invalid next token") from None
        if not after.startswith(ID_PREFIX):
            raise InvalidRequest("Invalid next token")
        found = [s for s in found if s.id > after]
    page = found[:limit]
    headers = dict(NO_STORE)
    if len(found) > limit:
        headers["x-next-token"] = base64.urlsafe_b64encode(page[-1].id.encode()).decode().rstrip("=")
    return JSONResponse([s.api() for s in page], headers=headers)


@router.get("/secrets/{secret_ref}", summary="A secret, by id or name (never its value)")
async def get_secret(request: Request, secret_ref: str) -> JSONResponse:
    return _answer((await secrets_of(request).find(secret_ref, team_in_view())).api())


@router.post(
    "/secrets/{secret_ref}", summary="A secret's new value (its next version)", openapi_extra=json_body(SecretUpdate)
)
async def update_secret(request: Request, secret_ref: str) -> JSONResponse:
    body: SecretUpdate = await _body(request, SecretUpdate)
    secrets = secrets_of(request)
    value = check_value(body.value)
    metadata = check_metadata(body.metadata) if body.metadata is not None else None
    sealer = secrets.sealer()
    async with secrets.lock:
        secret = await secrets.find(secret_ref, team_in_view())
        version = secret.version + 1
        secret = secret.changed(
            version=version,
            sealed=sealer.seal(value, secret.id, secret.team, version),
            metadata=secret.metadata if metadata is None else metadata,
            updated_at=time.time(),
        )
        await secrets.store.put(secret)
    return _answer(secret.api())


@router.delete("/secrets/{secret_ref}", status_code=204, summary="Delete a secret")
async def delete_secret(request: Request, secret_ref: str) -> Response:
    secrets = secrets_of(request)
    async with secrets.lock:
        await secrets.store.remove(await secrets.find(secret_ref, team_in_view()))
    return Response(status_code=204, headers=NO_STORE)


def _store_of(settings: Settings) -> SecretStore:
    if settings.cluster:
        from aenv.cluster.store import cluster_store

        return EtcdSecretStore(cluster_store(settings))
    return SqliteSecretStore(settings.data_dir / "secrets.db")
