"""E2B's volumes over HTTP: ``POST|GET /volumes``, ``GET|DELETE /volumes/{id}`` with the API key,
and the content API under ``/volumecontent/{id}/`` (``dir``, ``path``, ``file``) with the volume's
own bearer token (what E2B's SDK sends; the team's API key works too). Another team's volume, and
a token of another volume, are answered as a volume that does not exist.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import os
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.sandboxes import _body, json_body
from aenv.errors import InsufficientStorage, NotFound, PayloadTooLarge
from aenv.storage.space import ensure_space, headroom
from aenv.teams.model import DEFAULT_TEAM, current, team_in_view
from aenv.volumes.files import CHUNK, USER
from aenv.volumes.model import Volume
from aenv.volumes.service import Volumes

router = APIRouter()
BEARER = "bearer "


class NewVolume(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(..., min_length=1, max_length=128)


class EntryPatch(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    uid: int | None = Field(None, ge=0, le=2**31 - 1)
    gid: int | None = Field(None, ge=0, le=2**31 - 1)
    mode: int | None = Field(None, ge=0, le=0o7777)


def volumes_of(request: Request) -> Volumes:
    volumes: Volumes = request.app.state.volumes
    return volumes


# -- the control plane --------------------------------------------------------------------------------------
@router.post("/volumes", status_code=201, summary="Make a volume", openapi_extra=json_body(NewVolume))
async def create_volume(request: Request) -> JSONResponse:
    body: NewVolume = await _body(request, NewVolume)
    team = team_in_view() or DEFAULT_TEAM
    limit = request.app.state.teams.quotas(team).volumes
    volumes = volumes_of(request)
    volume = await volumes.create(body.name, team, limit)
    return JSONResponse(_with_domain(volumes, volume.api()), status_code=201)


@router.get("/volumes", summary="The team's volumes")
async def list_volumes(request: Request) -> list[dict[str, Any]]:
    return [v.api(with_token=False) for v in await volumes_of(request).visible(team_in_view())]


@router.get("/volumes/{volume_id}", summary="A volume, with its content token")
async def get_volume(request: Request, volume_id: str) -> dict[str, Any]:
    volumes = volumes_of(request)
    return _with_domain(volumes, (await _by_id(volumes, volume_id, team_in_view())).api())


@router.delete("/volumes/{volume_id}", status_code=204, summary="Delete a volume and what it holds")
async def delete_volume(request: Request, volume_id: str) -> Response:
    volumes = volumes_of(request)
    await volumes.delete(await _by_id(volumes, volume_id, team_in_view()))
    return Response(status_code=204)


def _with_domain(volumes: Volumes, body: dict[str, Any]) -> dict[str, Any]:
    """E2B's ``domain``: where the SDK sends content calls (``https://api.<domain>``) when
    ``E2B_VOLUME_API_URL`` is not set, on a node that has one (AENV_DOMAIN)."""
    domain = volumes.node.settings.domain
    return body | {"domain": domain} if domain else body


async def _by_id(volumes: Volumes, volume_id: str, team: str | None) -> Volume:
    volume = await volumes.store.get(volume_id) if len(volume_id) <= 64 else None
    if volume is None or (team is not None and volume.team != team):
        raise NotFound(f"volume {volume_id[:140]!r} not found")
    return volume


# -- the content API ------------------------------------------------------------------------------------------
async def _content(request: Request, volume_id: str) -> tuple[Volumes, Volume]:
    """The volume a content request may reach: its bearer token's, or the API key's team's."""
    volumes = volumes_of(request)
    volume = await volumes.store.get(volume_id) if len(volume_id) <= 64 else None
    auth = request.headers.get("authorization", "")
    if volume is not None and auth[: len(BEARER)].lower() == BEARER:
        if hmac.compare_digest(auth[len(BEARER) :].strip().encode(), volume.token.encode()):
            return volumes, volume
    elif volume is not None and current() is not None:
        team = team_in_view()
        if team is None or volume.team == team:
            return volumes, volume
    raise NotFound(f"volume {volume_id[:140]!r} not found")


def _owner(uid: int | None, gid: int | None) -> tuple[int, int]:
    return (USER[0] if uid is None else uid, USER[1] if gid is None else gid)


MAX_ID = 2**31 - 1


@router.get("/volumecontent/{volume_id}/dir", summary="A volume's directory listing")
async def list_dir(
    request: Request, volume_id: str, path: str = Query(..., max_length=4096), depth: int = Query(1, ge=1, le=16)
) -> list[dict[str, Any]]:
    _, volume = await _content(request, volume_id)
    return await asyncio.to_thread(volumes_of(request).files(volume).listing, path, depth)


@router.post("/volumecontent/{volume_id}/dir", status_code=201, summary="Make a directory in a volume")
async def make_dir(
    request: Request,
    volume_id: str,
    path: str = Query(..., max_length=4096),
    uid: int | None = Query(None, ge=0, le=MAX_ID),
    gid: int | None = Query(None, ge=0, le=MAX_ID),
    mode: int | None = Query(None, ge=0, le=0o7777),
    force: bool = Query(False),
) -> JSONResponse:
    volumes, volume = await _content(request, volume_id)
    made = await asyncio.to_thread(volumes.files(volume).make_dir, path, owner=_owner(uid, gid), mode=mode, force=force)
    return JSONResponse(made, status_code=201)


@router.get("/volumecontent/{volume_id}/path", summary="An entry of a volume (its link, not followed)")
async def stat_path(request: Request, volume_id: str, path: str = Query(..., max_length=4096)) -> dict[str, Any]:
    volumes, volume = await _content(request, volume_id)
    return await asyncio.to_thread(volumes.files(volume).stat, path)


@router.patch(
    "/volumecontent/{volume_id}/path", summary="Change an entry's owner or mode", openapi_extra=json_body(EntryPatch)
)
async def update_path(request: Request, volume_id: str, path: str = Query(..., max_length=4096)) -> dict[str, Any]:
    volumes, volume = await _content(request, volume_id)
    body: EntryPatch = await _body(request, EntryPatch)
    return await asyncio.to_thread(volumes.files(volume).update, path, uid=body.uid, gid=body.gid, mode=body.mode)


@router.delete("/volumecontent/{volume_id}/path", status_code=204, summary="Remove an entry (a directory whole)")
async def remove_path(request: Request, volume_id: str, path: str = Query(..., max_length=4096)) -> Response:
    volumes, volume = await _content(request, volume_id)
    await asyncio.to_thread(volumes.files(volume).remove, path)
    return Response(status_code=204)


@router.get("/volumecontent/{volume_id}/file", summary="A file of a volume")
async def read_file(request: Request, volume_id: str, path: str = Query(..., max_length=4096)) -> StreamingResponse:
    volumes, volume = await _content(request, volume_id)
    files = volumes.files(volume)
    opened = files.reading(path)
    fd, size = await asyncio.to_thread(opened.__enter__)

    async def chunks() -> AsyncIterator[bytes]:
        try:
            while True:
                chunk = await asyncio.to_thread(os.read, fd, CHUNK)
                if not chunk:
                    return
                yield chunk
        finally:
            await asyncio.to_thread(opened.__exit__, None, None, None)

    headers = {"content-length": str(size)}
    return StreamingResponse(chunks(), media_type="application/octet-stream", headers=headers)


@router.put("/volumecontent/{volume_id}/file", status_code=201, summary="Write a file of a volume (the raw body)")
async def write_file(
    request: Request,
    volume_id: str,
    path: str = Query(..., max_length=4096),
    uid: int | None = Query(None, ge=0, le=MAX_ID),
    gid: int | None = Query(None, ge=0, le=MAX_ID),
    mode: int | None = Query(None, ge=0, le=0o7777),
    force: bool = Query(False),
) -> JSONResponse:
    volumes, volume = await _content(request, volume_id)
    files = volumes.files(volume)
    settings = volumes.node.settings
    limit = settings.max_upload_mb * 2**20
    declared = request.headers.get("content-length", "")
    need = min(int(declared), limit) if declared.isdecimal() else 0
    await asyncio.to_thread(ensure_space, volumes.root, headroom(settings), need, f"a file of volume {volume.name}")
    parent, fd, temp, name, parts = await asyncio.to_thread(
        files.begin_write, path, owner=_owner(uid, gid), mode=mode, force=force
    )
    written = 0
    try:
        async for chunk in request.stream():
            written += len(chunk)
            if written > limit:
                raise PayloadTooLarge(f"the file is larger than {limit >> 20} MiB (AENV_MAX_UPLOAD_MB)")
            view = memoryview(chunk)
            while view:
                try:
                    done = await asyncio.to_thread(os.write, fd, view)
                except OSError as exc:
                    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                        raise InsufficientStorage(f"volume {volume.name!r} is full") from None
                    raise
                view = view[done:]
    except BaseException:
        await asyncio.to_thread(files.abort_write, parent, fd, temp)
        raise
    made = await asyncio.to_thread(files.finish_write, parent, fd, temp, name, parts, force=force)
    return JSONResponse(made, status_code=201)
