"""Sandbox traffic: a request that names a sandbox by its E2B headers, its host or a signed
``/files`` URL goes to the sandbox's node whatever its path (the app in the sandbox chose the
path), and is sent again where the sandbox woke when its node refused or did not answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from aenv.api import envd
from aenv.api.app import sandbox_target
from aenv.api.connections import refuse_websocket
from aenv.api.proxy import CLIENT_HOST_HEADER
from aenv.api.signed import Signers
from aenv.api.signed import too_long as url_too_long
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import Traffic
from aenv.cluster.gateway.owners import Owners
from aenv.cluster.gateway.relay import (
    NODE_SCOPE,
    ROUTE_SCOPE,
    NodeSilent,
    Relay,
    error_response,
    kept_body,
    read_bounded,
    small_body,
    traffic_gone,
)
from aenv.cluster.gateway.settings import KEEP_STREAM_SECONDS, MAX_REPLAYED_BODY, WAKE_SECONDS, GatewaySettings
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.websocket import relay_websocket
from aenv.errors import AenvError, InvalidRequest, NotFound, SandboxNotFound


class SandboxTraffic:
    def __init__(self, settings: GatewaySettings, directory: Directory, owners: Owners, upstream: Upstream) -> None:
        self.settings = settings
        self.directory = directory
        self.owners = owners
        self.upstream = upstream
        self.signers = Signers()  # who signed a /files URL that names no sandbox

    async def route(self, request: Request, headers: dict[str, str]) -> Response | Relay | None:
        """The answer to ``request`` if it is sandbox traffic; None for the control plane."""
        scope = request.scope
        target = sandbox_target(headers)
        signed = False
        if target is None and request.url.path == "/files":
            too_long = url_too_long(request)
            if too_long is not None:
                return too_long  # before anything is hashed
            signer = await self.signer(request)
            target = (signer, envd.ENVD_PORT) if signer else None
            signed = signer is not None  # its URL's signature is the sandbox's token's
        if isinstance(target, str):
            return JSONResponse({"code": 400, "message": target}, status_code=400)
        if target is None:
            return None
        sandbox_id, port = target
        scope[ROUTE_SCOPE] = "envd" if port == envd.ENVD_PORT else "port"
        extra = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(port)}  # a host route, as headers
        try:
            return await self.relay(request, sandbox_id, Traffic(port, headers, signed), extra)
        except SandboxNotFound as exc:
            return traffic_gone(scope, sandbox_id, exc, paused=self.directory.paused_here(sandbox_id))

    async def relay(self, request: Request, sandbox_id: str, traffic: Traffic, extra: dict[str, str]) -> Relay:
        """Sandbox traffic, to its node. A node that refused it before reading it (503
        ``cluster_unavailable``: the sandbox is being paused durably by a drain the mirror does
        not show yet, or the node missed etcd for a moment) gets it again once the mirror says
        where the sandbox is, within WAKE_SECONDS, while etcd answers the gateway. Only a request
        whose body is small enough to keep (or has none) is sent twice; a stream goes once."""
        declared = request.headers.get("content-length", "")
        replayable = small_body(request, MAX_REPLAYED_BODY)
        body = await read_bounded(request, MAX_REPLAYED_BODY) if replayable and declared else None
        stream: AsyncIterator[bytes] | None = None
        _, at = self.directory.mirror.owner(sandbox_id)
        if not replayable and at is not None and at.draining:
            # A draining node's pause of it may be a move's, refused until it is done: a small
            # streamed body (an E2B command's start) is kept too, to send where it went.
            body, stream = await kept_body(request, MAX_REPLAYED_BODY, KEEP_STREAM_SECONDS)
            replayable = body is not None
        until = time.monotonic() + WAKE_SECONDS
        woken: NodeEntry | None = None  # where the sandbox was just resumed (the mirror may lag)
        while True:
            node = woken or await self.owners.owner(sandbox_id, request.scope, wake=traffic)
            woken = None
            request.scope[NODE_SCOPE] = node.node_id
            try:
                upstream = await self.upstream.send(request, node, body=body, extra=extra, traffic=True, stream=stream)
            except NodeSilent as exc:
                if not replayable or time.monotonic() >= until:
                    raise
                woken = await self.owners.wake_from_silent(sandbox_id, traffic, exc)
                continue
            answer = await self.upstream.unless_blip(upstream, node, until) if replayable else upstream
            if answer is not None:
                return Relay(answer, node)

    async def signer(self, request: Request) -> str | None:
        """The sandbox whose access token signed this /files URL, among every sandbox the gateway
        knows (aenv/api/signed.py: a short hash each, once; a URL found before costs one)."""
        if not request.query_params.get("signature"):
            return None
        config = await self.directory.cluster_config()
        if config is None:
            return None
        return await self.signers.find(request, config.secret.encode(), self.directory.knows, self.directory.known)

    async def websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        """A WebSocket to a sandbox's port, relayed to the node that owns the sandbox (which
        relays it to the port). The node's proxy is the only thing that upgrades."""
        if (await receive())["type"] != "websocket.connect":
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        sandbox_id = ""
        try:
            target = sandbox_target(headers)
            if isinstance(target, str):
                raise InvalidRequest(target)
            if target is None:
                raise NotFound("only a sandbox's port takes WebSockets (E2b-Sandbox-Id and E2b-Sandbox-Port headers)")
            sandbox_id, port = target
            node = await self.owners.owner(sandbox_id, scope, wake=Traffic(port, headers, signed=False))
        except SandboxNotFound as exc:
            gone = traffic_gone(scope, sandbox_id, exc, paused=self.directory.paused_here(sandbox_id))
            await refuse_websocket(scope, send, gone)
            return
        except AenvError as exc:
            await refuse_websocket(scope, send, error_response(scope, exc))
            return
        routing = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(port)}
        if host := headers.get("host"):
            routing[CLIENT_HOST_HEADER] = host
        await relay_websocket(scope, receive, send, node, routing, self.settings.ws_max_message_mb * 2**20)
