"""Where secrets' records (their values sealed) are kept: SQLite in the data dir for a node alone
(``secrets.db``, owner-only), etcd in a cluster (``/aenv/secrets/v/<id>``, its name claimed per
team: aenv/cluster/named.py). The key that opens the values is
never kept with them (aenv/secrets/sealing.py)."""

from __future__ import annotations

import json
import sqlite3
from typing import Protocol

from aenv.cluster.entries import PREFIX
from aenv.cluster.named import NamedEntries, NameTaken
from aenv.cluster.store import ClusterStore
from aenv.secrets.model import Secret
from aenv.storage.sqlite import SqliteFile

__all__ = ["EtcdSecretStore", "NameTaken", "SecretStore", "SqliteSecretStore"]


class SecretStore(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def add(self, secret: Secret) -> None: ...

    async def put(self, secret: Secret) -> None: ...

    async def all(self, team: str | None) -> list[Secret]: ...

    async def remove(self, secret: Secret) -> None: ...


class SqliteSecretStore(SqliteFile):
    schema = """
    CREATE TABLE IF NOT EXISTS secrets (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, name TEXT NOT NULL, body TEXT NOT NULL, UNIQUE (team, name)
    );
    """
    label = "secret store"
    synchronous = "FULL"

    async def add(self, secret: Secret) -> None:
        try:
            await self.db.execute(
                "INSERT INTO secrets (id, team, name, body) VALUES (?, ?, ?, ?)",
                (secret.id, secret.team, secret.name, json.dumps(secret.to_json())),
            )
        except sqlite3.IntegrityError:
            raise NameTaken(secret.name) from None
        await self.db.commit()

    async def put(self, secret: Secret) -> None:
        await self.db.execute("UPDATE secrets SET body = ? WHERE id = ?", (json.dumps(secret.to_json()), secret.id))
        await self.db.commit()

    async def all(self, team: str | None) -> list[Secret]:
        sql, args = "SELECT body FROM secrets", tuple[str, ...]()
        if team is not None:
            sql, args = sql + " WHERE team = ?", (team,)
        async with self.db.execute(sql + " ORDER BY id", args) as cur:
            return [Secret.from_json(json.loads(row[0])) async for row in cur]

    async def remove(self, secret: Secret) -> None:
        await self.db.execute("DELETE FROM secrets WHERE id = ?", (secret.id,))
        await self.db.commit()


class EtcdSecretStore(NamedEntries[Secret]):
    def __init__(self, store: ClusterStore) -> None:
        super().__init__(store, PREFIX + "secrets/", "secret", Secret.from_json)

    async def all(self, team: str | None = None) -> list[Secret]:
        found = await super().all()
        return sorted((s for s in found if team is None or s.team == team), key=lambda s: s.id)
