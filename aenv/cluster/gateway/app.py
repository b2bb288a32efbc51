"""The gateway as an ASGI app: it builds its parts, each given what it needs (the settings, the
shared ``Directory``, one httpx client, the parts it calls), and routes each request: sandbox
traffic to ``SandboxTraffic``, the rest through the route table (routes.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time

import httpx
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Message, Receive, Scope, Send

from aenv.api.app import PUBLIC_ROUTES, SIGNED_UPLOAD, VOLUME_CONTENT
from aenv.cluster.entries import ClusterConfig
from aenv.cluster.gateway.admin import NodeRoutes
from aenv.cluster.gateway.artifacts import Artifacts
from aenv.cluster.gateway.creates import Creates
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.forking import Forks
from aenv.cluster.gateway.listings import Lists
from aenv.cluster.gateway.owners import Owners
from aenv.cluster.gateway.relay import ROUTE_SCOPE, Relay, error_response
from aenv.cluster.gateway.routes import ADMIN, OPEN, find, table
from aenv.cluster.gateway.sandboxes import SandboxRoutes
from aenv.cluster.gateway.settings import CLOSE_SECONDS, STARTUP_DEADLINE, STARTUP_WAIT, GatewaySettings
from aenv.cluster.gateway.takeover import TakeOvers
from aenv.cluster.gateway.traffic import SandboxTraffic
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.metrics import GatewayMetrics
from aenv.cluster.mirror import Mirror
from aenv.dashboard import cluster as cluster_dashboard
from aenv.errors import AenvError, ClusterUnavailable, Forbidden
from aenv.teams.gateway import GatewayTeams
from aenv.teams.model import DEFAULT_TEAM, Principal

log = logging.getLogger("aenv.gateway")


class Gateway:
    def __init__(self, settings: GatewaySettings, mirror: Mirror) -> None:
        self.settings = settings
        self.mirror = mirror
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(settings.connect_timeout, read=settings.read_timeout, write=60.0, pool=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            follow_redirects=False,
        )
        self.metrics = GatewayMetrics(mirror)
        self.teams = GatewayTeams(mirror.store, mirror, settings.api_key)  # keys, isolation, quotas (aenv/teams)
        self.directory = Directory(settings, mirror)
        self.upstream = Upstream(settings, self.directory, self.client)
        self.owners = Owners(settings, self.directory, self.client)
        self.traffic = SandboxTraffic(settings, self.directory, self.owners, self.upstream)
        creates = Creates(settings, self.directory, self.upstream, self.teams)
        sandboxes = SandboxRoutes(
            settings,
            self.directory,
            self.owners,
            self.upstream,
            TakeOvers(settings, self.directory, self.upstream),
            Forks(settings, self.directory, self.upstream, creates),
            self.teams,
        )
        self.routes = table(
            self,
            NodeRoutes(settings, self.directory, self.upstream),
            sandboxes,
            creates,
            Lists(settings, self.directory, self.upstream),
            Artifacts(self.directory, self.owners, self.upstream),
        )
        self._config_check: asyncio.Task[None] | None = None

    # The directory's, named here as before the gateway was split (tests and `serve_gateway` use them).
    @property
    def config(self) -> ClusterConfig | None:
        return self.directory.config

    @config.setter
    def config(self, config: ClusterConfig | None) -> None:
        self.directory.config = config

    @property
    def wrong_key(self) -> asyncio.Event:
        return self.directory.wrong_key

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
            await self.traffic.websocket(scope, receive, counted)
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
                    # One deadline for all of it: each read is bounded, but on a saturated host
                    # their sum held a gateway at "waiting for application startup" for 90 s.
                    async with asyncio.timeout(STARTUP_DEADLINE):
                        await self.mirror.start(wait=STARTUP_WAIT)
                        await self.teams.start()
                        await self.directory.cluster_config()
                except (ClusterUnavailable, TimeoutError) as exc:
                    why = (
                        exc.message
                        if isinstance(exc, ClusterUnavailable)
                        else f"the cluster store was not read within {STARTUP_DEADLINE:g} s"
                    )
                    if self.wrong_key.is_set():
                        await self._close()  # an open watch and channel would hold the exit up
                        await send({"type": "lifespan.startup.failed", "message": why})
                        return
                    log.warning("%s; serving once it can be read", why)
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
                await self.directory.cluster_config()
            await asyncio.sleep(0.5)
        if self.wrong_key.is_set():
            log.error("this gateway's AENV_API_KEY is not the one the cluster was started with: stopping")

    async def _close(self) -> None:
        # The watch may sit in a call etcd's client does not give up at once (CI: a gateway with the
        # wrong key hung at startup for 90 s closing it); closing the client below ends that call.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(CLOSE_SECONDS):
                await self.mirror.stop()
        await self.mirror.store.close()
        await self.aclose()

    # -- routing ------------------------------------------------------------------------------------
    async def route(self, request: Request) -> Response | Relay:
        headers = {k.lower(): v for k, v in request.headers.items()}
        traffic = await self.traffic.route(request, headers)
        if traffic is not None:
            return traffic
        scope, method, path = request.scope, request.method, request.url.path
        scope[ROUTE_SCOPE] = "own"
        route, match = find(self.routes, method, path)
        who: Principal | None = None
        if route.access is not OPEN and not _open_at_nodes(method, path):
            who = await self.check_key(headers)
        scope[ROUTE_SCOPE] = route.kind  # after the key: a stranger's 401 is counted as the gateway's own
        if route.access is ADMIN and (who is None or not who.admin):
            raise Forbidden("the cluster's nodes are the admin key's (AENV_API_KEY)")
        return await route.handler(request, match)

    async def check_key(self, headers: dict[str, str]) -> Principal:
        """The request's team (aenv/teams/gateway.py), or 401."""
        if not self.settings.api_key:
            return Principal(DEFAULT_TEAM, admin=True, all_teams=True)
        return await self.teams.authenticate(headers)

    # -- its own routes -----------------------------------------------------------------------------
    async def health(self, request: Request, _: re.Match[str]) -> Response:
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

    async def prometheus(self, request: Request, _: re.Match[str]) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def dashboard(self, request: Request, _: re.Match[str]) -> Response:
        return await cluster_dashboard.route(self, request)  # its pages are open, its data needs the key (it checks)


def _open_at_nodes(method: str, path: str) -> bool:
    """What the nodes open without the key stays open (a signed upload's token, a volume's content
    token: the node's to check)."""
    return (
        (method, path) in PUBLIC_ROUTES
        or (method == "PUT" and SIGNED_UPLOAD.fullmatch(path) is not None)
        or VOLUME_CONTENT.fullmatch(path) is not None
    )
