"""A fork through the gateway: sent to the source's node; the children it has no room for are made
on other nodes from a durable snapshot of the source (the pure parts: aenv/cluster/forks.py)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.cluster import forks
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.creates import Creates
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import node_error, note, parsed
from aenv.cluster.gateway.relay import buffered, read_bounded, read_upstream, replay
from aenv.cluster.gateway.settings import (
    CATALOGUE_LAG,
    MAX_CREATE_BODY,
    MAX_FORK_BODY,
    MAX_INFO_BODY,
    SNAPSHOT_HINT_SECONDS,
    GatewaySettings,
)
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.websocket import NODE_ID_HEADER
from aenv.errors import AenvError, UpstreamError, error_body


class Forks:
    def __init__(self, settings: GatewaySettings, directory: Directory, upstream: Upstream, creates: Creates) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.upstream = upstream
        self.creates = creates

    async def fork(self, request: Request, node: NodeEntry, sandbox_id: str) -> Response:
        """A fork, sent to the source's node. The children it had no room for (a per-child 429, or
        its 429 for the whole fork) are made on other nodes from a durable snapshot of the source
        (aenv/cluster/forks.py), when other nodes have room: one list back, each child in the
        order asked, with the node it runs on (``nodeID``), or its error."""
        body = await read_bounded(request, MAX_CREATE_BODY)
        upstream = await self.upstream.send(request, node, body=body)
        try:
            content = await read_upstream(upstream, MAX_FORK_BODY, node)
        finally:
            await upstream.aclose()
        fork = forks.asked(body, self.settings.max_fork)
        answer = parsed(content) if "content-encoding" not in upstream.headers else None
        results = forks.results_of(upstream.status_code, answer, fork[0]) if fork is not None else None
        if results is None or fork is None:
            return await self.upstream.answered(
                request, node, self.directory.note_fork, upstream=replay(upstream, content)
            )
        self.directory.note_fork(results, node)
        for result in results:
            if isinstance(result.get("sandbox"), dict):
                result["sandbox"]["nodeID"] = node.node_id
        refused = [i for i, result in enumerate(results) if forks.refused_for_room(result)]
        rank = self.directory.placement.rank
        if refused and any(n.node_id != node.node_id for n in rank(list(self.mirror.nodes.values()))):
            extras = [fork[2][i] if fork[2] is not None else None for i in refused]
            made = await self._fork_elsewhere(request, node, sandbox_id, extras, fork[1])
            for i, result in zip(refused, made, strict=True):
                results[i] = result
        if upstream.status_code == 429 and not any("sandbox" in result for result in results):
            return buffered(upstream, node, content)  # no room anywhere: the node's 429 as it was
        self.upstream.stamp_domain(results)
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
            source = (await self.upstream.node_response(node, f"/sandboxes/{sandbox_id}", [], headers)).json()
            snapshot = await self.upstream.send(
                request,
                node,
                body=b'{"durable": true}',
                path=f"/sandboxes/{sandbox_id}/snapshots",
                extra={"content-type": "application/json", "content-length": "17"},
                timeout=httpx.Timeout(self.settings.connect_timeout, read=self.settings.create_timeout),
            )
            try:
                content = await read_upstream(snapshot, MAX_INFO_BODY, node)
            finally:
                await snapshot.aclose()
            if snapshot.status_code != 201:
                raise node_error(snapshot.status_code, content, node)
            snapshot_id = json.loads(content)["snapshotID"]
        except (AenvError, ValueError, KeyError, TypeError) as exc:
            message = exc.message if isinstance(exc, AenvError) else repr(exc)
            failed = UpstreamError(f"no room on node {node.node_id}; its snapshot for others failed: {message}"[:500])
            return [{"error": error_body(failed)} for _ in range(count)]
        note(self.directory.made_on, snapshot_id, node.node_id, SNAPSHOT_HINT_SECONDS)
        bodies = [json.dumps(forks.child_body(source, snapshot_id, timeout, extra)).encode() for extra in extras]
        return list(await asyncio.gather(*(self._fork_child(request, child, node) for child in bodies)))

    async def _fork_child(self, request: Request, body: bytes, source_node: NodeEntry) -> dict[str, object]:
        """One child made elsewhere. The snapshot is committed, but a node reads the repository's
        new entries at most every few seconds: a node that does not know it yet is asked again."""
        create_id = uuid.uuid4().hex
        deadline = time.monotonic() + CATALOGUE_LAG
        try:
            while True:
                upstream, content, node = await self.creates.place(request, body, create_id, avoid=source_node.node_id)
                if upstream.status_code != 404 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(1.0)
        except AenvError as exc:
            return {"error": error_body(exc)}
        answer = parsed(content)
        if upstream.status_code != 201 or not isinstance(answer, dict):
            return {"error": forks.error_of(upstream.status_code, content)}
        answer["nodeID"] = node.node_id
        return {"sandbox": answer}
