"""Teams, keys and usage of a cluster, in etcd, shared by every node and gateway.

Keys (values JSON, bounded):
    /aenv/teams/t/<team-id>            Team (name, quotas)
    /aenv/teams/k/<sha256 of the key>  ApiKey (its team, name, mask; never the key)
    /aenv/teams/u/<team-id>/<node-id>  what the team used on that node (aenv/teams/usage.py)
    /aenv/teams/q/<team-id>/...        the gateways' quota bookkeeping (aenv/teams/admission.py)

Nodes write teams, keys and their own usage (team and key requests reach a node through a gateway);
gateways write only under q/. Each process keeps teams and keys in memory (aenv/teams/registry.py)
and follows changes with one watch of /aenv/teams/ (a deleted key is dropped as the event arrives;
the registry reads a key again every few seconds in any case).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import Any

from aenv.cluster.entries import PREFIX, EntryError, SandboxEntry, decode, node_id_of, sandbox_key
from aenv.cluster.store import ClusterStore, cluster_store
from aenv.config import Settings
from aenv.errors import ClusterUnavailable
from aenv.teams.model import TEAM_ID, ApiKey, Team
from aenv.teams.registry import Teams

log = logging.getLogger("aenv.teams")
TEAMS_PREFIX = PREFIX + "teams/"
TEAM_PREFIX = TEAMS_PREFIX + "t/"
KEY_PREFIX = TEAMS_PREFIX + "k/"
USAGE_PREFIX = TEAMS_PREFIX + "u/"
QUOTA_PREFIX = TEAMS_PREFIX + "q/"
MAX_VALUE = 16 * 1024
WATCH_PAUSE = 1.0


def _range_end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


def _json(value: bytes) -> dict[str, Any]:
    if len(value) > MAX_VALUE:
        raise ValueError(f"value of {len(value)} bytes")
    body = json.loads(value)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    return body


class EtcdTeamStore:
    """The registry's store in a cluster (``shared``: others write it too)."""

    shared = True

    def __init__(self, store: ClusterStore, node_id: str = "") -> None:
        self.etcd = store
        self.node_id = node_id

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.etcd.close()

    async def _prefix(self, prefix: str) -> list[tuple[str, bytes]]:
        got = await self.etcd.call("read teams", lambda c: c.get_prefix(prefix.encode()), again=True)
        return [(kv.key.decode(errors="replace"), bytes(kv.value)) for kv in got]

    async def _get(self, key: str) -> bytes | None:
        got = await self.etcd.call("read a team entry", lambda c: c.get(key.encode()), again=True)
        return None if got is None else bytes(got.value)

    async def _put(self, key: str, value: dict[str, Any]) -> None:
        data = json.dumps(value, separators=(",", ":")).encode()
        await self.etcd.call("write a team entry", lambda c: c.put(key.encode(), data), again=True)

    async def _delete(self, key: str) -> None:
        await self.etcd.call("delete a team entry", lambda c: c.delete(key.encode()), again=True)

    async def load(self) -> tuple[list[Team], list[ApiKey]]:
        teams, keys = [], []
        for key, value in await self._prefix(TEAMS_PREFIX):
            try:
                if key.startswith(TEAM_PREFIX):
                    teams.append(Team.from_json(_json(value)))
                elif key.startswith(KEY_PREFIX):
                    keys.append(ApiKey.from_json(_json(value)))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping team entry %s: %s", key[:120], exc)
        return teams, keys

    async def put_team(self, team: Team) -> None:
        await self._put(TEAM_PREFIX + team.id, team.to_json())

    async def delete_team(self, team_id: str) -> None:
        _, keys = await self.load()
        for key in keys:
            if key.team == team_id:
                await self._delete(KEY_PREFIX + key.digest)
        await self._delete(TEAM_PREFIX + team_id)

    async def put_key(self, key: ApiKey) -> None:
        await self._put(KEY_PREFIX + key.digest, key.to_json())

    async def delete_key(self, key: ApiKey) -> None:
        await self._delete(KEY_PREFIX + key.digest)

    async def find_key(self, digest: str) -> ApiKey | None:
        if len(digest) != 64 or not all(c in "0123456789abcdef" for c in digest):
            return None
        value = await self._get(KEY_PREFIX + digest)
        try:
            return ApiKey.from_json(_json(value)) if value is not None else None
        except (ValueError, TypeError):
            return None

    async def find_team(self, team_id: str) -> Team | None:
        if not TEAM_ID.fullmatch(team_id):
            return None
        value = await self._get(TEAM_PREFIX + team_id)
        try:
            return Team.from_json(_json(value)) if value is not None else None
        except (ValueError, KeyError, TypeError):
            return None

    async def load_usage(self) -> dict[str, dict[str, float]]:
        return {team: totals for (team, node), totals in (await self.all_usage()).items() if node == self.node_id}

    async def all_usage(self, team: str = "") -> dict[tuple[str, str], dict[str, float]]:
        out: dict[tuple[str, str], dict[str, float]] = {}
        for key, value in await self._prefix(USAGE_PREFIX + (f"{team}/" if team else "")):
            team_id, _, node = key[len(USAGE_PREFIX) :].partition("/")
            try:
                body = _json(value)
            except ValueError:
                continue
            out[(team_id, node)] = {
                str(k): float(v) for k, v in body.items() if isinstance(v, int | float) and not isinstance(v, bool)
            }
        return out

    async def put_usage(self, usage: dict[str, dict[str, float]]) -> None:
        if not self.node_id:
            return
        for team, totals in usage.items():
            await self._put(f"{USAGE_PREFIX}{team}/{self.node_id}", totals)


class ClusterTeams:
    """A node's (or gateway's) part in the cluster's teams: the shared store and its watch."""

    def __init__(self, store: ClusterStore, node_id: str = "") -> None:
        self.etcd = store
        self.store = EtcdTeamStore(store, node_id)
        self.teams: Teams | None = None
        self._watch: asyncio.Task[None] | None = None

    @classmethod
    def of_node(cls, settings: Settings) -> ClusterTeams:
        return cls(cluster_store(settings), node_id_of(settings))

    async def start(self, teams: Teams) -> None:
        self.teams = teams
        if self._watch is None:
            self._watch = asyncio.ensure_future(self._follow())

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
            self._watch = None

    async def _follow(self) -> None:
        """Follow /aenv/teams/ (teams and keys made, changed, deleted elsewhere), for good."""
        prefix = TEAMS_PREFIX.encode()
        while True:
            try:
                watch = await self.etcd.call("watch teams", lambda c: c.watch_prefix(prefix))
                assert self.teams is not None
                await self.teams.reload()  # what changed before the watch began
                async for event in watch:
                    self._apply(event.kv.key.decode(errors="replace"), bytes(event.kv.value))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the registry reads keys again meanwhile
                log.info("teams watch: %s; following again", exc)
            await asyncio.sleep(WATCH_PAUSE)

    def _apply(self, key: str, value: bytes) -> None:
        teams = self.teams
        if teams is None:
            return
        try:
            if key.startswith(KEY_PREFIX):
                digest = key[len(KEY_PREFIX) :]
                teams.seen_key(ApiKey.from_json(_json(value)) if value else None, digest)
            elif key.startswith(TEAM_PREFIX):
                team_id = key[len(TEAM_PREFIX) :]
                teams.seen_team(Team.from_json(_json(value)) if value else None, team_id)
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("skipping team entry %s: %s", key[:120], exc)

    async def remote_team(self, sandbox_id: str) -> str | None:
        """The team of a sandbox this node does not hold, from its directory entry (None: none)."""
        try:
            got = await self.etcd.call("read a sandbox", lambda c: c.get(sandbox_key(sandbox_id)), again=True)
        except (EntryError, ClusterUnavailable):
            return None
        if got is None:
            return None
        try:
            return decode(SandboxEntry, bytes(got.value)).team
        except EntryError:
            return None

    async def usage_of(self, team: str, mine: dict[str, float]) -> dict[str, float]:
        """The team's usage on every node: the others' as last saved, this one's as counted now."""
        total = dict(mine)
        for (_, node), totals in (await self.store.all_usage(team)).items():
            if node == self.store.node_id:
                continue
            for name, value in totals.items():
                total[name] = total.get(name, 0.0) + value
        return total
