"""Node-wide requests (templates, snapshots, the rest of the API): to the least loaded node, except
where one node knows more than the others for now (a snapshot just made, a build under way)."""

from __future__ import annotations

import contextlib
import re

from starlette.requests import Request
from starlette.responses import Response

from aenv.api.listing import short_sandbox_id
from aenv.cluster.entries import NodeEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.owners import Owners
from aenv.cluster.gateway.relay import Relay
from aenv.cluster.gateway.upstream import Upstream
from aenv.errors import InvalidRequest, SandboxNotFound

# A template's or snapshot's own requests (E2B deletes a snapshot as a template).
ARTIFACT_PATH = re.compile(r"^/(?:v\d+/)?(?:templates|snapshots)/(?P<id>[^/]+)")


class Artifacts:
    def __init__(self, directory: Directory, owners: Owners, upstream: Upstream) -> None:
        self.directory = directory
        self.owners = owners
        self.upstream = upstream

    async def build(self, request: Request, _: re.Match[str]) -> Response:
        """A template build: its uploads and status go to the node that started it."""
        return await self.upstream.answered(request, self.directory.any_node(), self.directory.note_template)

    async def forward(self, request: Request, _: re.Match[str]) -> Relay:
        return await self.upstream.forward(request, await self.node_for(request))

    async def node_for(self, request: Request) -> NodeEntry:
        """Where a node-wide request goes: the least loaded node, except where one node knows
        more than the others for now. A snapshot is on the node that made it at once and in the
        repository later: a list of one sandbox's snapshots goes to its node, a snapshot this
        gateway saw made to that node. A template build (its uploads, its status) stays on the
        node that started it."""
        path = request.url.path
        source = request.query_params.get("sandboxID")
        if path == "/snapshots" and source:
            with contextlib.suppress(SandboxNotFound, InvalidRequest):  # killed since: any node
                return await self.owners.owner(short_sandbox_id(source), {})
        named = ARTIFACT_PATH.match(path)
        if named is not None:
            made = self.directory.made_on.get(named["id"]) or self.directory.building.get(named["id"])
            if made is not None and made[0] in self.directory.mirror.nodes:
                return self.directory.mirror.nodes[made[0]]
        return self.directory.any_node()
