"""Where events, webhooks and the webhooks' delivery positions are kept: SQLite in the data dir
for a node alone (``<data-dir>/events.db``, owner-only: it holds the webhooks' secrets); etcd for a
cluster (aenv/events/cluster.py).

A ``position`` orders events as they were committed (SQLite's row id, etcd's revision): a
dispatcher that delivered everything up to one misses nothing written before it.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from typing import Protocol

from aenv.events.model import LifecycleEvent, Webhook
from aenv.storage.sqlite import SqliteFile

SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    position INTEGER PRIMARY KEY AUTOINCREMENT, team TEXT NOT NULL, sandbox TEXT NOT NULL,
    type TEXT NOT NULL, at REAL NOT NULL, body TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS events_team ON events (team, position);
CREATE INDEX IF NOT EXISTS events_sandbox ON events (team, sandbox, position);
CREATE INDEX IF NOT EXISTS events_at ON events (at);
CREATE TABLE IF NOT EXISTS webhooks (id TEXT PRIMARY KEY, team TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS delivered (webhook TEXT PRIMARY KEY, position INTEGER NOT NULL);
"""


class EventStore(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def append(self, events: list[LifecycleEvent]) -> None: ...

    async def query(
        self,
        team: str | None,
        *,
        sandbox_id: str | None,
        types: Collection[str],
        offset: int,
        limit: int,
        ascending: bool,
    ) -> list[LifecycleEvent]:
        """A page of events (``team`` None: every team's), oldest or newest first."""
        ...

    async def after(self, position: int, limit: int) -> list[tuple[int, LifecycleEvent | None]]:
        """Events committed after ``position``, in that order, with their positions (None: an
        entry that does not decode, passed over)."""
        ...

    async def last_position(self) -> int: ...

    async def prune(self, before: float) -> int: ...

    async def webhooks(self) -> list[Webhook]: ...

    async def put_webhook(self, hook: Webhook) -> None: ...

    async def delete_webhook(self, webhook_id: str) -> None: ...

    async def delivered(self, webhook_id: str) -> int | None:
        """Where its deliveries stand (None: not begun)."""
        ...

    async def set_delivered(self, webhook_id: str, position: int) -> None: ...


class SqliteEventStore(SqliteFile):
    schema = SCHEMA
    label = "event store"
    synchronous = "FULL"  # a webhook made is one on disk when the API says so

    async def append(self, events: list[LifecycleEvent]) -> None:
        await self.db.executemany(
            "INSERT INTO events (team, sandbox, type, at, body) VALUES (?, ?, ?, ?, ?)",
            [(e.team, e.sandbox_id, e.type, e.timestamp, json.dumps(e.to_json())) for e in events],
        )
        await self.db.commit()

    async def query(
        self,
        team: str | None,
        *,
        sandbox_id: str | None,
        types: Collection[str],
        offset: int,
        limit: int,
        ascending: bool,
    ) -> list[LifecycleEvent]:
        where, args = [], []
        if team is not None:
            where.append("team = ?")
            args.append(team)
        if sandbox_id is not None:
            where.append("sandbox = ?")
            args.append(sandbox_id)
        if types:
            where.append(f"type IN ({', '.join('?' * len(types))})")
            args.extend(types)
        sql = "SELECT body FROM events"
        if where:
            sql += " WHERE " + " AND ".join(where)
        sql += f" ORDER BY position {'ASC' if ascending else 'DESC'} LIMIT ? OFFSET ?"
        async with self.db.execute(sql, (*args, limit, offset)) as cur:
            return [LifecycleEvent.from_json(json.loads(row[0])) async for row in cur]

    async def after(self, position: int, limit: int) -> list[tuple[int, LifecycleEvent | None]]:
        sql = "SELECT position, body FROM events WHERE position > ? ORDER BY position LIMIT ?"
        async with self.db.execute(sql, (position, limit)) as cur:
            return [(int(row[0]), LifecycleEvent.from_json(json.loads(row[1]))) async for row in cur]

    async def last_position(self) -> int:
        async with self.db.execute("SELECT MAX(position) FROM events") as cur:
            row = await cur.fetchone()
        return int(row[0]) if row and row[0] is not None else 0

    async def prune(self, before: float) -> int:
        cur = await self.db.execute("DELETE FROM events WHERE at < ?", (before,))
        await self.db.commit()
        return cur.rowcount

    async def webhooks(self) -> list[Webhook]:
        async with self.db.execute("SELECT body FROM webhooks") as cur:
            return [Webhook.from_json(json.loads(row[0])) async for row in cur]

    async def put_webhook(self, hook: Webhook) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO webhooks (id, team, body) VALUES (?, ?, ?)",
            (hook.id, hook.team, json.dumps(hook.to_json())),
        )
        await self.db.commit()

    async def delete_webhook(self, webhook_id: str) -> None:
        await self.db.execute("DELETE FROM webhooks WHERE id = ?", (webhook_id,))
        await self.db.execute("DELETE FROM delivered WHERE webhook = ?", (webhook_id,))
        await self.db.commit()

    async def delivered(self, webhook_id: str) -> int | None:
        async with self.db.execute("SELECT position FROM delivered WHERE webhook = ?", (webhook_id,)) as cur:
            row = await cur.fetchone()
        return int(row[0]) if row else None

    async def set_delivered(self, webhook_id: str, position: int) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO delivered (webhook, position) VALUES (?, ?)", (webhook_id, position)
        )
        await self.db.commit()
