"""Routes of images as templates: what the node holds (with sizes, to see what sharing saves),
and prefetches ahead of a training schedule (aenv/templates/prefetch.py)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from aenv.api.sandboxes import _body, build_host_of, json_body, node_of
from aenv.api.schemas import rfc3339
from aenv.errors import NotFound
from aenv.templates import prefetch

router = APIRouter()


class PrefetchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    images: list[Any]  # each checked by prefetch.checked: a 400 names the one that is no reference


@router.get("/images", summary="Images this node holds as templates, or evicted: sizes, what is stored, last use")
async def images(request: Request) -> list[dict[str, Any]]:
    rows = await node_of(request).images()
    for row in rows:
        row["lastUsed"] = rfc3339(row["lastUsed"])
        row["createdAt"] = rfc3339(row["createdAt"])
        if "evictedAt" in row:
            row["evictedAt"] = rfc3339(row["evictedAt"])
    return rows


async def _prefetch(request: Request) -> JSONResponse:
    body: PrefetchRequest = await _body(request, PrefetchRequest)
    job = prefetch.start(build_host_of(request), body.images)
    return JSONResponse(_job_json(job), status_code=202)


router.add_api_route(
    "/images/prefetch",
    _prefetch,
    methods=["POST"],
    status_code=202,
    summary="Pull images and make them templates ahead of their first creates; answers a job to follow",
    openapi_extra=json_body(PrefetchRequest),
)


@router.get("/images/prefetch/{prefetch_id}", summary="A prefetch's progress: each image's state and bytes")
async def prefetch_status(request: Request, prefetch_id: str) -> dict[str, Any]:
    job = prefetch.get(build_host_of(request), prefetch_id)
    if job is None:
        raise NotFound(f"no prefetch '{prefetch_id[:64]}' on this node")
    return _job_json(job)


def _job_json(job: prefetch.Job) -> dict[str, Any]:
    body = job.as_json()
    body["createdAt"] = rfc3339(body["createdAt"])
    if body["doneAt"] is not None:
        body["doneAt"] = rfc3339(body["doneAt"])
    return body
