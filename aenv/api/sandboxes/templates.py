"""Templates on this node: listing, making one from an OCI image or a Dockerfile (streamed as
NDJSON), fetching one's files from the repository, aliases, deleting, and the warm pool.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse

from aenv.api.sandboxes.requests import _body, build_host_of, declared_length, json_body, node_of
from aenv.api.schemas import DEFAULT_TEMPLATES, ImageTemplate, TemplatePatch, WarmPoolSize, snapshot_json, template_json
from aenv.errors import AenvError, Conflict, Forbidden, InvalidRequest, NotFound, SnapshotNotFound, error_body
from aenv.node.service import BuildHost, NodeService, SnapshotRecord, Spawns, TemplateRecord
from aenv.storage.confined import View, remove_tree
from aenv.teams import guard as team_guard
from aenv.teams.model import current
from aenv.templates import build, catalog, desktop, images, uploads
from aenv.templates.catalog import TEMPLATE_NAME

router = APIRouter()


MAX_DOCKERFILE = 1 << 20
BUILD_CONTEXT = {"requestBody": {"content": {"application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}}


def described(request: Request, t: TemplateRecord, node: NodeService | None = None) -> dict[str, Any]:
    """A template as the API shows it (E2B's Template model and aenv's fields), with its uses here."""
    spawns: Spawns = request.app.state.spawns
    return template_json(t, node or node_of(request), spawns.get(t.id, t.name))


def _in_order(node: NodeService) -> list[TemplateRecord]:
    return sorted(node.templates.values(), key=lambda t: (t.created_at, t.id))


@router.get("/templates", summary="List templates")
async def list_templates(request: Request) -> list[dict[str, Any]]:
    node = node_of(request)
    return [described(request, t, node) for t in _in_order(node)]


@router.get("/v2/templates", summary="List templates, a page at a time (E2B's; the next page's token in x-next-token)")
async def list_templates_v2(
    request: Request,
    response: Response,
    team_id: str | None = Query(None, alias="teamID", max_length=128),
    next_token: str | None = Query(None, alias="nextToken", max_length=512),
    limit: int = Query(100, ge=1, le=100),
) -> list[dict[str, Any]]:
    """The templates the key's team may use, oldest first. ``teamID`` may name the key's own team
    (any team for the deployment's admin key: its own templates, and those every team may use)."""
    who = current()
    every_team = team_id is not None and who is not None and who.admin  # another team's: the admin key's
    node = request.app.state.node if every_team else node_of(request)
    shown = [t for t in _in_order(node) if team_guard.in_team(t, team_id)]
    if next_token is not None:
        after = _page_token_after(next_token)
        shown = [t for t in shown if (t.created_at, t.id) > after]
    page = shown[:limit]
    if len(shown) > limit:
        last = page[-1]
        response.headers["x-next-token"] = _page_token(last.created_at, last.id)
    return [described(request, t, node) for t in page]


@router.get("/default-templates", summary="The templates every team may use (E2B's default templates)")
async def default_templates(request: Request) -> list[dict[str, Any]]:
    node = node_of(request)
    return [described(request, t, node) for t in _in_order(node) if t.name in DEFAULT_TEMPLATES]


def _page_token(created_at: float, template_id: str) -> str:
    raw = json.dumps([created_at, template_id]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _page_token_after(token: str) -> tuple[float, str]:
    try:
        created_at, template_id = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return float(created_at), str(template_id)
    except (ValueError, TypeError, binascii.Error):
        raise InvalidRequest("nextToken is not a token this API gave out") from None


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
            return {"template": described(request, rec, node)}

        return _streamed_job(node, pulled)
    # A shielded task: the pull and commit finish even if the client gives up waiting.
    task = asyncio.ensure_future(images.template_from_image(node, body.name, body.image, login=login))
    rec = await asyncio.shield(task)
    return JSONResponse(described(request, rec, node), status_code=201)


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
        except Exception:  # reported to the client without the host's details, then logged by the task
            lines.put_nowait({"error": {"code": 500, "message": "failed on the node (its log says why)"}})
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
    "/templates/builtin/{name}",
    summary="Build a built-in template (desktop) on this node anew (streams NDJSON build logs)",
)
async def build_builtin(
    request: Request,
    name: str,
    browser: str | None = Query(None, description="desktop: chromium, firefox-esr or none [AENV_DESKTOP_BROWSER]"),
) -> StreamingResponse:
    """The deployment's admin key only (the template is every team's). Lines as a build's:
    ``{"log"}``..., then ``{"template"}`` or ``{"error"}``; 409 while one is under way."""
    who = current()
    if who is not None and not who.admin:
        raise Forbidden("built-in templates are built with the deployment's admin key")
    if name != desktop.NAME:
        raise NotFound(f"no built-in template named {name[:64]!r} (there is {desktop.NAME!r})")
    node = build_host_of(request)
    chosen = desktop.browser_of(browser or request.app.state.node.settings.desktop_browser)
    builds: desktop.Builds = request.app.state.desktop_builds
    if builds.running:
        raise Conflict(f"the {desktop.NAME} template is being built already (for {builds.elapsed():.0f}s)")

    async def built(emit: Emit) -> dict[str, Any]:
        rec = await builds.build(node, chosen, on_log=lambda line: emit({"log": line}))
        return {"template": described(request, rec, node)}

    return _streamed_job(node, built)


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
        return {"template": described(request, rec, node)}

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
        return {"template": described(request, rec, node), "fetchedBytes": size}

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
    return described(request, template, node)


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
    return described(request, node.find_template(template_id), node)
