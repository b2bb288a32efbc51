"""Requests to the nodes: a client's request forwarded (streamed, or sent again after a node's
moment without etcd, or after the sandbox it names moved), and the gateway's own fan-out reads."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.requests import Request
from starlette.responses import Response

from aenv.api import connections
from aenv.cluster.agent import OWNERSHIP_PATH
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import NodePage, error_code, json_answer, node_error
from aenv.cluster.gateway.relay import (
    HOP_HEADERS,
    NODE_SCOPE,
    NodeSilent,
    Relay,
    body_stream,
    buffered,
    read_bounded,
    read_upstream,
    replay,
    small_body,
)
from aenv.cluster.gateway.settings import (
    CREATE_RETRY_PAUSE,
    LIST_TIMEOUT,
    MAX_CREATE_BODY,
    MAX_FOLLOWS,
    MAX_FORK_BODY,
    MAX_INFO_BODY,
    STORE_BLIP_SECONDS,
    GatewaySettings,
)
from aenv.errors import UpstreamError
from aenv.node.service import OWNER_FULL_HEADER


class Upstream:
    def __init__(self, settings: GatewaySettings, directory: Directory, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.directory = directory
        self.client = client

    async def forward(
        self, request: Request, node: NodeEntry, extra: dict[str, str] | None = None, *, follow: str | None = None
    ) -> Relay:
        request.scope[NODE_SCOPE] = node.node_id
        upstream = await self.send(request, node, extra=extra, follow=follow)
        return Relay(upstream, self.directory.mirror.nodes.get(request.scope[NODE_SCOPE], node))

    async def answered(
        self,
        request: Request,
        node: NodeEntry,
        note: Callable[[object, NodeEntry], None] | None = None,
        *,
        upstream: httpx.Response | None = None,
        follow: str | None = None,
    ) -> Response:
        """Forward (unless sent already: ``upstream``), read the node's (small) answer whole, and
        let ``note`` learn from it what was made there (or add to it); in domain mode its
        sandboxes name the gateway's domain. ``follow``: see ``send``."""
        upstream = upstream or await self.send(request, node, follow=follow)
        node = self.directory.mirror.nodes.get(request.scope.get(NODE_SCOPE, ""), node)
        try:
            content = await read_upstream(upstream, MAX_FORK_BODY, node)
        finally:
            await upstream.aclose()
        answer = json_answer(upstream, content)
        if answer is None:
            return buffered(upstream, node, content)
        if note is not None:
            note(answer, node)
        self.stamp_domain(answer)
        return buffered(upstream, node, json.dumps(answer).encode())

    def stamp_domain(self, answer: object) -> None:
        """In domain mode, the sandboxes in an answer (a sandbox, a list of them, fork results)
        name the gateway's domain: the SDKs build ``<port>-<id>.<domain>`` from it, and a node's own
        (``AENV_DOMAIN``) is not where clients of this gateway reach it."""
        domain = self.settings.domain
        if not domain:
            return
        for item in answer if isinstance(answer, list) else [answer]:
            if isinstance(item, dict) and isinstance(item.get("sandbox"), dict):
                item = item["sandbox"]  # a fork's result
            if isinstance(item, dict) and "sandboxID" in item:
                item["domain"] = domain

    async def send(
        self,
        request: Request,
        node: NodeEntry,
        *,
        body: bytes | None = None,
        extra: dict[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        path: str | None = None,
        traffic: bool = False,
        follow: str | None = None,
        stream: AsyncIterator[bytes] | None = None,
    ) -> httpx.Response:
        """The node's answer to ``request`` (streamed). A pause, resume or connect the node
        refused only because it missed etcd for a moment is sent again while etcd answers here
        (or is electing) and the node's lease holds (within STORE_BLIP_SECONDS): the node refused before doing
        anything. A request about
        sandbox ``follow`` (the control plane's) that its node answers 404 while etcd names
        another node (it moved a moment ago: a drain, a takeover) goes there. Sandbox ``traffic``
        is never one of those, whatever its path (the app in the sandbox chose it). ``stream``:
        the request's body as read so far and the rest (sent once), where ``body`` is None."""
        patient = (
            not traffic and request.method == "POST" and OWNERSHIP_PATH.fullmatch(path or request.url.path) is not None
        )
        following = follow is not None and not traffic and stream is None and small_body(request)
        if (patient or following) and body is None:
            body = await read_bounded(request, MAX_CREATE_BODY)  # small, and needed again for a retry
        until = time.monotonic() + STORE_BLIP_SECONDS
        moves = 0
        while True:
            upstream = await self._send_once(request, node, body, extra or {}, timeout, path, stream)
            if following and follow is not None and upstream.status_code == 404 and moves < MAX_FOLLOWS:
                moved_to = await self.directory.moved_to(follow, node)
                if moved_to is not None:
                    await upstream.aclose()
                    node, moves = moved_to, moves + 1
                    request.scope[NODE_SCOPE] = node.node_id
                    continue
            answer = await self.unless_blip(upstream, node, until) if patient else upstream
            if answer is not None:
                return answer

    async def unless_blip(self, upstream: httpx.Response, node: NodeEntry, until: float) -> httpx.Response | None:
        """``upstream`` to pass on (read whole and replayed if it was a 503), or None after a
        pause when it is the node's refusal for missing etcd a moment (503 ``cluster_unavailable``)
        and the request is worth sending again: before ``until``, while the node's lease holds and
        etcd answers here or is electing a leader."""
        if upstream.status_code != 503:
            return upstream
        try:
            content = await read_upstream(upstream, MAX_INFO_BODY, node)
        finally:
            await upstream.aclose()
        if error_code(content) != "cluster_unavailable" or time.monotonic() >= until:
            return replay(upstream, content)
        if node.node_id not in self.directory.mirror.nodes:  # its lease ran out: lost, not a blip
            return replay(upstream, content)
        if not await self.directory.store_recovers():
            return replay(upstream, content)
        await asyncio.sleep(CREATE_RETRY_PAUSE)
        return None

    async def _send_once(
        self,
        request: Request,
        node: NodeEntry,
        body: bytes | None,
        extra: dict[str, str],
        timeout: httpx.Timeout | None,
        path: str | None,
        stream: AsyncIterator[bytes] | None = None,
    ) -> httpx.Response:
        # As received (bytes: a value that is not ASCII passes as it came, for the node to judge).
        # Sandbox traffic keeps the client's Host: the sandbox's port sees it (or its mask).
        # The gateway's own word to a node is never a client's.
        dropped = (HOP_HEADERS - ({"host"} if "e2b-sandbox-id" in extra else set())) | set(extra) | {OWNER_FULL_HEADER}
        # Names as the client wrote them: a sandbox's server sees its request as sent.
        headers = [(k, v) for k, v in connections.as_sent(request.scope) if k.decode("latin-1").lower() not in dropped]
        headers += [(k.encode(), v.encode()) for k, v in extra.items()]
        url = node.address + (path or request.url.path) + (f"?{request.url.query}" if request.url.query else "")
        content: bytes | AsyncIterator[bytes] | None = body if stream is None else stream
        if content is None and ("content-length" in request.headers or "transfer-encoding" in request.headers):
            content = body_stream(request)  # streamed as it arrives; httpx keeps the client's Content-Length
        outgoing = self.client.build_request(
            request.method, url, headers=headers, content=content, timeout=timeout or self.client.timeout
        )
        sent = {k.lower() for k, _ in headers}
        for name in (b"accept", b"accept-encoding", b"user-agent"):  # httpx's defaults, not the client's
            if name not in sent:
                outgoing.headers.pop(name.decode(), None)
        try:
            upstream = await self.client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            self.directory.silent[node.node_id] = time.monotonic()
            message = f"node {node.node_id} at {node.address} did not answer: {exc!r}"[:300]
            raise NodeSilent(message, node.node_id) from None
        self.directory.silent.pop(node.node_id, None)
        return upstream

    # -- the gateway's own reads of every node ----------------------------------------------------------
    async def node_json(
        self, node: NodeEntry, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> object:
        r = await self.node_response(node, path, params, headers)
        try:
            return r.json()
        except ValueError:
            raise UpstreamError(f"node {node.node_id} answered {path} with something else than JSON") from None

    async def node_response(
        self, node: NodeEntry, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> httpx.Response:
        """A node's answer to a fan-out GET; its refusal raised as it said it (a client's mistake
        stays 4xx), a node that does not answer a 502 naming it."""
        try:
            r = await self.client.get(node.address + path, params=tuple(params), headers=headers, timeout=LIST_TIMEOUT)
        except httpx.TransportError as exc:
            raise UpstreamError(f"node {node.node_id} did not answer {path}: {exc!r}"[:300]) from None
        if r.status_code != 200:
            raise node_error(r.status_code, r.content, node)
        return r

    async def node_page(self, request: Request, node: NodeEntry, path: str) -> NodePage:
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        r = await self.node_response(node, path, request.query_params.multi_items(), headers)
        try:
            items = r.json()
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise UpstreamError(f"node {node.node_id} answered the list with something else than a list")
        running = r.headers.get("x-total-running", "")
        return NodePage(items, bool(r.headers.get("x-next-token")), int(running) if running.isdecimal() else None)
