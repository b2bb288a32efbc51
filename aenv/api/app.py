"""The node's HTTP surface on one port: control plane, envd data plane and /metrics.

Requests that name a sandbox (``E2b-Sandbox-Id`` header, or a ``<port>-<sandboxID>.<domain>`` host)
are sandbox traffic; everything else is the control plane, which needs the API key.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast
from urllib.parse import unquote

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request as StarletteRequest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv import __version__
from aenv.api import e2b_templates, envd, images, proxy, repository, rollout, signed
from aenv.api.connections import refuse_websocket
from aenv.api.sandboxes import add_body_schemas, router
from aenv.dashboard import pages as dashboard_pages
from aenv.dashboard import routes as dashboard_routes
from aenv.errors import AenvError, PayloadTooLarge, RequestTimeout, error_body, error_headers
from aenv.events.routes import router as events_router
from aenv.events.service import Events
from aenv.node.service import BuildHost, NodeService, Spawns
from aenv.secrets.routes import Secrets
from aenv.secrets.routes import router as secrets_router
from aenv.teams import guard as team_guard
from aenv.teams.model import PRINCIPAL
from aenv.teams.routes import router as teams_router
from aenv.teams.tenancy import Tenancy
from aenv.templates import desktop
from aenv.volumes.routes import router as volumes_router
from aenv.volumes.service import Volumes

log = logging.getLogger("aenv.api")
HOST_ROUTE = re.compile(r"^(\d+)-([a-z0-9]+)$")
# Control-plane routes open without the API key, by exact (method, path); GET routes answer HEAD too.
PUBLIC_ROUTES = frozenset(
    (method, path)
    for path in ("/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
    for method in ("GET", "HEAD")
)
# E2B's SDK uploads template files without its API key: a PUT there needs the URL's own token instead.
# Node-wide requests naming a template or snapshot, and their lists: a gateway sends them to any
# node, which may not have learned yet what another node committed to the shared repository.
CATALOGUE_REF = re.compile(r"^/(?:v\d+/)?(?:templates|snapshots)(?:/aliases)?/(?P<ref>[^/]+)")
CATALOGUE_LISTS = frozenset({"/templates", "/snapshots", "/v2/templates"})
# E2B's volume content API: the volume's own bearer token, which its routes check (aenv/volumes).
VOLUME_CONTENT = re.compile(r"/volumecontent/[^/]+/(?:dir|path|file)")
SIGNED_UPLOAD = re.compile(r"/templates/(?P<template>[^/]+)/files/(?P<files_hash>[^/]+)/upload")


def sandbox_target(headers: dict[str, str]) -> tuple[str, int] | None | str:
    """(sandbox id, port) for sandbox traffic, None for the control plane, or an error text."""
    host = headers.get("host", "").rsplit(":", 1)[0] if not headers.get("host", "").startswith("[") else ""
    m = HOST_ROUTE.match(host.split(".", 1)[0])
    sid, port = (
        (m.group(2), m.group(1))
        if m and "." in host
        else (headers.get("e2b-sandbox-id"), headers.get("e2b-sandbox-port"))
    )
    if sid is None and port is None:
        return None
    if sid is None or port is None:
        return "Missing header E2b-Sandbox-Id or E2b-Sandbox-Port"
    if not port.isdecimal() or not 0 < int(port) < 65536:
        return "the sandbox port must be a port number"
    return sid, int(port)


def create_app(node: NodeService, *, start_node: bool = True, tenancy: Tenancy | None = None) -> FastAPI:
    """The control plane. The node stops with the app (pausing running sandboxes): this must
    happen inside the server's shutdown, before uvicorn re-raises the signal that stopped it.
    Every route first passes the team check (aenv/teams/guard.py)."""
    teams = tenancy if tenancy is not None else Tenancy(node, None)
    events = Events(node)
    volumes = Volumes(node)
    secrets = Secrets(node)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if start_node:
            await node.start()
        try:
            await teams.start()
            await volumes.start()
            await secrets.start()
            await events.start()
            if hasattr(node, "driver"):  # a node that builds: a guest agent's upgrade, a new `desktop` snapshot
                app.state.desktop_builds.refresh(cast(BuildHost, node))
            yield
        finally:
            try:
                await teams.stop()
            finally:
                try:
                    await node.stop()
                finally:  # after the node: the pauses of its stop are events too
                    await events.stop()
                    await volumes.stop()
                    await secrets.stop()

    app = FastAPI(
        title="aenv",
        version=__version__,
        summary="Isolated, stateful sandboxes for agentic RL: create, exec, pause, snapshot, fork.",
        lifespan=lifespan,
        dependencies=[Depends(team_guard.check_route)],
    )
    app.state.node = node
    app.state.events = events
    app.state.volumes = volumes
    app.state.secrets = secrets
    node.use_secrets(secrets.value_of)  # network.rules' placeholders are filled by the node's egress
    app.state.spawns = Spawns()  # E2B's spawnCount and lastSpawnedAt of each template
    app.state.desktop_builds = desktop.Builds()
    node.state_listeners.append(app.state.spawns.observe)
    teams.install(app)

    async def holdings(team: str) -> str:
        """What keeps a team from being deleted: its sandboxes, templates and snapshots on this
        node, and its volumes and secrets (the deployment's), in words ("" for nothing)."""
        counts = ((len(await volumes.visible(team)), "volumes"), (len(await secrets.store.all(team)), "secrets"))
        parts = [teams.holdings(team), *(f"{n} {what}" for n, what in counts if n)]
        return ", ".join(p for p in parts if p)

    app.state.team_holdings = holdings
    app.include_router(e2b_templates.router)  # first: /templates/tags before /templates/{id:path}
    app.include_router(router)
    app.include_router(repository.router)
    app.include_router(images.router)
    app.include_router(rollout.router)
    app.include_router(dashboard_routes.router)
    app.include_router(teams_router)
    app.include_router(events_router)
    app.include_router(volumes_router)
    app.include_router(secrets_router)
    generate_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            add_body_schemas(generate_openapi())
        return app.openapi_schema  # type: ignore[return-value]

    app.openapi = openapi  # type: ignore[method-assign]

    @app.exception_handler(AenvError)
    async def aenv_error(request: Request, exc: AenvError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("%s %s failed: %r", request.method, request.url.path, exc)
        return JSONResponse(error_body(exc), status_code=exc.status, headers=error_headers(exc))

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        msg = f"invalid request: {where}: {first.get('msg', 'invalid value')}"
        return JSONResponse({"code": 400, "message": msg, "error_code": "invalid_request"}, status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        return JSONResponse(
            {"code": exc.status_code, "message": str(exc.detail), "error_code": code}, status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse({"code": 500, "message": f"internal error: {type(exc).__name__}: {exc}"}, status_code=500)

    @app.get("/health", include_in_schema=False)
    async def health() -> dict[str, Any]:
        return {
            "status": "ok",
            "version": __version__,
            "templates": sorted(t.name for t in node.templates.values()),
            "runtime": node.runtime_info(),
            "runtimeCalibration": node.runtime_calibration(),
        }

    @app.get("/metrics", include_in_schema=False)
    async def prometheus() -> Response:
        node.observe_metrics()
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    app.state.api_key = None
    return app


class SandboxRouter:
    """Pure ASGI front: sandbox traffic goes to envd or the port proxy; the rest needs the API key.
    ``node`` as builds use it: its artifact cache learns the repository's catalogue."""

    def __init__(self, app: ASGIApp, node: BuildHost, api_key: str | None, tenancy: Tenancy | None = None) -> None:
        self.app = app
        self.node = node
        self.api_key = api_key
        self.tenancy = tenancy if tenancy is not None else Tenancy(node, api_key)
        self.signers = signed.Signers()

    def _secure(self, sandbox_id: str) -> bool:
        sb = self.node.sandboxes.get(sandbox_id)
        return sb is not None and sb.rec.secure

    def _secure_ids(self) -> list[str]:
        return [sandbox_id for sandbox_id, sb in self.node.sandboxes.items() if sb.rec.secure]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        target = sandbox_target(headers)
        if target is None and scope["path"] == "/files" and b"signature=" in scope.get("query_string", b""):
            # A signed URL that names no sandbox (the SDKs' through one E2B_SANDBOX_URL): the
            # secure sandbox whose token signed it answers as envd would (an expired one is its 401).
            request = StarletteRequest(scope)
            too_long = signed.too_long(request)
            if too_long is not None:
                await _reply(scope, receive, send, too_long)
                return
            signer = await self.signers.find(request, self.node.token_secret.encode(), self._secure, self._secure_ids)
            target = (signer, envd.ENVD_PORT) if signer else None
        if isinstance(target, str):
            await _reply(scope, receive, send, JSONResponse({"code": 400, "message": target}, status_code=400))
            return
        if target is not None:
            sandbox_id, port = target
            if scope["type"] == "websocket":
                if port == envd.ENVD_PORT:  # envd has no WebSocket endpoint: refused before any resume
                    await _reply(scope, receive, send, _no_websocket("envd (port 49983) has no WebSocket endpoint"))
                    return
                await proxy.proxy_websocket(scope, receive, send, self.node, sandbox_id, port)
                return
            if not (port == envd.ENVD_PORT and scope["path"] in envd.CLIENT_STREAMS):
                # A body that stops is let go (an upload to envd or a port), as proxies do (nginx's
                # client_body_timeout): else any client of a public port holds connections for good.
                receive = _bounded(receive, None, self.node.settings.http_body_timeout, idle=True)
            request = StarletteRequest(scope, receive)
            if port == envd.ENVD_PORT:
                response = await envd.handle(request, self.node, sandbox_id)
            else:
                response = await proxy.proxy_http(request, self.node, sandbox_id, port)
            await response(scope, receive, send)
            return
        if self.api_key and not _open_without_key(scope, self.node):
            try:  # the key's team: what the routes may see and make (aenv/teams)
                PRINCIPAL.set(await self.tenancy.authenticate(headers))
            except AenvError as exc:
                answer = JSONResponse(error_body(exc), status_code=exc.status, headers=error_headers(exc))
                await _reply(scope, receive, send, answer)
                return
        if scope["type"] == "websocket":  # the control plane has no WebSocket route
            await _reply(scope, receive, send, _no_websocket(f"no WebSocket endpoint at {scope['path'][:200]}"))
            return
        if scope["type"] == "http":
            await _learn_catalogue(self.node, scope)
        if scope["type"] == "http" and not _streams_its_body(scope):
            limit = self.node.settings.max_body_kb * 1024
            declared = headers.get("content-length", "")
            if declared.isdecimal() and int(declared) > limit:
                await _reply(scope, receive, send, _error_response(_too_large(limit)))
                return
            receive = _bounded(receive, limit, self.node.settings.http_body_timeout)
        await self.app(scope, receive, send)


async def _learn_catalogue(node: BuildHost, scope: Scope) -> None:
    """Before a request names a template or snapshot this node does not know, or lists them, the
    node learns what the shared repository holds (a named entry at once, the whole catalogue at
    most every few seconds): through a gateway, a template made on one node is found on any.
    Seen failing: a public template made on one node was a 404 from the other."""
    path = scope["path"]
    if path in CATALOGUE_LISTS:
        if scope["method"] == "GET":
            await node.artifacts.refresh_catalogue()
        return
    named = CATALOGUE_REF.match(path)
    if named is None:
        return
    ref = unquote(named["ref"])
    try:
        node.find_template(ref)
        return
    except AenvError:
        pass
    try:
        node.find_snapshot(ref)
    except AenvError:
        await node.artifacts.refresh_catalogue(ref)


def _streams_its_body(scope: Scope) -> bool:
    """Template build contexts, template file uploads and volume files: streamed to disk with
    their own bound."""
    method, path = scope["method"], scope["path"]
    return (method, path) == ("POST", "/templates/build") or (
        method == "PUT" and (SIGNED_UPLOAD.fullmatch(path) is not None or VOLUME_CONTENT.fullmatch(path) is not None)
    )


def _bearer(scope: Scope) -> bool:
    return Headers(scope=scope).get("authorization", "")[:7].lower() == "bearer "


def _too_large(limit: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"the request body is larger than {limit // 1024} KiB (AENV_MAX_BODY_KB)")


def _bounded(receive: Receive, limit: int | None, deadline: float, *, idle: bool = False) -> Receive:
    """``receive`` that counts body bytes as they arrive (chunked bodies included) and fails the
    read past ``limit`` (413) or past ``deadline`` seconds (408): for the whole body, or with
    ``idle`` for each of its pieces. Nothing larger is ever held, and a body sent a byte now and
    then does not hold its request for good. Once the body is in, what follows (a disconnect) is
    waited for as long as the response takes."""
    received = 0
    due: float | None = None
    complete = False

    async def bounded_receive() -> Message:
        nonlocal received, due, complete
        if complete:
            return await receive()
        if due is None or idle:
            due = asyncio.get_running_loop().time() + deadline
        try:
            async with asyncio.timeout_at(due):
                message = await receive()
        except TimeoutError:
            what = "stopped for" if idle else "did not arrive within"
            raise RequestTimeout(f"the request body {what} {deadline:g}s") from None
        complete = message["type"] != "http.request" or not message.get("more_body", False)
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if limit is not None and received > limit:
                raise _too_large(limit)
        return message

    return bounded_receive


def _error_response(exc: AenvError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status)


def _open_without_key(scope: Scope, node: NodeService) -> bool:
    """A public route, or E2B's template file upload with the valid token of its URL. WebSockets
    never: the control plane has no WebSocket route, so a key is needed to get anywhere."""
    if scope["type"] != "http":
        return False
    method, path = scope["method"], scope["path"]
    if (method, path) in PUBLIC_ROUTES or dashboard_pages.is_page(method, path):
        return True
    if VOLUME_CONTENT.fullmatch(path) and _bearer(scope) and "x-api-key" not in Headers(scope=scope):
        return True
    upload = SIGNED_UPLOAD.fullmatch(path)
    if method != "PUT" or upload is None:
        return False
    token = StarletteRequest(scope).query_params.get("token", "")
    return e2b_templates.upload_authorized(node, upload["template"], upload["files_hash"], token)


async def _reply(scope: Scope, receive: Receive, send: Send, response: Response) -> None:
    if scope["type"] == "websocket":  # the refusal as an HTTP answer (it was an empty 403)
        await refuse_websocket(scope, send, response)
        return
    await response(scope, receive, send)


def _no_websocket(message: str) -> JSONResponse:
    hint = ": a sandbox's port takes WebSockets (E2b-Sandbox-Id and E2b-Sandbox-Port, or a <port>-<id> host)"
    return JSONResponse({"code": 404, "message": message + hint}, status_code=404)


def build(node: BuildHost, api_key: str | None, *, start_node: bool = True) -> ASGIApp:
    """The whole node application: router in front of the FastAPI control plane."""
    tenancy = Tenancy(node, api_key)
    return SandboxRouter(create_app(node, start_node=start_node, tenancy=tenancy), node, api_key, tenancy)
