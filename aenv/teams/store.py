"""Where teams and key digests are kept: SQLite in the data dir for a node alone
(``<data-dir>/teams.db``, owner-only); etcd for a cluster (aenv/teams/etcd.py).
"""

from __future__ import annotations

import json
from typing import Any, Protocol

from aenv.storage.sqlite import SqliteFile
from aenv.teams.model import ApiKey, Team

SCHEMA = """
CREATE TABLE IF NOT EXISTS teams (id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS api_keys (
    digest TEXT PRIMARY KEY, id TEXT UNIQUE NOT NULL, team TEXT NOT NULL, body TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS usage (team TEXT PRIMARY KEY, body TEXT NOT NULL);
"""


class TeamStore(Protocol):
    """What the registry (aenv/teams/registry.py) keeps teams and keys in. ``shared``: other
    processes (gateways, nodes) change it too, so a key not in the registry's memory is looked up."""

    shared: bool

    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def load(self) -> tuple[list[Team], list[ApiKey]]: ...

    async def put_team(self, team: Team) -> None: ...

    async def delete_team(self, team_id: str) -> None: ...

    async def put_key(self, key: ApiKey) -> None: ...

    async def delete_key(self, key: ApiKey) -> None: ...

    async def find_key(self, digest: str) -> ApiKey | None: ...

    async def find_team(self, team_id: str) -> Team | None: ...

    async def load_usage(self) -> dict[str, dict[str, float]]: ...

    async def put_usage(self, usage: dict[str, dict[str, float]]) -> None: ...


class SqliteTeamStore(SqliteFile):
    shared = False
    schema = SCHEMA
    synchronous = "FULL"  # a key made or deleted is one on disk when the API says so
    label = "team store"

    async def load(self) -> tuple[list[Team], list[ApiKey]]:
        async with self.db.execute("SELECT body FROM teams") as cur:
            teams = [Team.from_json(json.loads(row[0])) async for row in cur]
        async with self.db.execute("SELECT body FROM api_keys") as cur:
            keys = [ApiKey.from_json(json.loads(row[0])) async for row in cur]
        return teams, keys

    async def put_team(self, team: Team) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO teams (id, body) VALUES (?, ?)", (team.id, json.dumps(team.to_json()))
        )
        await self.db.commit()

    async def delete_team(self, team_id: str) -> None:
        await self.db.execute("DELETE FROM api_keys WHERE team = ?", (team_id,))
        await self.db.execute("DELETE FROM teams WHERE id = ?", (team_id,))
        await self.db.commit()

    async def put_key(self, key: ApiKey) -> None:
        await self.db.execute(
            "INSERT INTO api_keys (digest, id, team, body) VALUES (?, ?, ?, ?)",
            (key.digest, key.id, key.team, json.dumps(key.to_json())),
        )
        await self.db.commit()

    async def delete_key(self, key: ApiKey) -> None:
        await self.db.execute("DELETE FROM api_keys WHERE digest = ?", (key.digest,))
        await self.db.commit()

    async def find_key(self, digest: str) -> ApiKey | None:
        async with self.db.execute("SELECT body FROM api_keys WHERE digest = ?", (digest,)) as cur:
            row = await cur.fetchone()
        return ApiKey.from_json(json.loads(row[0])) if row else None

    async def find_team(self, team_id: str) -> Team | None:
        async with self.db.execute("SELECT body FROM teams WHERE id = ?", (team_id,)) as cur:
            row = await cur.fetchone()
        return Team.from_json(json.loads(row[0])) if row else None

    async def load_usage(self) -> dict[str, dict[str, float]]:
        async with self.db.execute("SELECT team, body FROM usage") as cur:
            return {row[0]: _floats(json.loads(row[1])) async for row in cur}

    async def put_usage(self, usage: dict[str, dict[str, float]]) -> None:
        await self.db.executemany(
            "INSERT OR REPLACE INTO usage (team, body) VALUES (?, ?)",
            [(team, json.dumps(totals)) for team, totals in usage.items()],
        )
        await self.db.commit()


def _floats(body: Any) -> dict[str, float]:
    if not isinstance(body, dict):
        return {}
    return {str(k): float(v) for k, v in body.items() if isinstance(v, int | float) and not isinstance(v, bool)}
