"""The cluster's nodes at the gateway (the admin key's): listed from the mirror, drained and
undrained through the node itself (aenv/cluster/agent/drain.py)."""

from __future__ import annotations

import re

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.cluster.agent.drain import DRAIN_PATH, UNDRAIN_PATH
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.relay import NODE_SCOPE, Relay, read_bounded, read_upstream, replay
from aenv.cluster.gateway.settings import MAX_INFO_BODY, GatewaySettings
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.nodes import node_json
from aenv.cluster.websocket import NODE_ID_HEADER
from aenv.errors import InvalidRequest, parse_json


class NodeRoutes:
    def __init__(self, settings: GatewaySettings, directory: Directory, upstream: Upstream) -> None:
        self.settings = settings
        self.directory = directory
        self.upstream = upstream

    async def nodes(self, request: Request, _: re.Match[str]) -> Response:
        """E2B's Node shape and aenv's own (aenv/cluster/nodes.py), from the mirror."""
        nodes = sorted(self.directory.mirror.nodes.values(), key=lambda n: n.node_id)
        return JSONResponse([node_json(n) for n in nodes])

    async def node(self, request: Request, match: re.Match[str]) -> Response:
        return JSONResponse(node_json(self.directory.node_named(match["id"])))

    async def undrain(self, request: Request, match: re.Match[str]) -> Relay:
        """``POST /nodes/{id}/undrain``: the node takes new work again (a drain under way stops);
        its answer is the node as it is then."""
        node = self.directory.node_named(match["id"])
        body = await read_bounded(request, 1024)
        request.scope[NODE_SCOPE] = node.node_id
        return Relay(await self.upstream.send(request, node, body=body, path=UNDRAIN_PATH), node)

    async def change_status(self, request: Request, match: re.Match[str]) -> Response | Relay:
        """E2B's ``POST /nodes/{id}`` (``{"status": "ready" | "draining"}``, 204): an undrain, or
        a drain without moves started and left to run (its progress: ``POST .../drain``)."""
        node = self.directory.node_named(match["id"])
        try:
            status = parse_json(await read_bounded(request, 1024) or b"{}").get("status")
        except (ValueError, AttributeError):
            status = None
        if status not in ("ready", "draining"):
            raise InvalidRequest('a node\'s status change is {"status": "ready" | "draining"}')
        request.scope[NODE_SCOPE] = node.node_id
        path, body = (UNDRAIN_PATH, b"") if status == "ready" else (DRAIN_PATH, b'{"move": false}')
        length = {"content-length": str(len(body)), "content-type": "application/json"}  # not the client's body
        upstream = await self.upstream.send(request, node, body=body, path=path, extra=length)
        try:
            if upstream.status_code != 200:  # the node's refusal, as it said it
                return Relay(replay(upstream, await read_upstream(upstream, MAX_INFO_BODY, node)), node)
            async for _ in upstream.aiter_raw():  # the node took it (a drain's first line): it goes on alone
                break
        finally:
            await upstream.aclose()
        return Response(status_code=204, headers={NODE_ID_HEADER: node.node_id})

    async def drain(self, request: Request, match: re.Match[str]) -> Relay:
        """``POST /nodes/{id}/drain``: the node drains itself (aenv/cluster/agent/drain.py); its progress
        streams back as NDJSON lines until the node is empty."""
        node = self.directory.node_named(match["id"])
        body = await read_bounded(request, 1024)
        request.scope[NODE_SCOPE] = node.node_id
        timeout = httpx.Timeout(self.settings.connect_timeout, read=None, write=60.0, pool=10.0)
        return Relay(await self.upstream.send(request, node, body=body, path=DRAIN_PATH, timeout=timeout), node)

    async def not_a_route(self, request: Request, _: re.Match[str]) -> Response:
        raise InvalidRequest(f"{request.method} {request.url.path[:100]} is not a route of the gateway", status=405)
