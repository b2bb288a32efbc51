"""Lists over the cluster: sandboxes (from the mirror when every entry carries its list item, else
from every node, merged), snapshots (every node's, merged) and several sandboxes' metrics (each
asked of its own node)."""

from __future__ import annotations

import asyncio
import contextlib
import re

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.api import listing
from aenv.api.listing import short_sandbox_id
from aenv.cluster import lists
from aenv.cluster.entries import ClusterConfig, SandboxEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import cluster_paused, limit_of, position, snapshot_position
from aenv.cluster.gateway.settings import GatewaySettings
from aenv.cluster.gateway.upstream import Upstream
from aenv.cluster.lists import ListQuery
from aenv.errors import ClusterUnavailable, InvalidRequest
from aenv.teams import guard as team_guard


class Lists:
    def __init__(self, settings: GatewaySettings, directory: Directory, upstream: Upstream) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.upstream = upstream

    async def sandboxes(self, request: Request, _: re.Match[str]) -> Response:
        """A list, from the mirror while it follows etcd and every live node's entries carry their
        list items (see aenv/cluster/lists.py): no node is asked, so a slow or stopped one delays
        nothing. Otherwise (the watch down, a node of an older version, metadata too large for an
        entry) every node is asked. Changes made through this gateway show in the next list: it
        waits (briefly) for the directory to have them."""
        paginated = request.url.path == "/v2/sandboxes"
        query = ListQuery.of(request, paginated=paginated, limit=limit_of(request) if paginated else 0)
        if query.token:
            query.order.cursor(query.token)  # a bad token is the client's 400, whatever the nodes
        config = await self.directory.cluster_config() if self.mirror.connected else None
        if config is None:
            return await self._from_nodes(request, query, config)
        await self.directory.settle()
        entries = self._listable_entries()
        if entries is None:
            return await self._from_nodes(request, query, config)
        items, headers = lists.answer(query, entries, config.secret.encode(), self.settings.domain)
        return JSONResponse(items, headers=headers)

    def _listable_entries(self) -> list[SandboxEntry] | None:
        """The live nodes' sandboxes' entries and the durable pauses of lost nodes (they belong to
        the cluster), if each can be listed from its entry alone."""
        live = [
            e
            for e in self.mirror.sandboxes.values()
            if (e.node_id in self.mirror.nodes or cluster_paused(e)) and team_guard.visible_team(e.team)
        ]
        return live if all(e.listable for e in live) else None

    async def _from_nodes(self, request: Request, query: ListQuery, config: ClusterConfig | None) -> Response:
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
        limit = limit_of(request) if paginated else 0
        pages = await asyncio.gather(*(self.upstream.node_page(request, n, path) for n in nodes))
        for node, page in zip(nodes, pages, strict=True):
            for item in page.items:
                item["nodeID"] = node.node_id  # where each runs (the dashboard's Node column)
        items = [item for page in pages for item in page.items]
        self.upstream.stamp_domain(items)
        if config is not None:
            items += self._lost_but_paused(query, config)
        if not paginated:
            return JSONResponse(items)
        served, next_token = order.page(items, position, limit, None)
        if next_token is None and served and any(page.more for page in pages):
            next_token = order.token(position(served[-1]))  # a node has more after its full page
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
            and cluster_paused(e)
            and e.listable
            and query.matches(e)
            and team_guard.visible_team(e.team)
        ]

    async def snapshots(self, request: Request, _: re.Match[str]) -> Response:
        """Every node's snapshots, merged as `_from_nodes` merges sandboxes: a snapshot is on
        the node that made it at once and on the others once its commit reached the repository,
        so one node's list can miss another's newest ones. Each node is asked for its first
        ``limit`` after the client's token, with the client's filters; one listed by several
        nodes is served once."""
        limit = limit_of(request)
        token = request.query_params.get("nextToken")
        if token:
            listing.SNAPSHOTS.cursor(token)  # a bad token is the client's 400, whatever the nodes
        nodes = sorted(self.mirror.nodes.values(), key=lambda n: n.node_id)
        if not nodes:
            raise ClusterUnavailable("no node in the cluster is up")
        pages = await asyncio.gather(*(self.upstream.node_page(request, n, "/snapshots") for n in nodes))
        unique: dict[str, dict[str, object]] = {}
        for item in (item for page in pages for item in page.items):
            known = unique.get(str(item.get("snapshotID")))
            if known is None or (item.get("committed") and not known.get("committed")):
                unique[str(item.get("snapshotID"))] = item
        served, next_token = listing.SNAPSHOTS.page(list(unique.values()), snapshot_position, limit, None)
        if next_token is None and served and any(page.more for page in pages):
            next_token = listing.SNAPSHOTS.token(snapshot_position(served[-1]))
        return JSONResponse(served, headers={"X-Next-Token": next_token} if next_token else {})

    async def metrics(self, request: Request, _: re.Match[str]) -> Response:
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
        first = self.mirror.nodes[next(iter(by_node))] if by_node else self.directory.any_node()
        asked = [(first, request.query_params.multi_items())]
        asked += [
            (self.mirror.nodes[node_id], [("sandbox_ids", ",".join(held))])
            for node_id, held in by_node.items()
            if node_id != first.node_id
        ]
        headers = {"x-api-key": request.headers.get("x-api-key", "")}
        answers = await asyncio.gather(
            *(self.upstream.node_json(node, "/sandboxes/metrics", params, headers) for node, params in asked)
        )
        merged: dict[str, object] = {}
        for answer in answers:
            sandboxes = answer.get("sandboxes") if isinstance(answer, dict) else None
            if isinstance(sandboxes, dict):
                merged.update(sandboxes)
        return JSONResponse({"sandboxes": merged})
