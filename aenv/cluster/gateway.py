"""The gateway: one URL in front of many nodes. Stateless; run any number.

It mirrors the cluster directory in memory (``Mirror``) and forwards each request to a node,
streaming both ways:

- a request that names a sandbox (the path ``/sandboxes/{id}...`` or ``/v2/sandboxes/{id}...``,
  E2B's ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers, or a ``<port>-<id>.<domain>`` host) goes to
  the node that owns the sandbox; one whose node is gone (its lease expired) answers 404 naming
  that node;
- ``POST /sandboxes`` (a create) goes to the least loaded ready node; a node that refuses (429) or
  cannot be reached is skipped for the next one;
- anything else (templates, snapshots, the node-wide API) goes to the least loaded ready node.

Its own routes: ``GET /health`` (open), ``GET /nodes`` and ``GET /nodes/{id}``. Control-plane
requests need the cluster's API key at the gateway already (the nodes check it again); sandbox
traffic carries its own credentials (envd access tokens), which the owning node checks.
"""

from __future__ import annotations

import asyncio
import base64
import hmac
import json
import logging
import random
import re
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass
from datetime import datetime

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from aenv.api.app import PUBLIC_ROUTES, SIGNED_UPLOAD, sandbox_target
from aenv.cluster.entries import ID_PATTERN, NodeEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore
from aenv.errors import (
    AenvError,
    ClusterUnavailable,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PayloadTooLarge,
    SandboxNotFound,
    Unauthenticated,
    UpstreamError,
    error_body,
    from_body,
)

log = logging.getLogger("aenv.gateway")

SANDBOX_PATH = re.compile(r"^(?:/v2)?/sandboxes/(?P<id>[^/]+)(?:/.*)?$")
NODE_ID_HEADER = "x-aenv-node-id"
# Not forwarded either way (RFC 9110 7.6.1), plus what the forwarding sets itself.
HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "transfer-encoding",
        "upgrade",
        "host",
    }
)
MAX_CREATE_BODY = 1024 * 1024  # a create's JSON (the nodes refuse more than AENV_MAX_BODY_KB anyway)
MAX_CANDIDATES = 3  # nodes a create tries before giving up
# Sandboxes this gateway created, known from the create's answer until the node's entry arrives.
MAX_HINTS = 100_000
HINT_SECONDS = 60.0
STARTUP_WAIT = 10.0
QueryItems = list[tuple[str, str | int | float | bool | None]]
MAX_LIST_PAGES = 100  # of 100 sandboxes, from one node for one list
LIST_TIMEOUT = 30.0  # seconds the gateway waits for its first read of the directory


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    cluster: str
    api_key: str | None = None
    connect_timeout: float = 5.0  # to a node
    # Nodes are the cluster's own services and keep their own deadlines (agent calls, operations,
    # quiet streams pinged); a request's answer may stream for as long as its command runs.
    read_timeout: float | None = None


class Gateway:
    def __init__(self, settings: GatewaySettings, mirror: Mirror) -> None:
        self.settings = settings
        self.mirror = mirror
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.connect_timeout, read=settings.read_timeout, write=60.0, pool=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False,
        )
        # Creates this gateway placed since each node last reported its load (spreads a burst).
        self.placed: dict[str, list[float]] = {}
        # sandbox id -> node id from creates this gateway forwarded, until the directory has them
        self.hints: dict[str, tuple[str, float]] = {}

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- ASGI ---------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # WebSockets: a later slice
            await send({"type": "websocket.close", "code": 1011})
            return
        request = Request(scope, receive)
        try:
            response = await self.route(request)
        except AenvError as exc:
            response = JSONResponse(error_body(exc), status_code=exc.status)
        await response(scope, receive, send)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.mirror.start(wait=STARTUP_WAIT)
                except ClusterUnavailable as exc:
                    log.warning("%s; serving once it can be read", exc.message)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.mirror.stop()
                await self.mirror.store.close()
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def route(self, request: Request) -> Response | Relay:
        headers = {k.lower(): v for k, v in request.headers.items()}
        target = sandbox_target(headers)
        if isinstance(target, str):
            return JSONResponse({"code": 400, "message": target}, status_code=400)
        if target is not None:
            sandbox_id, port = target
            extra = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(port)}  # a host route, as headers
            return await self.forward(request, await self.owner(sandbox_id), extra)
        path, method = request.url.path, request.method
        if path == "/health" and method in ("GET", "HEAD"):
            return self.health()
        # The control plane needs the key here already: a lookup must not tell a stranger which
        # sandboxes exist. What the nodes open without it stays open (a signed upload's token is
        # the node's to check).
        if (method, path) not in PUBLIC_ROUTES and not (method == "PUT" and SIGNED_UPLOAD.fullmatch(path)):
            self.check_key(headers)
        if path == "/nodes" or path.startswith("/nodes/"):
            return self.nodes(path)
        match = SANDBOX_PATH.match(path)
        if match:
            return await self.forward(request, await self.owner(match["id"]))
        if (method, path) == ("POST", "/sandboxes"):
            return await self.create(request)
        if method == "GET" and path in ("/sandboxes", "/v2/sandboxes"):
            return await self.list_sandboxes(request, paginated=path == "/v2/sandboxes")
        return await self.forward(request, self.any_node())

    # -- own routes ---------------------------------------------------------------------------------------
    def health(self) -> Response:
        m = self.mirror
        body = {
            "status": "ok" if m.loaded.is_set() else "starting",
            "nodes": len(m.nodes),
            "sandboxes": len(m.sandboxes),
            "directoryConnected": m.connected,
            "directoryAge": round(time.monotonic() - m.synced_at, 3) if m.synced_at else None,
        }
        return JSONResponse(body, status_code=200 if m.loaded.is_set() else 503)

    def nodes(self, path: str) -> Response:
        if path in ("/nodes", "/nodes/"):
            return JSONResponse([_node_json(n) for n in sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)])
        node_id = path[len("/nodes/") :]
        node = self.mirror.nodes.get(node_id)
        if node is None:
            raise NotFound(f"no node {node_id[:80]!r} in the cluster")
        return JSONResponse(_node_json(node))

    def check_key(self, headers: dict[str, str]) -> None:
        key = self.settings.api_key
        if key and not hmac.compare_digest(headers.get("x-api-key", "").encode(), key.encode()):
            raise Unauthenticated("invalid or missing API key (X-API-Key header)")

    # -- where a request goes -------------------------------------------------------------------------
    async def owner(self, sandbox_id: str) -> NodeEntry:
        """The node serving ``sandbox_id``: from the mirror; a miss costs one read of etcd."""
        entry, node = self.mirror.owner(sandbox_id)
        if entry is not None:
            self.hints.pop(sandbox_id, None)  # the directory has it now
        else:
            hint = self.hints.pop(sandbox_id, None)
            if hint is not None and hint[0] in self.mirror.nodes and time.monotonic() - hint[1] < HINT_SECONDS:
                self.hints[sandbox_id] = hint
                return self.mirror.nodes[hint[0]]
            if ID_PATTERN.fullmatch(sandbox_id):
                read = await self.mirror.store.get_sandbox(sandbox_id)
                entry = read.entry if read is not None else None
                node = self.mirror.nodes.get(entry.node_id) if entry is not None else None
        if entry is None:
            raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])
        if node is None:
            raise SandboxNotFound(
                f"sandbox {sandbox_id} was on node {entry.node_id}, which left the cluster (lost)",
                sandbox_id=sandbox_id,
            )
        return node

    def candidates(self) -> list[NodeEntry]:
        """Ready nodes with room, least loaded first (ties broken at random)."""
        ready = [n for n in self.mirror.nodes.values() if not n.draining and n.room - self._recent(n) > 0]
        if not ready:
            if not self.mirror.loaded.is_set():
                raise ClusterUnavailable("the gateway has not read the cluster directory yet")
            raise LimitExceeded("no node in the cluster has room for another sandbox")
        return sorted(ready, key=lambda n: (self._load(n), random.random()))

    def any_node(self) -> NodeEntry:
        """The least loaded node, for what any node answers alike (templates, snapshots)."""
        nodes = [n for n in self.mirror.nodes.values() if not n.draining]
        if not nodes:
            raise ClusterUnavailable("no node in the cluster is up")
        return min(nodes, key=lambda n: (self._load(n), random.random()))

    def _recent(self, node: NodeEntry) -> int:
        times = [t for t in self.placed.get(node.node_id, []) if t > node.updated_at]
        self.placed[node.node_id] = times
        return len(times)

    def _load(self, node: NodeEntry) -> float:
        """E2B's measure, roughly: committed CPU per core, with creates in flight counted as running."""
        busy = node.running + node.starting + self._recent(node)
        per_cpu = (node.cpu_committed + self._recent(node)) / max(node.cpu_count, 1.0)
        return per_cpu + busy / max(node.max_sandboxes, 1)

    # -- lists ---------------------------------------------------------------------------------------------
    async def list_sandboxes(self, request: Request, *, paginated: bool) -> Response:
        """Every node's list, merged: v1 as one array; v2 ordered by start time (``order``) and
        paged here with the node's contract (``limit`` <= 100, ``nextToken`` / ``X-Next-Token``).
        A node that cannot answer fails the list (502 naming it): a partial list would tell a
        cleanup script that live sandboxes are gone."""
        query: QueryItems = [(k, v) for k, v in request.query_params.multi_items() if k not in ("limit", "nextToken")]
        limit, start = _page_of(request) if paginated else (0, 0)
        nodes = sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)
        lists = await asyncio.gather(*(self._node_list(request, n, query, paginated) for n in nodes))
        items = [item for answer in lists for item in answer]
        if not paginated:
            return JSONResponse(items)
        newest_first = request.query_params.get("order", "desc") != "asc"
        items.sort(key=_started_at, reverse=newest_first)
        headers = {}
        if start + limit < len(items):
            headers["X-Next-Token"] = base64.urlsafe_b64encode(str(start + limit).encode()).decode()
        return JSONResponse(items[start : start + limit], headers=headers)

    async def _node_list(
        self, request: Request, node: NodeEntry, query: QueryItems, paginated: bool
    ) -> list[dict[str, object]]:
        path = "/v2/sandboxes" if paginated else "/sandboxes"
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        items: list[dict[str, object]] = []
        token: str | None = None
        for _ in range(MAX_LIST_PAGES):
            params = query + ([("limit", "100")] if paginated else []) + ([("nextToken", token)] if token else [])
            try:
                r = await self.client.get(node.address + path, params=params, headers=headers, timeout=LIST_TIMEOUT)
            except httpx.TransportError as exc:
                raise UpstreamError(f"node {node.node_id} did not answer the list: {exc!r}"[:300]) from None
            if r.status_code != 200:
                raise _node_error(r, node)
            page = r.json()
            if not isinstance(page, list):
                raise UpstreamError(f"node {node.node_id} answered the list with something else than a list")
            items += page
            token = r.headers.get("x-next-token") if paginated else None
            if not token:
                return items
        raise UpstreamError(f"node {node.node_id} lists more than {MAX_LIST_PAGES * 100} sandboxes")

    # -- forwarding --------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body = await _read_bounded(request, MAX_CREATE_BODY)
        failures: list[str] = []
        for node in self.candidates()[:MAX_CANDIDATES]:
            self.placed.setdefault(node.node_id, []).append(time.time())
            try:
                upstream = await self._send(request, node, body=body)
            except UpstreamError as exc:  # not sent (connection refused, node gone): next node
                failures.append(f"{node.node_id}: {exc.message}")
                continue
            if upstream.status_code == 429:
                failures.append(f"{node.node_id}: at its limit")
                await upstream.aclose()
                continue
            try:
                content = b"".join([chunk async for chunk in upstream.aiter_raw()])
            finally:
                await upstream.aclose()
            self._remember_created(content, node)
            response = Response(content, upstream.status_code)
            response.raw_headers = _response_headers(upstream, node)  # the node's, as sent
            return response
        raise LimitExceeded("no node could take the sandbox: " + "; ".join(failures)[:1000])

    def _remember_created(self, content: bytes, node: NodeEntry) -> None:
        try:
            sandbox_id = json.loads(content).get("sandboxID")
        except (ValueError, AttributeError):
            return
        if isinstance(sandbox_id, str):
            now = time.monotonic()
            # the node's directory write may land after the client's next request: bridge it
            if len(self.hints) >= MAX_HINTS:
                self.hints = {k: v for k, v in self.hints.items() if now - v[1] < HINT_SECONDS}
            if len(self.hints) < MAX_HINTS:
                self.hints[sandbox_id] = (node.node_id, now)

    async def forward(self, request: Request, node: NodeEntry, extra: dict[str, str] | None = None) -> Relay:
        return Relay(await self._send(request, node, extra=extra), node)

    async def _send(
        self, request: Request, node: NodeEntry, *, body: bytes | None = None, extra: dict[str, str] | None = None
    ) -> httpx.Response:
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in HOP_HEADERS]
        headers += list((extra or {}).items())
        url = node.address + request.url.path + (f"?{request.url.query}" if request.url.query else "")
        content: bytes | AsyncIterator[bytes] | None = body
        if body is None and ("content-length" in request.headers or "transfer-encoding" in request.headers):
            content = _body(request)  # streamed as it arrives; httpx keeps the client's Content-Length
        outgoing = self.client.build_request(request.method, url, headers=headers, content=content)
        try:
            return await self.client.send(outgoing, stream=True)
        except httpx.TransportError as exc:
            raise UpstreamError(f"node {node.node_id} at {node.address} did not answer: {exc!r}"[:300]) from None


class Relay:
    """A node's response streamed to the client as it comes. The node's connection is closed
    however the relay ends: the body done, the client gone (even while the node is quiet, as
    during a long command), or the node failing mid-way (the client's response is cut short)."""

    def __init__(self, upstream: httpx.Response, node: NodeEntry) -> None:
        self.upstream = upstream
        self.node = node

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            start = {"status": self.upstream.status_code, "headers": _response_headers(self.upstream, self.node)}
            await send({"type": "http.response.start", **start})
            relay = asyncio.ensure_future(self._relay(send))
            gone = asyncio.ensure_future(_client_gone(receive))
            try:
                await asyncio.wait({relay, gone}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                gone.cancel()
                relay.cancel()
            if not relay.cancelled():
                relay.result()
        finally:
            await self.upstream.aclose()

    async def _relay(self, send: Send) -> None:
        try:
            async for chunk in self.upstream.aiter_raw():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except httpx.TransportError as exc:
            log.warning("node %s broke off a response: %r", self.node.node_id, exc)
            return  # no final body message: the server ends the connection, the client sees it cut
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _started_at(item: dict[str, object]) -> float:
    try:
        return datetime.fromisoformat(str(item.get("startedAt", ""))).timestamp()
    except ValueError:
        return 0.0


def _page_of(request: Request) -> tuple[int, int]:
    """(limit, offset) of a v2 list, checked as a node checks them."""
    raw_limit = request.query_params.get("limit", "100")
    if not raw_limit.isdecimal() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100")
    token = request.query_params.get("nextToken")
    start = 0
    if token:
        try:
            start = int(base64.urlsafe_b64decode(token.encode()).decode())
        except ValueError:
            raise InvalidRequest("nextToken is not valid") from None
        if start < 0:
            raise InvalidRequest("nextToken is not valid")
    return int(raw_limit), start


def _node_error(response: httpx.Response, node: NodeEntry) -> AenvError:
    """A node's refusal of a fan-out request, as the node said it (a client's mistake stays 4xx)."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code < 500 and isinstance(body, dict):
        return from_body(response.status_code, body)
    return UpstreamError(f"node {node.node_id} answered the list with {response.status_code}")


async def _client_gone(receive: Receive) -> None:
    """Returns once the client disconnects (the request's body has been read by then)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def _body(request: Request) -> AsyncIterator[bytes]:
    async for chunk in request.stream():
        if chunk:
            yield chunk


async def _read_bounded(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise PayloadTooLarge(f"the request body is larger than {limit // 1024} KiB")
    data = bytearray()
    async with asyncio.timeout(60):
        async for chunk in request.stream():
            data += chunk
            if len(data) > limit:
                raise PayloadTooLarge(f"the request body is larger than {limit // 1024} KiB")
    return bytes(data)


def _response_headers(upstream: httpx.Response, node: NodeEntry) -> list[tuple[bytes, bytes]]:
    """The node's headers, repeated ones kept (Set-Cookie), and which node answered."""
    headers = [(k, v) for k, v in upstream.headers.raw if k.lower().decode("latin-1") not in HOP_HEADERS]
    headers.append((NODE_ID_HEADER.encode(), node.node_id.encode()))
    return headers


def _node_json(node: NodeEntry) -> dict[str, object]:
    body = asdict(node)
    body["room"] = node.room
    return body


def build_gateway(settings: GatewaySettings) -> Gateway:
    return Gateway(settings, Mirror(ClusterStore.from_url(settings.cluster)))


async def serve_gateway(settings: GatewaySettings, *, host: str, port: int, keepalive: int = 610) -> None:
    import uvicorn

    config = uvicorn.Config(
        build_gateway(settings),
        host=host,
        port=port,
        lifespan="on",
        log_level="info",
        access_log=False,
        timeout_keep_alive=keepalive,  # longer than clients' pools keep a connection (see AENV_HTTP_KEEPALIVE)
        timeout_graceful_shutdown=5,
    )
    log.info("aenv gateway on http://%s:%d for %s", host, port, settings.cluster)
    await uvicorn.Server(config).serve()
