"""Where volumes' records are kept: SQLite in the data dir for a node alone (``volumes.db``,
owner-only: it holds their tokens); etcd in a cluster (``/aenv/volumes/<id>``, a name claimed per
team with ``/aenv/volumes/n/<team>/<name>`` in the same transaction)."""

from __future__ import annotations

import json
import sqlite3
from typing import Any, Protocol

from aenv.cluster.entries import PREFIX
from aenv.cluster.store import TXN, ClusterStore
from aenv.errors import Conflict
from aenv.storage.sqlite import SqliteFile
from aenv.volumes.model import Volume

VOLUMES = PREFIX + "volumes/"
BY_ID = VOLUMES + "v/"
BY_NAME = VOLUMES + "n/"


class NameTaken(Conflict):
    """The team has one of that name already."""


class VolumeStore(Protocol):
    async def open(self) -> None: ...

    async def close(self) -> None: ...

    async def add(self, volume: Volume) -> None:
        """Raises NameTaken when the team has a volume of that name."""
        ...

    async def all(self) -> list[Volume]: ...

    async def get(self, volume_id: str) -> Volume | None: ...

    async def remove(self, volume: Volume) -> None: ...


class SqliteVolumeStore(SqliteFile):
    schema = """
    CREATE TABLE IF NOT EXISTS volumes (
        id TEXT PRIMARY KEY, team TEXT NOT NULL, name TEXT NOT NULL, body TEXT NOT NULL, UNIQUE (team, name)
    );
    """
    label = "volume store"
    synchronous = "FULL"  # a volume made is one on disk when the API says so

    async def add(self, volume: Volume) -> None:
        try:
            await self.db.execute(
                "INSERT INTO volumes (id, team, name, body) VALUES (?, ?, ?, ?)",
                (volume.id, volume.team, volume.name, json.dumps(volume.to_json())),
            )
        except sqlite3.IntegrityError:
            raise NameTaken(volume.name) from None
        await self.db.commit()

    async def all(self) -> list[Volume]:
        async with self.db.execute("SELECT body FROM volumes ORDER BY rowid") as cur:
            return [Volume.from_json(json.loads(row[0])) async for row in cur]

    async def get(self, volume_id: str) -> Volume | None:
        async with self.db.execute("SELECT body FROM volumes WHERE id = ?", (volume_id,)) as cur:
            row = await cur.fetchone()
        return Volume.from_json(json.loads(row[0])) if row else None

    async def remove(self, volume: Volume) -> None:
        await self.db.execute("DELETE FROM volumes WHERE id = ?", (volume.id,))
        await self.db.commit()


class EtcdVolumeStore:
    def __init__(self, store: ClusterStore) -> None:
        self.etcd = store

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.etcd.close()

    async def _txn(self, what: str, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.etcd.call(what, lambda c: c.transaction(compare=compare, success=success, failure=[]))
        return bool(ok)

    async def add(self, volume: Volume) -> None:
        name_key = f"{BY_NAME}{volume.team}/{volume.name}".encode()
        data = json.dumps(volume.to_json(), separators=(",", ":")).encode()
        puts = [TXN.put(name_key, volume.id.encode()), TXN.put((BY_ID + volume.id).encode(), data)]
        if not await self._txn("make a volume", [TXN.version(name_key) == 0], puts):
            raise NameTaken(volume.name)

    async def all(self) -> list[Volume]:
        got = await self.etcd.call("read volumes", lambda c: c.get_prefix(BY_ID.encode()), again=True)
        found = []
        for kv in got:
            try:
                found.append(Volume.from_json(json.loads(bytes(kv.value))))
            except (ValueError, KeyError, TypeError):
                continue
        return sorted(found, key=lambda v: v.created_at)

    async def get(self, volume_id: str) -> Volume | None:
        got = await self.etcd.call("read a volume", lambda c: c.get((BY_ID + volume_id).encode()), again=True)
        if got is None:
            return None
        try:
            return Volume.from_json(json.loads(bytes(got.value)))
        except (ValueError, KeyError, TypeError):
            return None

    async def remove(self, volume: Volume) -> None:
        name_key = f"{BY_NAME}{volume.team}/{volume.name}".encode()
        await self._txn("delete a volume", [], [TXN.delete((BY_ID + volume.id).encode()), TXN.delete(name_key)])
