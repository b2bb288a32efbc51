"""Resumes of durable pauses that another node than the sandbox's own serves: its node is gone,
draining, full (429) or silent, and the best node with room takes the sandbox over from the
snapshot repository. Exactly one node wins the claim; the other answers lead to it."""

from __future__ import annotations

import logging

import httpx
from starlette.requests import Request
from starlette.responses import Response

from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import cluster_paused
from aenv.cluster.gateway.relay import NODE_SCOPE, NodeSilent, Relay, read_bounded
from aenv.cluster.gateway.settings import MAX_CREATE_BODY, GatewaySettings
from aenv.cluster.gateway.upstream import Upstream
from aenv.errors import ClusterUnavailable, SandboxNotFound
from aenv.node.service import OWNER_FULL_HEADER

log = logging.getLogger("aenv.gateway")


class TakeOvers:
    def __init__(self, settings: GatewaySettings, directory: Directory, upstream: Upstream) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.upstream = upstream

    async def resume_or_move(self, request: Request, node: NodeEntry, sandbox_id: str) -> Response | Relay:
        """A resume of a durable pause whose node is up: there, where its files are, if that node
        has room; one that answers 429 (full) gives it up to the best other node with room, which
        takes it over from the repository (the owner resumes only after taking the entry's
        durable mark off, the taker claims only while it is on: never both)."""
        body = await read_bounded(request, MAX_CREATE_BODY)
        try:
            upstream = await self.upstream.send(request, node, body=body)
        except NodeSilent as exc:
            return await self._take_from_silent(request, exc, sandbox_id, body)
        entry, _ = self.mirror.owner(sandbox_id)
        if upstream.status_code == 429 and entry is not None and cluster_paused(entry):
            others = self.directory.takeover_candidates(entry, avoid=node.node_id, same_runtime=True)
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
            upstream = await self.upstream.send(request, winner, body=body)
            return await self._resumed(request, winner, sandbox_id, upstream)
        if not cluster_paused(entry):
            raise silent  # its node began to resume it, then went silent: lost with that node
        others = self.directory.takeover_candidates(entry, avoid=silent.node_id)
        if not others:
            raise ClusterUnavailable(
                f"node {silent.node_id} holding sandbox {sandbox_id} did not answer and no other node can take "
                "it over now; try again"
            )
        log.warning("node %s did not answer: sandbox %s is taken over elsewhere", silent.node_id, sandbox_id)
        return await self.take_over(request, others, sandbox_id, body=body, owner_full=True)

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
            body = await read_bounded(request, MAX_CREATE_BODY)
        extra = {OWNER_FULL_HEADER: "1"} if owner_full else None
        for i, node in enumerate(nodes):
            upstream = await self.upstream.send(request, node, body=body, extra=extra)
            if upstream.status_code == 429 and i + 1 < len(nodes):
                await upstream.aclose()
                continue
            break
        if upstream.status_code in (404, 409):
            read = await self.mirror.store.get_sandbox(sandbox_id)
            winner = self.mirror.nodes.get(read.entry.node_id) if read is not None else None
            if winner is not None and winner.node_id != node.node_id:
                await upstream.aclose()
                node, upstream = winner, await self.upstream.send(request, winner, body=body)
        return await self._resumed(request, node, sandbox_id, upstream)

    async def _resumed(
        self, request: Request, node: NodeEntry, sandbox_id: str, upstream: httpx.Response
    ) -> Response | Relay:
        request.scope[NODE_SCOPE] = node.node_id
        self.directory.note_change("POST", request.url.path, sandbox_id, upstream.status_code)
        if self.settings.domain:
            return await self.upstream.answered(request, node, upstream=upstream)
        return Relay(upstream, node)
