"""Teams on a node: the registry, the quotas and the usage, put together and installed on the app.

The node's front (aenv/api/app.py) asks ``authenticate`` for each control-plane request and sets
the principal; the app's routes find the registry, quotas and usage on ``app.state``. A node of a
cluster keeps teams and keys in etcd (shared with the gateways), a node alone in its data dir.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI

from aenv.node.service import NodeService
from aenv.teams.model import DEFAULT_TEAM, Principal
from aenv.teams.quotas import DEFAULT_MAX_WAIT, NodeQuotas, team_of
from aenv.teams.registry import Teams
from aenv.teams.store import SqliteTeamStore, TeamStore


def max_create_wait() -> float:
    raw = os.environ.get("AENV_MAX_CREATE_WAIT", "")
    try:
        return max(0.0, float(raw)) if raw else DEFAULT_MAX_WAIT
    except ValueError:
        raise ValueError(f"AENV_MAX_CREATE_WAIT must be a number of seconds, not {raw[:40]!r}") from None


class Tenancy:
    def __init__(self, node: NodeService, admin_key: str | None) -> None:
        self.node = node
        settings = node.settings
        store: TeamStore
        self.cluster: Any = None
        if settings.cluster:
            from aenv.teams.cluster import ClusterTeams

            self.cluster = ClusterTeams.of_node(settings)
            store = self.cluster.store
        else:
            store = SqliteTeamStore(settings.data_dir / "teams.db")
        self.teams = Teams(store, admin_key)
        self.quotas = NodeQuotas(node, self.teams, max_create_wait())
        from aenv.teams.usage import NodeUsage

        self.usage = NodeUsage(node, self.teams)

    async def start(self) -> None:
        await self.teams.start()
        if self.cluster is not None:
            await self.cluster.start(self.teams)
        self.node.team_room = self.quotas.team_room
        if self.quotas.changed not in self.node.state_listeners:
            self.node.state_listeners.append(self.quotas.changed)
        await self.usage.start()

    async def stop(self) -> None:
        await self.usage.stop()
        if self.node.team_room == self.quotas.team_room:
            self.node.team_room = None
        if self.quotas.changed in self.node.state_listeners:
            self.node.state_listeners.remove(self.quotas.changed)
        if self.cluster is not None:
            await self.cluster.stop()
        await self.teams.stop()

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        if not self.teams.started:
            await self.teams.start()  # a request before the app's startup (never, with uvicorn)
        return await self.teams.authenticate(headers)

    def holdings(self, team: str) -> str:
        """What of ``team`` this node holds, in words ("" for nothing)."""
        sandboxes = sum(1 for sb in list(self.node.sandboxes.values()) if team_of(sb.rec) == team)
        templates = sum(1 for t in self.node.templates.values() if (t.team or DEFAULT_TEAM) == team)
        snapshots = sum(1 for s in self.node.snapshots.values() if (s.team or DEFAULT_TEAM) == team and not s.ephemeral)
        parts = [
            f"{n} {what}"
            for n, what in ((sandboxes, "sandboxes"), (templates, "templates"), (snapshots, "snapshots"))
            if n
        ]
        return ", ".join(parts)

    async def team_usage(self, team: str) -> dict[str, Any]:
        if self.cluster is not None:  # every node's share
            return self.usage.usage_json(team, await self.cluster.usage_of(team, self.usage.totals.get(team, {})))
        return self.usage.usage_json(team)

    def install(self, app: FastAPI) -> None:
        app.state.tenancy = self
        app.state.teams = self.teams
        app.state.quotas = self.quotas
        app.state.team_metrics = self.usage.team_metrics
        app.state.team_usage = self.team_usage
        if self.cluster is not None:
            app.state.remote_team = self.cluster.remote_team
