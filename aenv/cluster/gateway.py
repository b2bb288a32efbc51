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

Its own routes: ``GET /health`` and ``GET /metrics`` (open), ``GET /nodes`` and ``GET /nodes/{id}``.
Control-plane requests need the cluster's API key at the gateway already (the nodes check it
again); sandbox traffic carries its own credentials (envd access tokens), which the owning node
checks. A signed ``/files`` URL names no sandbox: the gateway finds the sandbox whose token signed
it with the cluster's secret (every node derives tokens from it), as a node does among its own.
Every answer about one sandbox carries ``x-aenv-node-id``, errors included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import random
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from aenv.api import connections, envd, listing
from aenv.api.app import PUBLIC_ROUTES, SIGNED_UPLOAD, sandbox_target
from aenv.api.listing import short_sandbox_id
from aenv.api.proxy import CLIENT_HOST_HEADER, TRAFFIC_TOKEN_HEADER, sandbox_gone, sandbox_paused
from aenv.api.signed import Signers
from aenv.api.signed import too_long as url_too_long
from aenv.cluster import forks, lists
from aenv.cluster.agent import OWNERSHIP_PATH
from aenv.cluster.drain import DRAIN_PATH, UNDRAIN_PATH
from aenv.cluster.entries import ID_PATTERN, ClusterConfig, NodeEntry, SandboxEntry, key_matches
from aenv.cluster.lists import ListQuery
from aenv.cluster.metrics import GatewayMetrics
from aenv.cluster.mirror import Mirror
from aenv.cluster.nodes import node_json
from aenv.cluster.placement import Placement
from aenv.cluster.store import ClusterStore, EtcdTls, EtcdUser
from aenv.cluster.websocket import NODE_ID_HEADER, refuse_websocket, relay_websocket
from aenv.config import DEFAULT_MAX_FORK
from aenv.dashboard import cluster as dashboard
from aenv.errors import (
    AenvError,
    ClusterUnavailable,
    Forbidden,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    PayloadTooLarge,
    SandboxNotFound,
    UpstreamError,
    error_body,
    error_headers,
    from_body,
)
from aenv.node import tokens
from aenv.node.create_ids import CREATE_ID_HEADER, create_id_of
from aenv.node.service import OWNER_FULL_HEADER
from aenv.teams import guard as team_guard
from aenv.teams.gateway import GatewayTeams
from aenv.teams.model import ALL_TEAMS, DEFAULT_TEAM, Principal

log = logging.getLogger("aenv.gateway")

SANDBOX_PATH = re.compile(r"^(?:/v2)?/sandboxes/(?P<id>[^/]+)(?:/.*)?$")
SANDBOX_INFO = re.compile(r"^/sandboxes/[^/]+$")
NODE_DRAIN = re.compile(r"/nodes/(?P<id>[^/]+)/drain")
NODE_UNDRAIN = re.compile(r"/nodes/(?P<id>[^/]+)/undrain")
NODE_ITSELF = re.compile(r"/nodes/(?P<id>[^/]+)")
SANDBOX_ANSWER = re.compile(r"^(?:/v2)?/sandboxes/[^/]+/(?:connect|resume)$")  # answered with the sandbox
# A template's or snapshot's own requests (E2B deletes a snapshot as a template).
ARTIFACT_PATH = re.compile(r"^/(?:v\d+/)?(?:templates|snapshots)/(?P<id>[^/]+)")
# Keys of the ASGI scope the gateway fills as it routes: the node a request is for (its id goes on
# every answer, errors included) and the route's kind (a metrics label).
NODE_SCOPE = "aenv.node_id"
TAKEOVER_SCOPE = "aenv.takeover"  # a resume sent to another node than the sandbox's lost one
ROUTE_SCOPE = "aenv.route"
MAX_INFO_BODY = 1024 * 1024  # a create's answer (the sandbox)
MAX_FORK_BODY = 16 * 1024 * 1024  # an answer the gateway reads whole (a fork's: every child's info)
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
# After an attempt that got no answer, how long a create keeps trying (longer than a node's lease:
# a dead node's claim on the create id goes with it) and how often.
CREATE_RETRY_SECONDS = 30.0
CREATE_RETRY_PAUSE = 0.5
# A node that answers 503 cluster_unavailable while etcd answers the gateway missed a few
# heartbeats (a leader election, a loaded host): its create, pause or resume is tried again for
# this long. When etcd does not answer the gateway either (no quorum), the 503 goes out at once.
STORE_BLIP_SECONDS = 10.0
QUORUM_CHECK_KEEP = 0.5  # seconds one check that etcd answers serves every request that asks
# Sandboxes this gateway created, known from the create's answer until the node's entry arrives.
MAX_HINTS = 100_000
HINT_SECONDS = 60.0
CATALOGUE_LAG = 8.0  # a node reads an unknown id's entry at once, and all entries at most every 3 s
SNAPSHOT_HINT_SECONDS = 600.0  # a snapshot's commit to the repository may take minutes
STARTUP_WAIT = 10.0
SETTLE_SECONDS = 5.0  # how long a list waits for a change made through this gateway, at most
LIST_SETTLE = 2.0  # seconds one list waits for the directory to show such changes
PRESENT, GONE = "present", "gone"
TOMBSTONE_SECONDS = 30 * 86400  # how long a lost node has to come back and learn its sandbox was killed
MAX_REPLAYED_BODY = 64 * 1024  # sandbox traffic's body kept to send again (an envd call's; not a stream)
MAX_FOLLOWS = 2  # times a request about a sandbox follows it to the node it moved to
KEEP_STREAM_SECONDS = 2.0  # how long a streamed body to a draining node's sandbox may take to be kept whole
LOST_WAIT = 30.0  # how long a kill waits for a node that does not answer to be counted lost
SILENT_SECONDS = 30.0  # a node that did not answer is placed on last for this long, unless it answers
WAKE_SECONDS = 60.0  # how long traffic waits for its sandbox to be resumed on another node
LIST_TIMEOUT = 30.0  # seconds the gateway waits for its first read of the directory


DOMAIN_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
DOMAIN = re.compile(rf"(?:{DOMAIN_LABEL}\.)*{DOMAIN_LABEL}")


def check_domain(domain: str) -> str:
    """A domain for domain mode: DNS labels (lower case), up to 200 characters (a sandbox's host
    puts ``<port>-<id>.`` before it)."""
    domain = domain.strip().lower().rstrip(".")
    if len(domain) > 200 or not DOMAIN.fullmatch(domain):
        raise InvalidRequest(f"--domain {domain[:80]!r} is not a DNS name (labels of a-z 0-9 -, dot-separated)")
    return domain


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    cluster: str
    api_key: str | None = None
    connect_timeout: float = 5.0  # to a node
    create_timeout: float = 120.0  # a create's answer; past it the create is tried again (same create id)
    ws_max_message_mb: int = 16  # the largest WebSocket message relayed either way (larger: 1009)
    # Nodes are the cluster's own services and keep their own deadlines (agent calls, operations,
    # quiet streams pinged); a request's answer may stream for as long as its command runs.
    read_timeout: float | None = None
    # Domain mode: clients reach the control plane at api.<domain> and a sandbox's port at
    # <port>-<id>.<domain>; sandboxes' answers name this domain (the SDKs build those hosts from it).
    domain: str | None = None
    tls_cert: str | None = None  # PEM files: the gateway serves HTTPS itself (else HTTP, e.g. behind a proxy)
    tls_key: str | None = None
    cluster_tls: EtcdTls | None = None  # the files for an etcds:// cluster (AENV_CLUSTER_CA, _CERT, _KEY)
    cluster_user: EtcdUser | None = None  # etcd's auth: AENV_CLUSTER_USER, AENV_CLUSTER_PASSWORD_FILE
    # The most children of one fork the gateway makes on other nodes (AENV_MAX_FORK, as the nodes'):
    # a fork asking for more is the source node's to answer (a 400), never spread.
    max_fork: int = field(default_factory=lambda: _max_fork(os.environ))


def _max_fork(env: Mapping[str, str]) -> int:
    raw = env.get("AENV_MAX_FORK", "")
    if not raw:
        return DEFAULT_MAX_FORK
    if not (raw.isascii() and raw.isdecimal() and int(raw) >= 1):
        raise ValueError(f"AENV_MAX_FORK must be a positive integer, not {raw[:40]!r}")
    return int(raw)


class Gateway:
    def __init__(self, settings: GatewaySettings, mirror: Mirror) -> None:
        self.settings = settings
        self.mirror = mirror
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.connect_timeout, read=settings.read_timeout, write=60.0, pool=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False,
        )
        self.placement = Placement()  # creates this gateway sent that the nodes' entries may not show yet
        # sandbox id -> node id from creates this gateway forwarded, until the directory has them
        self.hints: dict[str, tuple[str, float]] = {}
        # sandbox id -> what the directory should show after a change forwarded here (lists wait for it)
        self.expected: dict[str, tuple[str, float]] = {}
        # snapshot id -> node id for snapshots made through this gateway (creates from one go there)
        self.made_on: dict[str, tuple[str, float]] = {}
        self.building: dict[str, tuple[str, float]] = {}  # template id -> the node building it
        self.config: ClusterConfig | None = None  # read once a node has joined (it writes it)
        self.signers = Signers()  # who signed a /files URL that names no sandbox
        self._waking: dict[str, asyncio.Future[NodeEntry]] = {}  # auto-resumes on another node under way
        # node id -> when it last did not answer: placed on last, until its lease runs out or it answers
        self.silent: dict[str, float] = {}
        self.metrics = GatewayMetrics(mirror)
        # Set when this gateway's key turns out not to be the cluster's: it stops serving (exit 2).
        self.wrong_key = asyncio.Event()
        self._config_check: asyncio.Task[None] | None = None
        self._quorum: tuple[float, asyncio.Task[bool]] | None = None  # the last check that etcd answers
        self.teams = GatewayTeams(mirror.store, mirror, settings.api_key)  # keys, isolation, quotas (aenv/teams)

    async def aclose(self) -> None:
        await self.client.aclose()

    # -- ASGI ---------------------------------------------------------------------------------------
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        started = time.monotonic()

        async def counted(message: Message) -> None:
            if message["type"] in ("http.response.start", "websocket.accept", "websocket.http.response.start"):
                status = message.get("status", 101)
                self.metrics.observe(scope.get(ROUTE_SCOPE, "other"), status, time.monotonic() - started)
            await send(message)

        if scope["type"] == "websocket":
            scope[ROUTE_SCOPE] = "websocket"
            await self.websocket(scope, receive, counted)
            return
        if scope["type"] != "http":
            return
        request = Request(scope, receive)
        try:
            response = await self.route(request)
        except AenvError as exc:
            response = error_response(scope, exc)
        await response(scope, receive, counted)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.mirror.start(wait=STARTUP_WAIT)
                    await self.teams.start()
                    await self.cluster_config()
                except ClusterUnavailable as exc:
                    if self.wrong_key.is_set():
                        await self._close()  # an open watch and channel would hold the exit up
                        await send({"type": "lifespan.startup.failed", "message": exc.message})
                        return
                    log.warning("%s; serving once it can be read", exc.message)
                if self.config is None:  # etcd slow, or no node has joined yet: checked once it can be
                    self._config_check = asyncio.ensure_future(self._check_config())
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._config_check is not None:
                    self._config_check.cancel()
                await self.teams.stop()
                await self._close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _check_config(self) -> None:
        """Read the cluster's configuration until there is one: a gateway with another key than
        the cluster's must stop, whenever it finds out (etcd was slow at its start)."""
        while self.config is None and not self.wrong_key.is_set():
            with contextlib.suppress(ClusterUnavailable):
                await self.cluster_config()
            await asyncio.sleep(0.5)
        if self.wrong_key.is_set():
            log.error("this gateway's AENV_API_KEY is not the one the cluster was started with: stopping")

    async def _close(self) -> None:
        await self.mirror.stop()
        await self.mirror.store.close()
        await self.aclose()

    async def route(self, request: Request) -> Response | Relay:
        headers = {k.lower(): v for k, v in request.headers.items()}
        scope = request.scope
        path, method = request.url.path, request.method
        target = sandbox_target(headers)
        signed = False
        if target is None and path == "/files":
            too_long = url_too_long(request)
            if too_long is not None:
                return too_long  # before anything is hashed
            signer = await self.signer(request)
            target = (signer, envd.ENVD_PORT) if signer else None
            signed = signer is not None  # its URL's signature is the sandbox's token's
        if isinstance(target, str):
            return JSONResponse({"code": 400, "message": target}, status_code=400)
        if target is not None:
            sandbox_id, port = target
            scope[ROUTE_SCOPE] = "envd" if port == envd.ENVD_PORT else "port"
            extra = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(port)}  # a host route, as headers
            try:
                return await self.traffic(request, sandbox_id, Traffic(port, headers, signed), extra)
            except SandboxNotFound as exc:
                return traffic_gone(scope, sandbox_id, exc, paused=self._paused_here(sandbox_id))
        scope[ROUTE_SCOPE] = "own"
        if method in ("GET", "HEAD") and path == "/health":
            return self.health()
        if method in ("GET", "HEAD") and path == "/metrics":
            return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)
        if dashboard.is_dashboard(path):  # its pages are open, its data needs the key (it checks)
            return await dashboard.route(self, request)
        # The control plane needs the key here already: a lookup must not tell a stranger which
        # sandboxes exist. What the nodes open without it stays open (a signed upload's token is
        # the node's to check).
        who: Principal | None = None
        if (method, path) not in PUBLIC_ROUTES and not (method == "PUT" and SIGNED_UPLOAD.fullmatch(path)):
            who = await self.check_key(headers)
        if path == "/nodes" or path.startswith("/nodes/"):
            scope[ROUTE_SCOPE] = "nodes"
            if who is None or not who.admin:
                raise Forbidden("the cluster's nodes are the admin key's (AENV_API_KEY)")
            drained = NODE_DRAIN.fullmatch(path)
            if drained is not None and method == "POST":
                return await self.drain(request, drained["id"])
            undrained = NODE_UNDRAIN.fullmatch(path)
            if undrained is not None and method == "POST":
                return await self.undrain(request, undrained["id"])
            changed = NODE_ITSELF.fullmatch(path)
            if changed is not None and method == "POST":
                return await self.change_status(request, changed["id"])
            if method not in ("GET", "HEAD"):
                raise InvalidRequest(f"{method} {path[:100]} is not a route of the gateway", status=405)
            return self.nodes(path)
        if method == "GET" and path == "/sandboxes/metrics":  # several sandboxes, perhaps on several nodes
            scope[ROUTE_SCOPE] = "list"
            return await self.latest_metrics(request)
        match = SANDBOX_PATH.match(path)
        if match:
            scope[ROUTE_SCOPE] = "sandbox"
            self.teams.check_sandbox(match["id"])  # another team's: as one the gateway does not know
            if method == "GET" and SANDBOX_INFO.match(path):
                shown = await self.cluster_paused(match["id"])
                if shown is not None:
                    return shown
            if method == "DELETE" and SANDBOX_INFO.match(path):
                buried = await self.kill_lost(match["id"], scope)
                if buried is not None:
                    return buried
            resume = method == "POST" and bool(SANDBOX_ANSWER.match(path))
            node = await self.owner(match["id"], scope, resume=resume)
            if scope.get(TAKEOVER_SCOPE):
                entry, _ = self.mirror.owner(match["id"])
                others = self._takeover_candidates(entry, avoid=node.node_id) if entry is not None else []
                return await self.take_over(request, [node, *others], match["id"])
            if resume and _cluster_paused_at(self.mirror, match["id"], node):
                return await self.resume_or_move(request, node, match["id"])
            follow = match["id"]  # a drain may move it meanwhile: asked again where it went
            if method == "GET" and SANDBOX_INFO.match(path):
                try:
                    return await self.answered(request, node, _note_node, follow=follow)
                except NodeSilent:  # a durable pause is the cluster's: shown from its entry
                    shown = await self.cluster_paused(match["id"], silent=True)
                    if shown is None:
                        raise
                    return shown
            if method == "POST" and path.endswith("/fork"):
                return await self.fork(request, node, short_sandbox_id(match["id"]))
            if method == "POST" and path.endswith("/snapshots"):
                return await self.answered(request, node, self._note_snapshot, follow=follow)
            if self.settings.domain and method == "POST" and SANDBOX_ANSWER.match(path):
                answer = await self.answered(request, node)  # its "domain" is the gateway's
                self._note_change(method, path, match["id"], answer.status_code)
                return answer
            try:
                relay = await self.forward(request, node, follow=follow)
            except NodeSilent as exc:
                if not (method == "DELETE" and SANDBOX_INFO.match(path)):
                    raise
                return await self._kill_when_lost(request, match["id"], exc)
            self._note_change(method, path, match["id"], relay.upstream.status_code)
            return relay
        if method == "POST" and path in ("/sandboxes", "/v2/sandboxes"):
            scope[ROUTE_SCOPE] = "create"
            return await self.create(request)
        if method == "GET" and path in ("/sandboxes", "/v2/sandboxes"):
            scope[ROUTE_SCOPE] = "list"
            return await self.list_sandboxes(request, paginated=path == "/v2/sandboxes")
        if method == "GET" and path == "/snapshots":
            scope[ROUTE_SCOPE] = "list"
            return await self.list_snapshots(request)
        scope[ROUTE_SCOPE] = "other"
        if method == "POST" and path == "/v3/templates":
            return await self.answered(request, self.any_node(), self._note_template)
        return await self.forward(request, await self.artifact_node(request))

    async def traffic(self, request: Request, sandbox_id: str, traffic: Traffic, extra: dict[str, str]) -> Relay:
        """Sandbox traffic, to its node. A node that refused it before reading it (503
        ``cluster_unavailable``: the sandbox is being paused durably by a drain the mirror does
        not show yet, or the node missed etcd for a moment) gets it again once the mirror says
        where the sandbox is, within WAKE_SECONDS, while etcd answers the gateway. Only a request
        whose body is small enough to keep (or has none) is sent twice; a stream goes once."""
        declared = request.headers.get("content-length", "")
        replayable = _small_body(request, MAX_REPLAYED_BODY)
        body = await _read_bounded(request, MAX_REPLAYED_BODY) if replayable and declared else None
        stream: AsyncIterator[bytes] | None = None
        _, at = self.mirror.owner(sandbox_id)
        if not replayable and at is not None and at.draining:
            # A draining node's pause of it may be a move's, refused until it is done: a small
            # streamed body (an E2B command's start) is kept too, to send where it went.
            body, stream = await _kept_body(request, MAX_REPLAYED_BODY, KEEP_STREAM_SECONDS)
            replayable = body is not None
        until = time.monotonic() + WAKE_SECONDS
        woken: NodeEntry | None = None  # where the sandbox was just resumed (the mirror may lag)
        while True:
            node = woken or await self.owner(sandbox_id, request.scope, wake=traffic)
            woken = None
            request.scope[NODE_SCOPE] = node.node_id
            try:
                upstream = await self._send(request, node, body=body, extra=extra, traffic=True, stream=stream)
            except NodeSilent as exc:
                if not replayable or time.monotonic() >= until:
                    raise
                woken = await self._wake_from_silent(sandbox_id, traffic, exc)
                continue
            answer = await self._unless_blip(upstream, node, until) if replayable else upstream
            if answer is not None:
                return Relay(answer, node)

    async def _wake_from_silent(self, sandbox_id: str, traffic: Traffic, silent: NodeSilent) -> NodeEntry:
        """Traffic whose node did not answer: a durable pause it may wake (auto-resume, with
        memory, and the traffic has the sandbox's token where one is asked) is resumed on another
        node, as if that node were gone. Anything else is the silent node's: a sandbox that ran
        there is unreachable with it (E2B's "not found"); a pause that wakes nothing is one too."""
        entry, _ = self.mirror.owner(sandbox_id)
        if entry is None or entry.node_id != silent.node_id:
            raise silent  # moved meanwhile: the mirror's next look sends it there, once
        if not (_cluster_paused(entry) and _wakes(entry) and await self._may_wake(entry, traffic)):
            raise SandboxNotFound(
                f"sandbox {sandbox_id} is on node {silent.node_id}, which does not answer", sandbox_id=sandbox_id
            )
        return await self.wake_elsewhere(sandbox_id, owner_full=True, avoid=silent.node_id)

    def _paused_here(self, sandbox_id: str) -> bool:
        """Whether the cluster holds ``sandbox_id`` durably paused (its node lost or silent):
        traffic it does not wake is told so, as its node would tell it."""
        entry, _ = self.mirror.owner(sandbox_id)
        return entry is not None and _cluster_paused(entry)

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
            node = await self.owner(sandbox_id, scope, wake=Traffic(port, headers, signed=False))
        except SandboxNotFound as exc:
            gone = traffic_gone(scope, sandbox_id, exc, paused=self._paused_here(sandbox_id))
            await refuse_websocket(scope, send, gone)
            return
        except AenvError as exc:
            await refuse_websocket(scope, send, error_response(scope, exc))
            return
        routing = {"e2b-sandbox-id": sandbox_id, "e2b-sandbox-port": str(port)}
        if host := headers.get("host"):
            routing[CLIENT_HOST_HEADER] = host
        await relay_websocket(scope, receive, send, node, routing, self.settings.ws_max_message_mb * 2**20)

    async def artifact_node(self, request: Request) -> NodeEntry:
        """Where a node-wide request goes: the least loaded node, except where one node knows
        more than the others for now. A snapshot is on the node that made it at once and in the
        repository later: a list of one sandbox's snapshots goes to its node, a snapshot this
        gateway saw made to that node. A template build (its uploads, its status) stays on the
        node that started it."""
        path = request.url.path
        source = request.query_params.get("sandboxID")
        if path == "/snapshots" and source:
            with contextlib.suppress(SandboxNotFound, InvalidRequest):  # killed since: any node
                return await self.owner(short_sandbox_id(source), {})
        named = ARTIFACT_PATH.match(path)
        if named is not None:
            made = self.made_on.get(named["id"]) or self.building.get(named["id"])
            if made is not None and made[0] in self.mirror.nodes:
                return self.mirror.nodes[made[0]]
        return self.any_node()

    async def _may_wake(self, entry: SandboxEntry, traffic: Traffic) -> bool:
        """Whether ``traffic`` may resume the sandbox: it has the token its node would check first
        (nothing for an open sandbox). An entry that says neither way wakes nothing."""
        listed = entry.listed
        if not listed:
            return False
        protected = listed.get("secure") if traffic.port == envd.ENVD_PORT else listed.get("private")
        if not protected or traffic.signed:
            return True
        config = await self.cluster_config()
        if config is None:
            return False
        secret = config.secret.encode()
        if traffic.port == envd.ENVD_PORT:
            given, expected = traffic.headers.get("x-access-token", ""), tokens.access_token(secret, entry.sandbox_id)
        else:
            given = traffic.headers.get(TRAFFIC_TOKEN_HEADER, "")
            expected = tokens.traffic_token(secret, entry.sandbox_id)
        return bool(given) and hmac.compare_digest(given.encode(), expected.encode())

    async def cluster_config(self) -> ClusterConfig | None:
        """The cluster's secret and key digest (None until a node has joined and written them).
        A gateway started with another API key than the cluster's serves nothing."""
        if self.config is None:
            config = await self.mirror.store.get_config()
            if config is not None and self.settings.api_key and not key_matches(config, self.settings.api_key):
                self.wrong_key.set()
                raise ClusterUnavailable("this gateway's AENV_API_KEY is not the one the cluster was started with")
            self.config = config
        return self.config

    async def signer(self, request: Request) -> str | None:
        """The sandbox whose access token signed this /files URL, among every sandbox the gateway
        knows (aenv/api/signed.py: a short hash each, once; a URL found before costs one)."""
        if not request.query_params.get("signature"):
            return None
        config = await self.cluster_config()
        if config is None:
            return None
        return await self.signers.find(request, config.secret.encode(), self._knows, self._known)

    def _knows(self, sandbox_id: str) -> bool:
        return sandbox_id in self.mirror.sandboxes or sandbox_id in self.hints

    def _known(self) -> list[str]:
        return list(self.mirror.sandboxes) + [h for h in self.hints if h not in self.mirror.sandboxes]

    # -- own routes ---------------------------------------------------------------------------------------
    def health(self) -> Response:
        m = self.mirror
        ready = m.loaded.is_set() and not self.wrong_key.is_set()
        body = {
            "status": "ok" if ready else "wrong_api_key" if self.wrong_key.is_set() else "starting",
            "nodes": len(m.nodes),
            "sandboxes": len(m.sandboxes),
            "directoryConnected": m.connected,
            "directoryAge": round(time.monotonic() - m.synced_at, 3) if m.synced_at else None,
        }
        return JSONResponse(body, status_code=200 if ready else 503)

    def nodes(self, path: str) -> Response:
        """E2B's Node shape and aenv's own (aenv/cluster/nodes.py), from the mirror."""
        if path in ("/nodes", "/nodes/"):
            return JSONResponse([node_json(n) for n in sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)])
        return JSONResponse(node_json(self._node_named(path[len("/nodes/") :])))

    def _node_named(self, node_id: str) -> NodeEntry:
        node = self.mirror.nodes.get(node_id)
        if node is None:
            raise NotFound(f"no node {node_id[:80]!r} in the cluster")
        return node

    async def undrain(self, request: Request, node_id: str) -> Relay:
        """``POST /nodes/{id}/undrain``: the node takes new work again (a drain under way stops);
        its answer is the node as it is then."""
        node = self._node_named(node_id)
        body = await _read_bounded(request, 1024)
        request.scope[NODE_SCOPE] = node.node_id
        return Relay(await self._send(request, node, body=body, path=UNDRAIN_PATH), node)

    async def change_status(self, request: Request, node_id: str) -> Response:
        """E2B's ``POST /nodes/{id}`` (``{"status": "ready" | "draining"}``, 204): an undrain, or
        a drain without moves started and left to run (its progress: ``POST .../drain``)."""
        node = self._node_named(node_id)
        try:
            status = json.loads(await _read_bounded(request, 1024) or b"{}").get("status")
        except (ValueError, AttributeError):
            status = None
        if status not in ("ready", "draining"):
            raise InvalidRequest('a node\'s status change is {"status": "ready" | "draining"}')
        request.scope[NODE_SCOPE] = node.node_id
        path, body = (UNDRAIN_PATH, b"") if status == "ready" else (DRAIN_PATH, b'{"move": false}')
        length = {"content-length": str(len(body)), "content-type": "application/json"}  # not the client's body
        upstream = await self._send(request, node, body=body, path=path, extra=length)
        try:
            if upstream.status_code != 200:
                return _replay(upstream, await _read_upstream(upstream, MAX_INFO_BODY, node))
            async for _ in upstream.aiter_raw():  # the node took it (a drain's first line): it goes on alone
                break
        finally:
            await upstream.aclose()
        return Response(status_code=204, headers={NODE_ID_HEADER: node.node_id})

    async def drain(self, request: Request, node_id: str) -> Relay:
        """``POST /nodes/{id}/drain``: the node drains itself (aenv/cluster/drain.py); its progress
        streams back as NDJSON lines until the node is empty."""
        node = self.mirror.nodes.get(node_id)
        if node is None:
            raise NotFound(f"no node {node_id[:80]!r} in the cluster")
        body = await _read_bounded(request, 1024)
        request.scope[NODE_SCOPE] = node.node_id
        timeout = httpx.Timeout(self.settings.connect_timeout, read=None, write=60.0, pool=10.0)
        return Relay(await self._send(request, node, body=body, path=DRAIN_PATH, timeout=timeout), node)

    async def check_key(self, headers: dict[str, str]) -> Principal:
        """The request's team (aenv/teams/gateway.py), or 401."""
        if not self.settings.api_key:
            return Principal(DEFAULT_TEAM, admin=True, all_teams=True)
        return await self.teams.authenticate(headers)

    # -- where a request goes -------------------------------------------------------------------------
    async def owner(
        self, sandbox_id: str, scope: Scope, *, resume: bool = False, wake: Traffic | None = None
    ) -> NodeEntry:
        """The node serving ``sandbox_id``: from the mirror; a miss costs one read of etcd. Its id
        is noted in ``scope`` (for the answer's header) even when the node is gone. For a
        ``resume``, a sandbox durably paused on a node that is gone or draining goes to the best
        node with room, which takes it over from the repository. With ``wake`` (sandbox traffic),
        such a sandbox with auto-resume is resumed there first (see ``wake_elsewhere``), if the
        traffic carries what the sandbox's node would ask of it (a secure sandbox's access token,
        a private one's traffic token): a stranger wakes nothing, as on one node."""
        entry, node = self.mirror.owner(sandbox_id)
        if entry is not None:
            self.hints.pop(sandbox_id, None)  # the directory has it now
        else:
            hint = self.hints.pop(sandbox_id, None)
            if hint is not None and hint[0] in self.mirror.nodes and time.monotonic() - hint[1] < HINT_SECONDS:
                self.hints[sandbox_id] = hint
                scope[NODE_SCOPE] = hint[0]
                return self.mirror.nodes[hint[0]]
            if ID_PATTERN.fullmatch(sandbox_id):
                read = await self.mirror.store.get_sandbox(sandbox_id)
                entry = read.entry if read is not None else None
                node = self.mirror.nodes.get(entry.node_id) if entry is not None else None
        if entry is None:
            raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])
        scope[NODE_SCOPE] = entry.node_id
        if wake is not None and not await self._may_wake(entry, wake):
            wake = None  # forwarded as it is: the node answers its 401 or 403
        if (resume or (wake and _auto_resumes(entry))) and _becoming_durable(entry, node):
            # Being paused by a drain: wait for its pause to be durable (then it resumes elsewhere)
            # or for its move, rather than wake it where it is leaving.
            await self.mirror.wait_for(lambda m: not _becoming_durable(*m.owner(sandbox_id)), WAKE_SECONDS)
            entry, node = self.mirror.owner(sandbox_id)
            if entry is None:
                raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])
            scope[NODE_SCOPE] = entry.node_id
        if resume and _movable(entry, node):
            # a node with its runtime (its memory image's), holding its template's layers first
            node = self.candidates(entry.template_id or None, entry.runtime)[0]
            scope[NODE_SCOPE], scope[TAKEOVER_SCOPE] = node.node_id, True
        elif wake and _wakes(entry) and (_movable(entry, node) or _full_owner(entry, node)):
            node = await self.wake_elsewhere(sandbox_id, owner_full=node is not None)
            scope[NODE_SCOPE] = node.node_id
        if node is None:
            raise SandboxNotFound(
                f"sandbox {sandbox_id} was on node {entry.node_id}, which left the cluster (lost)",
                sandbox_id=sandbox_id,
            )
        return node

    async def wake_elsewhere(self, sandbox_id: str, *, owner_full: bool = False, avoid: str = "") -> NodeEntry:
        """Auto-resume through the gateway: traffic to a sandbox with auto-resume, durably paused
        on a node that is gone, draining or full, resumes it on the best node with room (a connect, so
        it takes the sandbox over as a client's connect would) and then proceeds there, waiting
        up to WAKE_SECONDS. Concurrent traffic joins one wake; a node that lost the claim to
        another (409, or 404 once it saw the move) sends the traffic to the winner. ``avoid``: its
        node, which did not answer (``owner_full`` then says so to the node that takes it over)."""
        waking = self._waking.get(sandbox_id)
        if waking is None:
            waking = asyncio.ensure_future(self._wake(sandbox_id, owner_full, avoid))
            self._waking[sandbox_id] = waking
            waking.add_done_callback(lambda _: self._waking.pop(sandbox_id, None))
        return await asyncio.shield(waking)

    async def _wake(self, sandbox_id: str, owner_full: bool, avoid: str = "") -> NodeEntry:
        headers = {"X-API-Key": self.settings.api_key or "", "X-Team-ID": ALL_TEAMS}  # whoever's it is
        if owner_full:
            headers[OWNER_FULL_HEADER] = "1"
        timeout = httpx.Timeout(self.settings.connect_timeout, read=WAKE_SECONDS, write=10.0, pool=10.0)
        failures = []
        entry, _ = self.mirror.owner(sandbox_id)
        source = (entry.template_id or None) if entry is not None else None  # its template's layers: fetched least
        runtime = entry.runtime if entry is not None else ""  # its memory image restores only there
        ranked = [n for n in self.candidates(source, runtime) if n.node_id != avoid]
        if owner_full and runtime:  # its owner is up: only where its memory image restores
            ranked = [n for n in ranked if n.runtime == runtime]
        owner = self.mirror.nodes.get(entry.node_id) if entry is not None else None
        if owner_full and not ranked and owner is not None and owner.node_id != avoid:
            return owner  # nowhere else to go: its owner's answer (429 while it is full)
        for node in ranked[:MAX_CANDIDATES]:
            url = f"{node.address}/sandboxes/{sandbox_id}/connect"
            try:
                r = await self.client.post(url, json={}, headers=headers, timeout=timeout)
            except httpx.TransportError as exc:
                failures.append(f"{node.node_id}: {exc!r}"[:200])
                continue
            if r.status_code in (200, 201):
                self._expect(sandbox_id, "running")
                return node
            read = await self.mirror.store.get_sandbox(sandbox_id)
            winner = self.mirror.nodes.get(read.entry.node_id) if read is not None else None
            if r.status_code in (404, 409) and winner is not None and not winner.draining:
                return winner
            failures.append(f"{node.node_id}: {r.status_code} {r.text[:200]}")
        raise UpstreamError(f"sandbox {sandbox_id} could not be resumed on another node: " + "; ".join(failures))

    async def kill_lost(self, sandbox_id: str, scope: Scope) -> Response | None:
        """``DELETE /sandboxes/{id}`` of a sandbox whose node is lost: its entry is replaced by a
        tombstone (one transaction, while the node is still gone), so the node kills its copy
        when it comes back instead of writing it again, and nobody takes a durable pause of it
        over. None when its node is alive (or came back, or another node took the sandbox
        meanwhile): the owner kills it."""
        entry, node = self.mirror.owner(sandbox_id)
        if entry is None or node is not None:
            return None
        read = await self.mirror.store.get_sandbox(sandbox_id)
        if read is None or read.entry.node_id in self.mirror.nodes:
            return None
        scope[NODE_SCOPE] = read.entry.node_id
        if not await self.mirror.store.bury_sandbox(read, TOMBSTONE_SECONDS):
            return None
        log.info("sandbox %s killed while its node %s is lost (tombstone)", sandbox_id, read.entry.node_id)
        self._expect(sandbox_id, GONE)
        return Response(status_code=204, headers={NODE_ID_HEADER: read.entry.node_id})

    async def _kill_when_lost(self, request: Request, sandbox_id: str, silent: NodeSilent) -> Response | Relay:
        """A kill whose node did not answer (killed, perhaps, its lease not run out yet): once the
        node is lost the kill is a tombstone, as for any lost node's sandbox. A node still
        registered after LOST_WAIT is asked once more."""
        node_id = silent.node_id
        await self.mirror.wait_for(lambda m: node_id not in m.nodes, LOST_WAIT)
        buried = await self.kill_lost(sandbox_id, request.scope)
        if buried is not None:
            return buried
        _, node = self.mirror.owner(sandbox_id)
        if node is None:
            raise silent
        return await self.forward(request, node)

    async def cluster_paused(self, sandbox_id: str, *, silent: bool = False) -> Response | None:
        """``GET /sandboxes/{id}`` of a sandbox durably paused on a node that is gone (or, with
        ``silent``, did not answer): it belongs to the cluster (any node resumes it), so it is
        shown paused, from its entry, naming its node. None for anything else (the owner
        answers, or the lost node's 404)."""
        entry, node = self.mirror.owner(sandbox_id)
        if entry is None or (node is not None and not silent) or not _cluster_paused(entry):
            return None
        config = await self.cluster_config()
        if config is None:
            return None
        item = lists.listed_item(entry, config.secret.encode(), self.settings.domain)
        item["nodeID"] = entry.node_id
        return JSONResponse(item, headers={NODE_ID_HEADER: entry.node_id})

    def candidates(self, source: str | None = None, runtime: str = "") -> list[NodeEntry]:
        """Ready nodes with room, best first for a create from ``source`` (see placement.py),
        those running ``runtime`` only while any has room."""
        ranked = self.placement.rank(list(self.mirror.nodes.values()), source, runtime)
        now = time.monotonic()
        quiet = {node_id for node_id, at in self.silent.items() if now - at < SILENT_SECONDS}
        if quiet:  # dead, perhaps, until its lease runs out: tried last
            ranked = [n for n in ranked if n.node_id not in quiet] + [n for n in ranked if n.node_id in quiet]
        if not ranked:
            if not self.mirror.loaded.is_set():
                raise ClusterUnavailable("the gateway has not read the cluster directory yet")
            raise LimitExceeded("no node in the cluster has room for another sandbox")
        return ranked

    def any_node(self) -> NodeEntry:
        """The least loaded node, for what any node answers alike (templates, snapshots)."""
        nodes = [n for n in self.mirror.nodes.values() if not n.draining]
        if not nodes:
            raise ClusterUnavailable("no node in the cluster is up")
        return min(nodes, key=lambda n: (self.placement.score(n), random.random()))

    # -- lists ---------------------------------------------------------------------------------------------
    async def list_sandboxes(self, request: Request, *, paginated: bool) -> Response:
        """A list, from the mirror while it follows etcd and every live node's entries carry their
        list items (see aenv/cluster/lists.py): no node is asked, so a slow or stopped one delays
        nothing. Otherwise (the watch down, a node of an older version, metadata too large for an
        entry) every node is asked. Changes made through this gateway show in the next list: it
        waits (briefly) for the directory to have them."""
        query = ListQuery.of(request, paginated=paginated, limit=_limit_of(request) if paginated else 0)
        if query.token:
            query.order.cursor(query.token)  # a bad token is the client's 400, whatever the nodes
        config = await self.cluster_config() if self.mirror.connected else None
        if config is None:
            return await self._list_from_nodes(request, query, config)
        await self._settle()
        entries = self._listable_entries()
        if entries is None:
            return await self._list_from_nodes(request, query, config)
        items, headers = lists.answer(query, entries, config.secret.encode(), self.settings.domain)
        return JSONResponse(items, headers=headers)

    def _listable_entries(self) -> list[SandboxEntry] | None:
        """The live nodes' sandboxes' entries and the durable pauses of lost nodes (they belong to
        the cluster), if each can be listed from its entry alone."""
        live = [
            e
            for e in self.mirror.sandboxes.values()
            if (e.node_id in self.mirror.nodes or _cluster_paused(e)) and team_guard.visible_team(e.team)
        ]
        return live if all(e.listable for e in live) else None

    def _expect(self, sandbox_id: str, outcome: str) -> None:
        """Lists wait for the directory to show ``outcome`` of a change this gateway forwarded
        (PRESENT, GONE or the sandbox's aenvState)."""
        _note(self.expected, sandbox_id, outcome, SETTLE_SECONDS)

    def _shown(self, sandbox_id: str, outcome: str) -> bool:
        entry = self.mirror.sandboxes.get(sandbox_id)
        if outcome == GONE:
            return entry is None
        return entry is not None and (outcome == PRESENT or entry.listed.get("aenvState") == outcome)

    async def _settle(self) -> None:
        now = time.monotonic()
        for sandbox_id, (outcome, at) in list(self.expected.items()):
            if now - at > SETTLE_SECONDS or self._shown(sandbox_id, outcome):
                del self.expected[sandbox_id]
        if self.expected:
            pending = list(self.expected.items())
            await self.mirror.wait_for(lambda _: all(self._shown(i, o) for i, (o, _) in pending), LIST_SETTLE)

    def _note_change(self, method: str, path: str, sandbox_id: str, status: int) -> None:
        if not 200 <= status < 300:
            return
        sandbox_id = short_sandbox_id(sandbox_id)  # answered 2xx: a valid id, perhaps with its client id
        if method == "DELETE" and SANDBOX_INFO.match(path):
            self._expect(sandbox_id, GONE)
        elif method == "POST" and path.endswith("/pause"):
            self._expect(sandbox_id, "paused")
        elif method == "POST" and path.endswith(("/resume", "/connect")):
            self._expect(sandbox_id, "running")

    async def _list_from_nodes(self, request: Request, query: ListQuery, config: ClusterConfig | None) -> Response:
        """Every node's list, merged. v1: the nodes' running sandboxes as one array. v2: one node's
        contract over the cluster. Each node is asked for its first ``limit`` items after the
        client's ``nextToken`` (a position, start time and id, which every node reads alike),
        with the client's filters and order; the merge serves ``limit`` of them in that order and
        names the last one's position as the next token. So sandboxes created or removed between
        two pages shift nothing (none served twice or skipped), and a page costs each node one
        request of at most ``limit`` items. ``X-Total-Running`` is the nodes' sum. A node that
        cannot answer fails the list (502 naming it): a partial list would tell a cleanup script
        that live sandboxes are gone. The durable pauses of lost nodes are listed from their
        entries (they belong to the cluster)."""
        paginated = query.paginated
        nodes = sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)
        path = "/v2/sandboxes" if paginated else "/sandboxes"
        order = (
            listing.SANDBOXES_OLDEST_FIRST
            if request.query_params.get("order") == "asc"
            else listing.SANDBOXES_NEWEST_FIRST
        )
        limit = _limit_of(request) if paginated else 0
        pages = await asyncio.gather(*(self._node_page(request, n, path) for n in nodes))
        for node, page in zip(nodes, pages, strict=True):
            for item in page.items:
                item["nodeID"] = node.node_id  # where each runs (the dashboard's Node column)
        items = [item for page in pages for item in page.items]
        self._stamp_domain(items)
        if config is not None:
            items += self._lost_but_paused(query, config)
        if not paginated:
            return JSONResponse(items)
        served, next_token = order.page(items, _position, limit, None)
        if next_token is None and served and any(page.more for page in pages):
            next_token = order.token(_position(served[-1]))  # a node has more after its full page
        headers = {"X-Next-Token": next_token} if next_token else {}
        running = [page.running for page in pages if page.running is not None]
        if running:
            headers["X-Total-Running"] = str(sum(running))
        return JSONResponse(served, headers=headers)

    def _lost_but_paused(self, query: ListQuery, config: ClusterConfig) -> list[dict[str, object]]:
        """List items of the sandboxes durably paused on nodes that are gone, that ``query`` shows."""
        secret, domain = config.secret.encode(), self.settings.domain
        return [
            lists.listed_item(e, secret, domain)
            for e in self.mirror.sandboxes.values()
            if e.node_id not in self.mirror.nodes
            and _cluster_paused(e)
            and e.listable
            and query.matches(e)
            and team_guard.visible_team(e.team)
        ]

    async def list_snapshots(self, request: Request) -> Response:
        """Every node's snapshots, merged as `_list_from_nodes` merges sandboxes: a snapshot is on
        the node that made it at once and on the others once its commit reached the repository,
        so one node's list can miss another's newest ones. Each node is asked for its first
        ``limit`` after the client's token, with the client's filters; one listed by several
        nodes is served once."""
        limit = _limit_of(request)
        token = request.query_params.get("nextToken")
        if token:
            listing.SNAPSHOTS.cursor(token)  # a bad token is the client's 400, whatever the nodes
        nodes = sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)
        if not nodes:
            raise ClusterUnavailable("no node in the cluster is up")
        pages = await asyncio.gather(*(self._node_page(request, n, "/snapshots") for n in nodes))
        unique: dict[str, dict[str, object]] = {}
        for item in (item for page in pages for item in page.items):
            known = unique.get(str(item.get("snapshotID")))
            if known is None or (item.get("committed") and not known.get("committed")):
                unique[str(item.get("snapshotID"))] = item
        served, next_token = listing.SNAPSHOTS.page(list(unique.values()), _snapshot_position, limit, None)
        if next_token is None and served and any(page.more for page in pages):
            next_token = listing.SNAPSHOTS.token(_snapshot_position(served[-1]))
        return JSONResponse(served, headers={"X-Next-Token": next_token} if next_token else {})

    async def latest_metrics(self, request: Request) -> Response:
        """E2B's metrics of several sandboxes: each owner node is asked for its own. The first
        is sent the client's whole list, so it checks it as one node would (its refusal is the
        answer); sandboxes no live node holds are left out, as a node leaves out unknown ones."""
        ids = [i for value in request.query_params.getlist("sandbox_ids") for i in value.split(",")]
        by_node: dict[str, list[str]] = {}
        for sandbox_id in ids:
            entry: SandboxEntry | None = None
            with contextlib.suppress(InvalidRequest):  # the first node refuses it, as one node would
                entry = self.mirror.sandboxes.get(short_sandbox_id(sandbox_id))
            if entry is not None and entry.node_id in self.mirror.nodes:
                by_node.setdefault(entry.node_id, []).append(sandbox_id)
        first = self.mirror.nodes[next(iter(by_node))] if by_node else self.any_node()
        asked = [(first, request.query_params.multi_items())]
        asked += [
            (self.mirror.nodes[node_id], [("sandbox_ids", ",".join(held))])
            for node_id, held in by_node.items()
            if node_id != first.node_id
        ]
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        answers = await asyncio.gather(
            *(self._node_json(node, "/sandboxes/metrics", params, headers) for node, params in asked)
        )
        merged: dict[str, object] = {}
        for answer in answers:
            sandboxes = answer.get("sandboxes") if isinstance(answer, dict) else None
            if isinstance(sandboxes, dict):
                merged.update(sandboxes)
        return JSONResponse({"sandboxes": merged})

    async def _node_json(
        self, node: NodeEntry, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> object:
        r = await self._node_response(node, path, params, headers)
        try:
            return r.json()
        except ValueError:
            raise UpstreamError(f"node {node.node_id} answered {path} with something else than JSON") from None

    async def _node_response(
        self, node: NodeEntry, path: str, params: list[tuple[str, str]], headers: dict[str, str]
    ) -> httpx.Response:
        """A node's answer to a fan-out GET; its refusal raised as it said it (a client's mistake
        stays 4xx), a node that does not answer a 502 naming it."""
        try:
            r = await self.client.get(node.address + path, params=params, headers=headers, timeout=LIST_TIMEOUT)
        except httpx.TransportError as exc:
            raise UpstreamError(f"node {node.node_id} did not answer {path}: {exc!r}"[:300]) from None
        if r.status_code != 200:
            raise _node_error(r.status_code, r.content, node)
        return r

    async def _node_page(self, request: Request, node: NodeEntry, path: str) -> NodePage:
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        r = await self._node_response(node, path, request.query_params.multi_items(), headers)
        try:
            items = r.json()
        except ValueError:
            items = None
        if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
            raise UpstreamError(f"node {node.node_id} answered the list with something else than a list")
        running = r.headers.get("x-total-running", "")
        return NodePage(items, bool(r.headers.get("x-next-token")), int(running) if running.isdecimal() else None)

    # -- forwarding --------------------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """Place a create, and try again on a node that does not answer (refused, cut off
        mid-way, dead, or slower than ``create_timeout``). Every attempt carries the same create
        id, which a node honours once: a node that already holds it answers with its sandbox, one
        told that another node holds it refuses (409 create_elsewhere) and the attempt goes to
        that node. So a create is neither lost nor made twice."""
        body = await _read_bounded(request, MAX_CREATE_BODY)
        create_id = create_id_of(request.headers) or uuid.uuid4().hex
        if not ID_PATTERN.fullmatch(create_id):
            raise InvalidRequest(f"{CREATE_ID_HEADER} must be 1-63 characters of A-Z a-z 0-9 . _ -")
        async with self.teams.admitted(request.query_params) as made:  # the team's quotas, cluster-wide
            upstream, content, node = await self._place_create(request, body, create_id)
            answer = _json_answer(upstream, content) if 200 <= upstream.status_code < 300 else None
            if isinstance(answer, dict) and isinstance(answer.get("sandboxID"), str):
                made["sandbox"] = answer["sandboxID"]
        if 200 <= upstream.status_code < 300:
            answer = _json_answer(upstream, content) if self.settings.domain else None
            if answer is not None:
                self._stamp_domain(answer)
                content = json.dumps(answer).encode()
        return _buffered(upstream, node, content)

    async def _place_create(
        self, request: Request, body: bytes, create_id: str, *, avoid: str = ""
    ) -> tuple[httpx.Response, bytes, NodeEntry]:
        """``create``'s attempts (its answer, read whole, and the node that gave it); ``avoid``: a
        node not to try (a fork's source node, full). The request's own path is ``POST /sandboxes``
        or a fork's, whose children are sent as creates to ``/sandboxes``."""
        deadline = time.monotonic() + self.settings.create_timeout + CREATE_RETRY_SECONDS
        timeout = httpx.Timeout(self.settings.connect_timeout, read=self.settings.create_timeout, write=60.0, pool=10.0)
        failures: list[str] = []
        unanswered = False  # an attempt may have started a create: keep trying until the deadline
        queue = self._create_candidates(body, avoid)
        not_found: tuple[httpx.Response, bytes, NodeEntry] | None = None
        incompatible: tuple[httpx.Response, bytes, NodeEntry] | None = None
        out_of_touch = False  # a node refused (503) because it could not reach etcd
        extra = {CREATE_ID_HEADER: create_id, "content-length": str(len(body)), "content-type": "application/json"}
        path = None if request.url.path in ("/sandboxes", "/v2/sandboxes") else "/sandboxes"
        blip_until = 0.0  # while a node that refused for etcd may just be catching up
        while time.monotonic() < deadline:
            if not queue:
                if not unanswered and not (time.monotonic() < blip_until and await self.etcd_answers()):
                    break
                await asyncio.sleep(CREATE_RETRY_PAUSE)
                queue = self._create_candidates(body, avoid)
                continue
            node = queue.pop(0)
            self.placement.sent(node.node_id)
            made = False
            try:
                upstream = await self._send(request, node, body=body, extra=extra, timeout=timeout, path=path)
                try:
                    content = await _read_upstream(upstream, MAX_INFO_BODY, node)
                finally:
                    await upstream.aclose()
                made = 200 <= upstream.status_code < 300
            except UpstreamError as exc:
                failures.append(f"{node.node_id}: {exc.message}")
                unanswered = True
                continue
            finally:
                self.placement.done(node.node_id, made=made, entry=self.mirror.nodes.get(node.node_id))
            if upstream.status_code == 429 and _error_code(content) == "quota_exceeded":
                return upstream, content, node  # the team's quota: the same on every node
            if upstream.status_code == 429:
                failures.append(f"{node.node_id}: at its limit")
                continue
            if upstream.status_code == 503 and _error_code(content) == "cluster_unavailable":
                # refused before it began: the node lost etcd for a moment (a saturated host)
                failures.append(f"{node.node_id}: out of touch with the cluster store")
                if not out_of_touch:
                    blip_until = time.monotonic() + STORE_BLIP_SECONDS
                out_of_touch = True
                continue
            if upstream.status_code == 422 and _error_code(content) == "image_incompatible":
                # a snapshot's memory image from another runsc or platform: a node like its maker may take it
                failures.append(f"{node.node_id}: another runtime than the snapshot's")
                incompatible = incompatible or (upstream, content, node)
                continue
            if upstream.status_code == 404 and _error_code(content) == "template_not_found":
                # a snapshot not yet in the repository is only on the node that made it: maybe the next
                not_found = not_found or (upstream, content, node)
                continue
            if upstream.status_code == 409 and _error_code(content) == "create_elsewhere":
                holder = await self._create_holder(create_id)
                failures.append(f"{node.node_id}: the create is node {holder}'s")
                unanswered = True
                if holder in self.mirror.nodes and holder != node.node_id:
                    queue.insert(0, self.mirror.nodes[holder])
                continue
            self._remember_created(content, node)
            return upstream, content, node
        summary = "; ".join(failures[-6:])[:1000]
        if not_found is not None and not unanswered:
            return not_found
        if incompatible is not None and not unanswered:
            return incompatible  # the node's 422, which says what to do
        if unanswered:
            raise UpstreamError(f"no node confirmed the create in time: {summary}")
        if out_of_touch:
            raise ClusterUnavailable("no node could take the sandbox: " + summary)
        raise LimitExceeded("no node could take the sandbox: " + summary)

    def _create_candidates(self, body: bytes, avoid: str = "") -> list[NodeEntry]:
        """The best nodes for the create (placement.py) but ``avoid``; first the one this gateway
        saw make the snapshot named, if any (its entry may not list it yet, nor the repository
        hold it)."""
        try:
            source = json.loads(body).get("templateID")
        except (ValueError, AttributeError):
            source = None
        source = source if isinstance(source, str) else None
        ranked = [n for n in self.candidates(source) if n.node_id != avoid]
        made = self.made_on.get(source) if source is not None else None
        maker = self.mirror.nodes.get(made[0]) if made is not None and made[0] != avoid else None
        if maker is not None and made is not None and time.monotonic() - made[1] < SNAPSHOT_HINT_SECONDS:
            ranked = [maker, *(n for n in ranked if n.node_id != maker.node_id)]  # a full one answers 429
        return ranked[:MAX_CANDIDATES]

    async def _create_holder(self, create_id: str) -> str:
        held = await self.mirror.store.get_create(create_id)
        return held.entry.node_id if held is not None else ""

    def _remember_created(self, content: bytes, node: NodeEntry) -> None:
        try:
            self._remember(json.loads(content).get("sandboxID"), node)
        except (ValueError, AttributeError):
            pass

    def _remember(self, sandbox_id: object, node: NodeEntry) -> None:
        """The node's directory write may land after the client's next request: bridge it."""
        if isinstance(sandbox_id, str):
            _note(self.hints, sandbox_id, node.node_id, HINT_SECONDS)
            self._expect(sandbox_id, PRESENT)

    async def resume_or_move(self, request: Request, node: NodeEntry, sandbox_id: str) -> Response | Relay:
        """A resume of a durable pause whose node is up: there, where its files are, if that node
        has room; one that answers 429 (full) gives it up to the best other node with room, which
        takes it over from the repository (the owner resumes only after taking the entry's
        durable mark off, the taker claims only while it is on: never both)."""
        body = await _read_bounded(request, MAX_CREATE_BODY)
        try:
            upstream = await self._send(request, node, body=body)
        except NodeSilent as exc:
            return await self._take_from_silent(request, exc, sandbox_id, body)
        entry, _ = self.mirror.owner(sandbox_id)
        if upstream.status_code == 429 and entry is not None and _cluster_paused(entry):
            others = self._takeover_candidates(entry, avoid=node.node_id, same_runtime=True)
            if others:
                await upstream.aclose()
                return await self.take_over(request, others, sandbox_id, body=body, owner_full=True)
        return await self._resumed(request, node, sandbox_id, upstream)

    async def _take_from_silent(
        self, request: Request, silent: NodeSilent, sandbox_id: str, body: bytes
    ) -> Response | Relay:
        """A resume of a durable pause whose node did not answer (killed, perhaps, with its lease
        not run out yet): the best other node takes it over from the repository, as from a lost
        node, rather than the client hearing the dead node's silence. The claim compares the
        entry's durable mark, which a live owner takes off before it resumes: if the owner was
        only slow, exactly one of the two has the sandbox, and the other answer leads to it."""
        read = await self.mirror.store.get_sandbox(sandbox_id)
        if read is None:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        entry = read.entry
        if entry.node_id != silent.node_id:  # taken over meanwhile (through another gateway)
            winner = self.mirror.nodes.get(entry.node_id)
            if winner is None:
                raise silent
            return await self._resumed(request, winner, sandbox_id, await self._send(request, winner, body=body))
        if not _cluster_paused(entry):
            raise silent  # its node began to resume it, then went silent: lost with that node
        others = self._takeover_candidates(entry, avoid=silent.node_id)
        if not others:
            raise ClusterUnavailable(
                f"node {silent.node_id} holding sandbox {sandbox_id} did not answer and no other node can take "
                "it over now; try again"
            )
        log.warning("node %s did not answer: sandbox %s is taken over elsewhere", silent.node_id, sandbox_id)
        return await self.take_over(request, others, sandbox_id, body=body, owner_full=True)

    def _takeover_candidates(self, entry: SandboxEntry, *, avoid: str, same_runtime: bool = False) -> list[NodeEntry]:
        """Nodes to take a durable pause over, best first: its memory image's runtime, then
        those holding its template's layers (see placement.py). With ``same_runtime`` only nodes
        whose runtime can restore its memory image (an owner that is up and full: better to wait
        for its room than to be told to reboot it elsewhere)."""
        try:
            ranked = self.candidates(entry.template_id or None, entry.runtime)
        except AenvError:
            return []  # none with room: the owner's own answer stands
        if same_runtime and entry.runtime:
            ranked = [n for n in ranked if n.runtime == entry.runtime]
        return [n for n in ranked if n.node_id != avoid][:MAX_CANDIDATES]

    async def take_over(
        self,
        request: Request,
        nodes: list[NodeEntry],
        sandbox_id: str,
        *,
        body: bytes | None = None,
        owner_full: bool = False,
    ) -> Response | Relay:
        """A resume of a durably paused sandbox sent to another node than its own (gone,
        draining or full) to take it over, trying the next of ``nodes`` while one is full too
        (429). If another node took it first (a resume through another gateway), the node
        answers 409 (it lost the claim) or 404 (it saw the move) and the resume goes to the
        winner, so both callers get the one instance."""
        if body is None:
            body = await _read_bounded(request, MAX_CREATE_BODY)
        extra = {OWNER_FULL_HEADER: "1"} if owner_full else None
        for i, node in enumerate(nodes):
            upstream = await self._send(request, node, body=body, extra=extra)
            if upstream.status_code == 429 and i + 1 < len(nodes):
                await upstream.aclose()
                continue
            break
        if upstream.status_code in (404, 409):
            read = await self.mirror.store.get_sandbox(sandbox_id)
            winner = self.mirror.nodes.get(read.entry.node_id) if read is not None else None
            if winner is not None and winner.node_id != node.node_id:
                await upstream.aclose()
                node, upstream = winner, await self._send(request, winner, body=body)
        return await self._resumed(request, node, sandbox_id, upstream)

    async def _resumed(
        self, request: Request, node: NodeEntry, sandbox_id: str, upstream: httpx.Response
    ) -> Response | Relay:
        request.scope[NODE_SCOPE] = node.node_id
        self._note_change("POST", request.url.path, sandbox_id, upstream.status_code)
        if self.settings.domain:
            return await self.answered(request, node, upstream=upstream)
        return Relay(upstream, node)

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
        sandboxes name the gateway's domain. ``follow``: see ``_send``."""
        upstream = upstream or await self._send(request, node, follow=follow)
        node = self.mirror.nodes.get(request.scope.get(NODE_SCOPE, ""), node)
        try:
            content = await _read_upstream(upstream, MAX_FORK_BODY, node)
        finally:
            await upstream.aclose()
        answer = _json_answer(upstream, content)
        if answer is None:
            return _buffered(upstream, node, content)
        if note is not None:
            note(answer, node)
        self._stamp_domain(answer)
        return _buffered(upstream, node, json.dumps(answer).encode())

    def _stamp_domain(self, answer: object) -> None:
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

    async def fork(self, request: Request, node: NodeEntry, sandbox_id: str) -> Response:
        """A fork, sent to the source's node. The children it had no room for (a per-child 429, or
        its 429 for the whole fork) are made on other nodes from a durable snapshot of the source
        (aenv/cluster/forks.py), when other nodes have room: one list back, each child in the
        order asked, with the node it runs on (``nodeID``), or its error."""
        body = await _read_bounded(request, MAX_CREATE_BODY)
        upstream = await self._send(request, node, body=body)
        try:
            content = await _read_upstream(upstream, MAX_FORK_BODY, node)
        finally:
            await upstream.aclose()
        fork = forks.asked(body, self.settings.max_fork)
        answer = _parsed(content) if "content-encoding" not in upstream.headers else None
        results = forks.results_of(upstream.status_code, answer, fork[0]) if fork is not None else None
        if results is None or fork is None:
            return await self.answered(request, node, self._note_fork, upstream=_replay(upstream, content))
        self._note_fork(results, node)
        for result in results:
            if isinstance(result.get("sandbox"), dict):
                result["sandbox"]["nodeID"] = node.node_id
        refused = [i for i, result in enumerate(results) if forks.refused_for_room(result)]
        if refused and any(n.node_id != node.node_id for n in self.placement.rank(list(self.mirror.nodes.values()))):
            extras = [fork[2][i] if fork[2] is not None else None for i in refused]
            made = await self._fork_elsewhere(request, node, sandbox_id, extras, fork[1])
            for i, result in zip(refused, made, strict=True):
                results[i] = result
        if upstream.status_code == 429 and not any("sandbox" in result for result in results):
            return _buffered(upstream, node, content)  # no room anywhere: the node's 429 as it was
        self._stamp_domain(results)
        return JSONResponse(results, status_code=201, headers={NODE_ID_HEADER: node.node_id})

    async def _fork_elsewhere(
        self,
        request: Request,
        node: NodeEntry,
        sandbox_id: str,
        extras: list[dict[str, str] | None],
        timeout: int | None,
    ) -> list[dict[str, object]]:
        """Children of ``sandbox_id`` (one per ``extras``: each its own metadata) made on nodes
        other than ``node`` from a durable snapshot of it, each as a create through the placement
        (``{"sandbox"}`` or ``{"error"}``). The snapshot stays: the children's layers are its
        layers (see docs/cluster.md)."""
        count = len(extras)
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        try:
            source = (await self._node_response(node, f"/sandboxes/{sandbox_id}", [], headers)).json()
            snapshot = await self._send(
                request,
                node,
                body=b'{"durable": true}',
                path=f"/sandboxes/{sandbox_id}/snapshots",
                extra={"content-type": "application/json", "content-length": "17"},
                timeout=httpx.Timeout(self.settings.connect_timeout, read=self.settings.create_timeout),
            )
            try:
                content = await _read_upstream(snapshot, MAX_INFO_BODY, node)
            finally:
                await snapshot.aclose()
            if snapshot.status_code != 201:
                raise _node_error(snapshot.status_code, content, node)
            snapshot_id = json.loads(content)["snapshotID"]
        except (AenvError, ValueError, KeyError, TypeError) as exc:
            message = exc.message if isinstance(exc, AenvError) else repr(exc)
            failed = UpstreamError(f"no room on node {node.node_id}; its snapshot for others failed: {message}"[:500])
            return [{"error": error_body(failed)} for _ in range(count)]
        _note(self.made_on, snapshot_id, node.node_id, SNAPSHOT_HINT_SECONDS)
        bodies = [json.dumps(forks.child_body(source, snapshot_id, timeout, extra)).encode() for extra in extras]
        return list(await asyncio.gather(*(self._fork_child(request, child, node) for child in bodies)))

    async def _fork_child(self, request: Request, body: bytes, source_node: NodeEntry) -> dict[str, object]:
        """One child made elsewhere. The snapshot is committed, but a node reads the repository's
        new entries at most every few seconds: a node that does not know it yet is asked again."""
        create_id = uuid.uuid4().hex
        deadline = time.monotonic() + CATALOGUE_LAG
        try:
            while True:
                upstream, content, node = await self._place_create(request, body, create_id, avoid=source_node.node_id)
                if upstream.status_code != 404 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
        except AenvError as exc:
            return {"error": error_body(exc)}
        answer = _parsed(content)
        if upstream.status_code != 201 or not isinstance(answer, dict):
            return {"error": forks.error_of(upstream.status_code, content)}
        answer["nodeID"] = node.node_id
        return {"sandbox": answer}

    def _note_fork(self, answer: object, node: NodeEntry) -> None:
        """A fork's children live on the source's node: known there before the directory says so."""
        for result in answer if isinstance(answer, list) else []:
            child = result.get("sandbox") if isinstance(result, dict) else None
            if isinstance(child, dict):
                self._remember(child.get("sandboxID"), node)

    def _note_template(self, answer: object, node: NodeEntry) -> None:
        template_id = answer.get("templateID") if isinstance(answer, dict) else None
        if isinstance(template_id, str):
            _note(self.building, template_id, node.node_id, SNAPSHOT_HINT_SECONDS)

    def _note_snapshot(self, answer: object, node: NodeEntry) -> None:
        """A snapshot is on its node at once, in the repository later: creates from it go there."""
        snapshot_id = answer.get("snapshotID") if isinstance(answer, dict) else None
        if isinstance(snapshot_id, str):
            _note(self.made_on, snapshot_id, node.node_id, SNAPSHOT_HINT_SECONDS)

    async def forward(
        self, request: Request, node: NodeEntry, extra: dict[str, str] | None = None, *, follow: str | None = None
    ) -> Relay:
        request.scope[NODE_SCOPE] = node.node_id
        upstream = await self._send(request, node, extra=extra, follow=follow)
        return Relay(upstream, self.mirror.nodes.get(request.scope[NODE_SCOPE], node))

    async def _send(
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
        (within STORE_BLIP_SECONDS): the node refused before doing anything. A request about
        sandbox ``follow`` (the control plane's) that its node answers 404 while etcd names
        another node (it moved a moment ago: a drain, a takeover) goes there. Sandbox ``traffic``
        is never one of those, whatever its path (the app in the sandbox chose it). ``stream``:
        the request's body as read so far and the rest (sent once), where ``body`` is None."""
        patient = (
            not traffic and request.method == "POST" and OWNERSHIP_PATH.fullmatch(path or request.url.path) is not None
        )
        following = follow is not None and not traffic and stream is None and _small_body(request)
        if (patient or following) and body is None:
            body = await _read_bounded(request, MAX_CREATE_BODY)  # small, and needed again for a retry
        until = time.monotonic() + STORE_BLIP_SECONDS
        moves = 0
        while True:
            upstream = await self._send_once(request, node, body, extra or {}, timeout, path, stream)
            if following and follow is not None and upstream.status_code == 404 and moves < MAX_FOLLOWS:
                moved_to = await self._moved_to(follow, node)
                if moved_to is not None:
                    await upstream.aclose()
                    node, moves = moved_to, moves + 1
                    request.scope[NODE_SCOPE] = node.node_id
                    continue
            answer = await self._unless_blip(upstream, node, until) if patient else upstream
            if answer is not None:
                return answer

    async def _moved_to(self, sandbox_id: str, node: NodeEntry) -> NodeEntry | None:
        """The node etcd says holds ``sandbox_id`` now, if another than ``node`` (which said it
        has no such sandbox) and up."""
        try:
            read = await self.mirror.store.get_sandbox(short_sandbox_id(sandbox_id))
        except (ClusterUnavailable, InvalidRequest):
            return None
        if read is None or read.entry.node_id == node.node_id:
            return None
        return self.mirror.nodes.get(read.entry.node_id)

    async def _unless_blip(self, upstream: httpx.Response, node: NodeEntry, until: float) -> httpx.Response | None:
        """``upstream`` to pass on (read whole and replayed if it was a 503), or None after a
        pause when it is the node's refusal for missing etcd a moment (503 ``cluster_unavailable``)
        and the request is worth sending again: before ``until`` and while etcd answers here."""
        if upstream.status_code != 503:
            return upstream
        try:
            content = await _read_upstream(upstream, MAX_INFO_BODY, node)
        finally:
            await upstream.aclose()
        if _error_code(content) != "cluster_unavailable" or time.monotonic() >= until:
            return _replay(upstream, content)
        if not await self.etcd_answers():
            return _replay(upstream, content)
        await asyncio.sleep(CREATE_RETRY_PAUSE)
        return None

    async def etcd_answers(self) -> bool:
        """Whether etcd has a leader and answers this gateway now (one read, shared by every
        request asking within QUORUM_CHECK_KEEP seconds)."""
        now = time.monotonic()
        if self._quorum is None or now - self._quorum[0] > QUORUM_CHECK_KEEP:
            self._quorum = (now, asyncio.create_task(self._read_config_answers()))
        return await asyncio.shield(self._quorum[1])

    async def _read_config_answers(self) -> bool:
        try:
            await self.mirror.store.get_config()
        except ClusterUnavailable:
            return False
        except Exception:  # noqa: BLE001 - etcd answered, with what this gateway cannot read
            log.warning("reading the cluster configuration", exc_info=True)
        return True

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
            content = _body(request)  # streamed as it arrives; httpx keeps the client's Content-Length
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
            self.silent[node.node_id] = time.monotonic()
            message = f"node {node.node_id} at {node.address} did not answer: {exc!r}"[:300]
            raise NodeSilent(message, node.node_id) from None
        self.silent.pop(node.node_id, None)
        return upstream


class NodeSilent(UpstreamError):
    """A node did not answer a request sent to it (refused, reset, cut off mid-way or too slow):
    dead, perhaps, while its lease has not run out yet."""

    def __init__(self, message: str, node_id: str) -> None:
        super().__init__(message)
        self.node_id = node_id


@dataclass(frozen=True, slots=True)
class Traffic:
    """Sandbox traffic that may wake a paused sandbox: its port, its (lowercased) headers, and
    whether a signed URL already proved it holds the sandbox's token."""

    port: int
    headers: dict[str, str]
    signed: bool = False


@dataclass(frozen=True, slots=True)
class NodePage:
    """One node's answer to a list: its items, whether it has more, its X-Total-Running."""

    items: list[dict[str, object]]
    more: bool
    running: int | None


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
                # A cancelled task is done only once it has run its cancellation: wait for both.
                await asyncio.gather(relay, gone, return_exceptions=True)
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
            # No final body message: the server ends the connection, with a reset as the node's
            # (the SDKs read a reset, not a cut body, as a connection lost with the sandbox).
            connections.reset_on_close()
            return
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _cluster_paused(entry: SandboxEntry) -> bool:
    """Paused and in the snapshot repository: any node may resume it (its own node or not)."""
    return entry.durable and entry.state == "paused"


def _cluster_paused_at(mirror: Mirror, sandbox_id: str, node: NodeEntry) -> bool:
    """Durably paused, by the mirror, on ``node`` (its owner, up)."""
    entry, owner = mirror.owner(sandbox_id)
    return entry is not None and owner is not None and owner.node_id == node.node_id and _cluster_paused(entry)


def _movable(entry: SandboxEntry, node: NodeEntry | None) -> bool:
    """A resume of this sandbox goes to another node: it is durably paused on a node that is gone
    or draining (which takes no new work)."""
    return _cluster_paused(entry) and (node is None or node.draining)


def _full_owner(entry: SandboxEntry, node: NodeEntry | None) -> bool:
    """Durably paused on a node that is up but, by its last entry, has no room to resume it."""
    return _cluster_paused(entry) and node is not None and not node.draining and node.room <= 0


def _becoming_durable(entry: SandboxEntry | None, node: NodeEntry | None) -> bool:
    """Paused (or being paused) on a draining node, its pause not durable yet but to be."""
    return (
        entry is not None
        and node is not None
        and node.draining
        and entry.state == "paused"
        and not entry.durable
        and "durableReason" not in entry.listed
    )


def _auto_resumes(entry: SandboxEntry) -> bool:
    lifecycle = entry.listed.get("lifecycle")
    return isinstance(lifecycle, dict) and lifecycle.get("autoResume") is True


def _wakes(entry: SandboxEntry) -> bool:
    """Whether traffic resumes this paused sandbox: auto-resume, and paused with its memory (a
    resume without it is a reboot, which only an explicit connect does)."""
    return _auto_resumes(entry) and entry.listed.get("pausedWithMemory") is True


def _note_node(answer: object, node: NodeEntry) -> None:
    """``GET /sandboxes/{id}`` says which node serves the sandbox."""
    if isinstance(answer, dict):
        answer["nodeID"] = node.node_id


def _json_answer(upstream: httpx.Response, content: bytes) -> object | None:
    """A node's successful JSON answer, parsed; None for anything else (passed on as it came)."""
    if not 200 <= upstream.status_code < 300 or "content-encoding" in upstream.headers:
        return None
    try:
        answer: object = json.loads(content)
    except ValueError:
        return None
    return answer if isinstance(answer, dict | list) else None


def _note(table: dict[str, tuple[str, float]], key: str, node_id: str, keep: float) -> None:
    """Note ``key`` -> ``node_id`` in a table bounded in size (MAX_HINTS) and age (``keep``)."""
    now = time.monotonic()
    if len(table) >= MAX_HINTS:
        for old in [k for k, (_, at) in table.items() if now - at >= keep]:
            del table[old]
    if len(table) < MAX_HINTS:
        table[key] = (node_id, now)


def _parsed(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return None


def _small_body(request: Request, limit: int = MAX_CREATE_BODY) -> bool:
    """Whether the request's body (if any) says it is small enough to keep for sending again."""
    declared = request.headers.get("content-length", "")
    return "transfer-encoding" not in request.headers and (
        not declared or (declared.isdecimal() and int(declared) <= limit)
    )


async def _kept_body(request: Request, limit: int, within: float) -> tuple[bytes | None, AsyncIterator[bytes] | None]:
    """A streamed body (no length given) read whole, if it ends within ``limit`` bytes and
    ``within`` seconds: (it, None). Else (None, the body as a stream: what was read, then the
    rest), for a client that streams for longer (its request goes once, as it comes)."""
    data = bytearray()
    more = True
    deadline = time.monotonic() + within
    while more and len(data) <= limit:
        try:  # a receive given up on keeps what arrives for the next one (uvicorn's cycle)
            message = await asyncio.wait_for(request.receive(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            break
        if message["type"] != "http.request":
            raise ClientDisconnect()
        data += message.get("body", b"")
        more = bool(message.get("more_body", False))
    if not more:
        return bytes(data), None

    async def rest() -> AsyncIterator[bytes]:
        if data:
            yield bytes(data)
        while True:
            message = await request.receive()
            if message["type"] != "http.request":
                raise ClientDisconnect()
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    return None, rest()


def _replay(upstream: httpx.Response, content: bytes) -> httpx.Response:
    """A node's answer already read whole, as a response to stream (relay or read) again."""
    return httpx.Response(upstream.status_code, headers=upstream.headers, stream=httpx.ByteStream(content))


def _error_code(content: bytes) -> str:
    try:
        body = json.loads(content)
    except ValueError:
        return ""
    return str(body.get("error_code", "")) if isinstance(body, dict) else ""


def _position(item: dict[str, object]) -> listing.Position:
    """Where a node's listed sandbox stands in a list's order (its start time and id)."""
    try:
        return listing.Position(listing.parse_time(str(item.get("startedAt")), "startedAt"), str(item.get("sandboxID")))
    except InvalidRequest:
        raise UpstreamError("a node listed a sandbox without a valid startedAt") from None


def _snapshot_position(item: dict[str, object]) -> listing.Position:
    """Where a node's listed snapshot stands in the snapshots' order (its creation time and id)."""
    try:
        return listing.Position(
            listing.parse_time(str(item.get("createdAt")), "createdAt"), str(item.get("snapshotID"))
        )
    except InvalidRequest:
        raise UpstreamError("a node listed a snapshot without a valid createdAt") from None


def _limit_of(request: Request) -> int:
    """A v2 list's page size, checked as a node checks it."""
    raw_limit = request.query_params.get("limit", "100")
    if not raw_limit.isdecimal() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100")
    return int(raw_limit)


def _node_error(status: int, content: bytes, node: NodeEntry) -> AenvError:
    """A node's refusal of a fan-out request, as the node said it (a client's mistake stays 4xx)."""
    body = _parsed(content)
    if status < 500 and isinstance(body, dict):
        return from_body(status, body)
    return UpstreamError(f"node {node.node_id} answered the list with {status}")


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


def traffic_gone(scope: Scope, sandbox_id: str, exc: SandboxNotFound, *, paused: bool = False) -> JSONResponse:
    """Sandbox traffic for a sandbox the cluster does not have running: the node's answer (E2B's
    edge's: 502, which the SDKs read as "not running"), naming the node when it was on one that
    left; for a durable pause it does not wake, that it is paused and how to resume it (as a
    node says of its own pauses)."""
    response = sandbox_gone(sandbox_id[:80])
    node_id = scope.get(NODE_SCOPE)
    if paused:
        response = sandbox_paused(sandbox_id[:80], headers={NODE_ID_HEADER: node_id} if node_id else None)
    elif node_id:
        response = JSONResponse(
            {"sandboxId": sandbox_id, "message": f"The sandbox was not found: {exc.message}", "code": 502},
            status_code=502,
            headers={NODE_ID_HEADER: node_id},
        )
    return response


def error_response(scope: Scope, exc: AenvError) -> JSONResponse:
    """An error as JSON, naming the node the request was for when the gateway got that far."""
    headers = error_headers(exc)
    node_id = scope.get(NODE_SCOPE)
    if node_id:
        headers[NODE_ID_HEADER] = node_id
    return JSONResponse(error_body(exc), status_code=exc.status, headers=headers)


async def _read_upstream(upstream: httpx.Response, limit: int, node: NodeEntry) -> bytes:
    """A node's whole (small) answer; one that breaks off or runs past ``limit`` is a 502."""
    data = bytearray()
    try:
        async for chunk in upstream.aiter_raw():
            data += chunk
            if len(data) > limit:
                raise UpstreamError(f"node {node.node_id} answered with more than {limit // 1024} KiB")
    except httpx.TransportError as exc:
        raise UpstreamError(f"node {node.node_id} broke off its answer: {exc!r}"[:300]) from None
    return bytes(data)


def _buffered(upstream: httpx.Response, node: NodeEntry, content: bytes) -> Response:
    """A node's answer, read whole (and maybe changed), with its headers."""
    response = Response(content, upstream.status_code)
    headers = [(k, v) for k, v in _response_headers(upstream, node) if k.lower() != b"content-length"]
    response.raw_headers = [*headers, (b"content-length", str(len(content)).encode())]
    return response


def _response_headers(upstream: httpx.Response, node: NodeEntry) -> list[tuple[bytes, bytes]]:
    """The node's headers, repeated ones kept (Set-Cookie), and which node answered."""
    headers = [(k, v) for k, v in upstream.headers.raw if k.lower().decode("latin-1") not in HOP_HEADERS]
    headers.append((NODE_ID_HEADER.encode(), node.node_id.encode()))
    return headers


def build_gateway(settings: GatewaySettings) -> Gateway:
    return Gateway(
        settings, Mirror(ClusterStore.from_url(settings.cluster, tls=settings.cluster_tls, user=settings.cluster_user))
    )


async def serve_gateway(settings: GatewaySettings, *, host: str, port: int, keepalive: int = 610) -> None:
    import uvicorn

    from aenv.config import Settings

    gateway = build_gateway(settings)
    limits = connections.HttpLimits.of(Settings())  # AENV_HTTP_*, read as a node reads them
    connections.raise_open_files_limit()  # every connection is a file descriptor
    config = uvicorn.Config(
        connections.OwnHeaders(gateway),  # one date and server header per answer (the node's, relayed)
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        ws_max_size=settings.ws_max_message_mb * 2**20,  # what a client may send a sandbox's port
        http=connections.protocol_with(limits),  # bounds on request heads; resets as the nodes do
        date_header=False,
        server_header=False,
        host=host,
        port=port,
        lifespan="on",
        log_level="info",
        access_log=False,
        timeout_keep_alive=keepalive,  # longer than clients' pools keep a connection (see AENV_HTTP_KEEPALIVE)
        timeout_graceful_shutdown=5,
    )
    scheme = "https" if settings.tls_cert else "http"
    log.info("aenv gateway on %s://%s:%d for %s", scheme, host, port, settings.cluster)
    if settings.domain:
        log.info("domain mode: api.%s is the control plane, <port>-<id>.%s a sandbox", settings.domain, settings.domain)
    server = uvicorn.Server(config)

    async def stop_on_wrong_key() -> None:
        await gateway.wrong_key.wait()
        server.should_exit = True

    watch = asyncio.ensure_future(stop_on_wrong_key())
    try:
        await server.serve()
    finally:
        watch.cancel()
    if gateway.wrong_key.is_set():
        raise SystemExit(2)
