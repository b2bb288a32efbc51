"""The control plane's requests about one sandbox (``/sandboxes/{id}...``): to the node that owns
it, with what the cluster answers itself when that node is gone or silent (a durable pause shown
from its entry, a kill as a tombstone, a resume taken over elsewhere)."""

from __future__ import annotations

import logging
import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Scope

from aenv.api.listing import short_sandbox_id
from aenv.cluster import lists
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.forking import Forks
from aenv.cluster.gateway.helpers import cluster_paused, cluster_paused_at, note_node
from aenv.cluster.gateway.owners import Owners
from aenv.cluster.gateway.relay import NODE_SCOPE, TAKEOVER_SCOPE, NodeSilent, Relay
from aenv.cluster.gateway.settings import GONE, LOST_WAIT, TOMBSTONE_SECONDS, GatewaySettings
from aenv.cluster.gateway.takeover import TakeOvers
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.websocket import NODE_ID_HEADER
from aenv.teams.gateway import GatewayTeams

log = logging.getLogger("aenv.gateway")


class SandboxRoutes:
    def __init__(
        self,
        settings: GatewaySettings,
        directory: Directory,
        owners: Owners,
        upstream: Upstream,
        takeovers: TakeOvers,
        forks: Forks,
        teams: GatewayTeams,
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.owners = owners
        self.upstream = upstream
        self.takeovers = takeovers
        self.forks = forks
        self.teams = teams

    def _visible(self, match: re.Match[str]) -> str:
        sandbox_id = match["id"]
        self.teams.check_sandbox(sandbox_id)  # another team's: as one the gateway does not know
        return sandbox_id

    # -- the routes (aenv/cluster/gateway/routes.py) ---------------------------------------------------
    async def info(self, request: Request, match: re.Match[str]) -> Response:
        """``GET /sandboxes/{id}``: its node's answer naming the node, or the cluster's durable
        pause shown from its entry when that node is gone or silent."""
        sandbox_id = self._visible(match)
        shown = await self.shown_paused(sandbox_id)
        if shown is not None:
            return shown
        node = await self.owners.owner(sandbox_id, request.scope)
        try:  # a drain may move it meanwhile: asked again where it went
            return await self.upstream.answered(request, node, note_node, follow=sandbox_id)
        except NodeSilent:  # a durable pause is the cluster's: shown from its entry
            shown = await self.shown_paused(sandbox_id, silent=True)
            if shown is None:
                raise
            return shown

    async def kill(self, request: Request, match: re.Match[str]) -> Response | Relay:
        """``DELETE /sandboxes/{id}``: its node kills it; a lost (or silent, then lost) node's
        sandbox is buried in the directory instead."""
        sandbox_id = self._visible(match)
        buried = await self.kill_lost(sandbox_id, request.scope)
        if buried is not None:
            return buried
        node = await self.owners.owner(sandbox_id, request.scope)
        try:
            relay = await self.upstream.forward(request, node, follow=sandbox_id)
        except NodeSilent as exc:
            return await self._kill_when_lost(request, sandbox_id, exc)
        self.directory.note_change(request.method, request.url.path, sandbox_id, relay.upstream.status_code)
        return relay

    async def resume(self, request: Request, match: re.Match[str]) -> Response | Relay:
        """``POST .../connect`` or ``.../resume``: a durable pause whose node is gone, draining or
        full is taken over by another node (aenv/cluster/gateway/takeover.py)."""
        sandbox_id = self._visible(match)
        scope = request.scope
        node = await self.owners.owner(sandbox_id, scope, resume=True)
        if scope.get(TAKEOVER_SCOPE):
            entry, _ = self.mirror.owner(sandbox_id)
            others = self.directory.takeover_candidates(entry, avoid=node.node_id) if entry is not None else []
            return await self.takeovers.take_over(request, [node, *others], sandbox_id)
        if cluster_paused_at(self.mirror, sandbox_id, node):
            return await self.takeovers.resume_or_move(request, node, sandbox_id)
        if self.settings.domain:
            answer = await self.upstream.answered(request, node)  # its "domain" is the gateway's
            self.directory.note_change(request.method, request.url.path, sandbox_id, answer.status_code)
            return answer
        return await self._forwarded(request, sandbox_id, node)

    async def fork(self, request: Request, match: re.Match[str]) -> Response:
        sandbox_id = self._visible(match)
        node = await self.owners.owner(sandbox_id, request.scope)
        return await self.forks.fork(request, node, short_sandbox_id(sandbox_id))

    async def snapshot(self, request: Request, match: re.Match[str]) -> Response:
        """A snapshot is on its node at once: creates from it are sent there (``note_snapshot``)."""
        sandbox_id = self._visible(match)
        node = await self.owners.owner(sandbox_id, request.scope)
        return await self.upstream.answered(request, node, self.directory.note_snapshot, follow=sandbox_id)

    async def other(self, request: Request, match: re.Match[str]) -> Relay:
        """Anything else about the sandbox (a pause, a timeout, its logs, ...): to its node."""
        sandbox_id = self._visible(match)
        node = await self.owners.owner(sandbox_id, request.scope)
        return await self._forwarded(request, sandbox_id, node)

    async def _forwarded(self, request: Request, sandbox_id: str, node: NodeEntry) -> Relay:
        relay = await self.upstream.forward(request, node, follow=sandbox_id)
        self.directory.note_change(request.method, request.url.path, sandbox_id, relay.upstream.status_code)
        return relay

    # -- what the cluster answers for a node that is gone ---------------------------------------------
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
        self.directory.expect(sandbox_id, GONE)
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
        return await self.upstream.forward(request, node)

    async def shown_paused(self, sandbox_id: str, *, silent: bool = False) -> Response | None:
        """``GET /sandboxes/{id}`` of a sandbox durably paused on a node that is gone (or, with
        ``silent``, did not answer): it belongs to the cluster (any node resumes it), so it is
        shown paused, from its entry, naming its node. None for anything else (the owner
        answers, or the lost node's 404)."""
        entry, node = self.mirror.owner(sandbox_id)
        if entry is None or (node is not None and not silent) or not cluster_paused(entry):
            return None
        config = await self.directory.cluster_config()
        if config is None:
            return None
        item = lists.listed_item(entry, config.secret.encode(), self.settings.domain)
        item["nodeID"] = entry.node_id
        return JSONResponse(item, headers={NODE_ID_HEADER: entry.node_id})
