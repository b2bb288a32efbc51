"""Where secrets' records (their values sealed) are kept: SQLite in the data dir for a node alone
(``secrets.db``, owner-only), etcd in a cluster (``/aenv/secrets/v/<id>``, a name claimed per team
with ``/aenv/secrets/n/<team>/<name>`` in the same transaction). The key that opens the values is
never kept with them (aenv/secrets/sealing.py)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Protocol

from aenv.cluster.entries import PREFIX
from aenv.cluster.store import TXN, ClusterStore
from aenv.errors import Conflict
from aenv.secrets.model import Secret
from aenv.storage.sqlite import SqliteFile

BY_ID = PREFIX + "secrets/v/"
BY_NAME = PREFIX + "secrets/n/"


class NameTaken(Conflict):
    """The team has one of that name already."""


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


class EtcdSecretStore:
    def __init__(self, store: ClusterStore) -> None:
        self.etcd = store

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.etcd.close()

    async def _txn(self, what: str, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.etcd.call(what, lambda c: c.transaction(compare=compare, success=success, failure=[]))
        return bool(ok)

    @staticmethod
    def _data(secret: Secret) -> bytes:
        return json.dumps(secret.to_json(), separators=(",", ":")).encode()

    async def add(self, secret: Secret) -> None:
        name_key = f"{BY_NAME}{secret.team}/{secret.name}".encode()
        puts = [TXN.put(name_key, secret.id.encode()), TXN.put((BY_ID + secret.id).encode(), self._data(secret))]
        if not await self._txn("make a secret", [TXN.version(name_key) == 0], puts):
            raise NameTaken(secret.name)

    async def put(self, secret: Secret) -> None:
        data = self._data(secret)
        await self.etcd.call("write a secret", lambda c: c.put((BY_ID + secret.id).encode(), data), again=True)

    async def all(self, team: str | None) -> list[Secret]:
        got = await self.etcd.call("read secrets", lambda c: c.get_prefix(BY_ID.encode()), again=True)
        found = []
        for kv in got:
            try:
                secret = Secret.from_json(json.loads(bytes(kv.value)))
            except (ValueError, KeyError, TypeError):
                continue
            if team is None or secret.team == team:
                found.append(secret)
        return sorted(found, key=lambda s: s.id)

    async def remove(self, secret: Secret) -> None:
        name_key = f"{BY_NAME}{secret.team}/{secret.name}".encode()
        await self._txn("delete a secret", [], [TXN.delete((BY_ID + secret.id).encode()), TXN.delete(name_key)])
