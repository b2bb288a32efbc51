"""Creates through the gateway: placed on the best node with room, and tried again on the next one
that answers, under one create id so that a create is neither lost nor made twice."""

from __future__ import annotations

import asyncio
import json
import re
import time
import uuid

import httpx
from starlette.requests import Request
from starlette.responses import Response

from aenv.cluster.entries import ID_PATTERN, NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import error_code, json_answer
from aenv.cluster.gateway.relay import buffered, read_bounded, read_upstream
from aenv.cluster.gateway.settings import (
    CREATE_RETRY_PAUSE,
    CREATE_RETRY_SECONDS,
    MAX_CANDIDATES,
    MAX_CREATE_BODY,
    MAX_INFO_BODY,
    SNAPSHOT_HINT_SECONDS,
    STORE_BLIP_SECONDS,
    GatewaySettings,
)
from aenv.cluster.gateway.upstream import Upstream
from aenv.errors import ClusterUnavailable, InvalidRequest, LimitExceeded, UpstreamError, parse_json
from aenv.node.create_ids import CREATE_ID_HEADER, create_id_of
from aenv.teams.gateway import GatewayTeams


class Creates:
    def __init__(
        self, settings: GatewaySettings, directory: Directory, upstream: Upstream, teams: GatewayTeams
    ) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.upstream = upstream
        self.teams = teams

    async def create(self, request: Request, _: re.Match[str]) -> Response:
        """Place a create, and try again on a node that does not answer (refused, cut off
        mid-way, dead, or slower than ``create_timeout``). Every attempt carries the same create
        id, which a node honours once: a node that already holds it answers with its sandbox, one
        told that another node holds it refuses (409 create_elsewhere) and the attempt goes to
        that node. So a create is neither lost nor made twice."""
        body = await read_bounded(request, MAX_CREATE_BODY)
        create_id = create_id_of(request.headers) or uuid.uuid4().hex
        if not ID_PATTERN.fullmatch(create_id):
            raise InvalidRequest(f"{CREATE_ID_HEADER} must be 1-63 characters of A-Z a-z 0-9 . _ -")
        async with self.teams.admitted(request.query_params) as made:  # the team's quotas, cluster-wide
            upstream, content, node = await self.place(request, body, create_id)
            answer = json_answer(upstream, content) if 200 <= upstream.status_code < 300 else None
            if isinstance(answer, dict) and isinstance(answer.get("sandboxID"), str):
                made["sandbox"] = answer["sandboxID"]
        if 200 <= upstream.status_code < 300:
            answer = json_answer(upstream, content) if self.settings.domain else None
            if answer is not None:
                self.upstream.stamp_domain(answer)
                content = json.dumps(answer).encode()
        return buffered(upstream, node, content)

    async def place(
        self, request: Request, body: bytes, create_id: str, *, avoid: str = ""
    ) -> tuple[httpx.Response, bytes, NodeEntry]:
        """``create``'s attempts (its answer, read whole, and the node that gave it); ``avoid``: a
        node not to try (a fork's source node, full). The request's own path is ``POST /sandboxes``
        or a fork's, whose children are sent as creates to ``/sandboxes``."""
        deadline = time.monotonic() + self.settings.create_timeout + CREATE_RETRY_SECONDS
        timeout = httpx.Timeout(self.settings.connect_timeout, read=self.settings.create_timeout, write=60.0, pool=10.0)
        failures: list[str] = []
        unanswered = False  # an attempt may have started a create: keep trying until the deadline
        queue = self._candidates(body, avoid)
        not_found: tuple[httpx.Response, bytes, NodeEntry] | None = None
        incompatible: tuple[httpx.Response, bytes, NodeEntry] | None = None
        out_of_touch = False  # a node refused (503) because it could not reach etcd
        extra = {CREATE_ID_HEADER: create_id, "content-length": str(len(body)), "content-type": "application/json"}
        path = None if request.url.path in ("/sandboxes", "/v2/sandboxes") else "/sandboxes"
        blip_until = 0.0  # while a node that refused for etcd may just be catching up
        placement = self.directory.placement
        while time.monotonic() < deadline:
            if not queue:
                if not unanswered and not (time.monotonic() < blip_until and await self.directory.store_recovers()):
                    break
                await asyncio.sleep(CREATE_RETRY_PAUSE)
                queue = self._candidates(body, avoid)
                continue
            node = queue.pop(0)
            placement.sent(node.node_id)
            made = False
            try:
                upstream = await self.upstream.send(request, node, body=body, extra=extra, timeout=timeout, path=path)
                try:
                    content = await read_upstream(upstream, MAX_INFO_BODY, node)
                finally:
                    await upstream.aclose()
                made = 200 <= upstream.status_code < 300
            except UpstreamError as exc:
                failures.append(f"{node.node_id}: {exc.message}")
                unanswered = True
                continue
            finally:
                placement.done(node.node_id, made=made, entry=self.mirror.nodes.get(node.node_id))
            if upstream.status_code == 429 and error_code(content) == "quota_exceeded":
                return upstream, content, node  # the team's quota: the same on every node
            if upstream.status_code == 429:
                failures.append(f"{node.node_id}: at its limit")
                continue
            if upstream.status_code == 503 and error_code(content) == "cluster_unavailable":
                # refused before it began: the node lost etcd for a moment (a saturated host)
                failures.append(f"{node.node_id}: out of touch with the cluster store")
                if not out_of_touch:
                    blip_until = time.monotonic() + STORE_BLIP_SECONDS
                out_of_touch = True
                continue
            if upstream.status_code == 422 and error_code(content) == "image_incompatible":
                # a snapshot's memory image from another runsc or platform: a node like its maker may take it
                failures.append(f"{node.node_id}: another runtime than the snapshot's")
                incompatible = incompatible or (upstream, content, node)
                continue
            if upstream.status_code == 404 and error_code(content) == "template_not_found":
                # a snapshot not yet in the repository is only on the node that made it: maybe the next
                not_found = not_found or (upstream, content, node)
                continue
            if upstream.status_code == 409 and error_code(content) == "create_elsewhere":
                holder = await self.directory.create_holder(create_id)
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

    def _candidates(self, body: bytes, avoid: str = "") -> list[NodeEntry]:
        """The best nodes for the create (placement.py) but ``avoid``; first the one this gateway
        saw make the snapshot named, if any (its entry may not list it yet, nor the repository
        hold it)."""
        try:
            source = parse_json(body).get("templateID")
        except (ValueError, AttributeError):
            source = None
        source = source if isinstance(source, str) else None
        ranked = [n for n in self.directory.candidates(source) if n.node_id != avoid]
        made = self.directory.made_on.get(source) if source is not None else None
        maker = self.mirror.nodes.get(made[0]) if made is not None and made[0] != avoid else None
        if maker is not None and made is not None and time.monotonic() - made[1] < SNAPSHOT_HINT_SECONDS:
            ranked = [maker, *(n for n in ranked if n.node_id != maker.node_id)]  # a full one answers 429
        return ranked[:MAX_CANDIDATES]

    def _remember_created(self, content: bytes, node: NodeEntry) -> None:
        try:
            self.directory.remember(json.loads(content).get("sandboxID"), node)
        except (ValueError, AttributeError):
            pass
