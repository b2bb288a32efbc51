"""Where volumes' records are kept: SQLite in the data dir for a node alone (``volumes.db``,
owner-only: it holds their tokens); etcd in a cluster (``/aenv/volumes/v/<id>``, its name claimed
per team: aenv/cluster/named.py)."""

from __future__ import annotations

import json
import sqlite3
from typing import Protocol

from aenv.cluster.entries import PREFIX
from aenv.cluster.named import NamedEntries, NameTaken
from aenv.cluster.store import ClusterStore
from aenv.storage.sqlite import SqliteFile
from aenv.volumes.model import Volume

VOLUMES = PREFIX + "volumes/"
__all__ = ["EtcdVolumeStore", "NameTaken", "SqliteVolumeStore", "VolumeStore"]


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


class EtcdVolumeStore(NamedEntries[Volume]):
    def __init__(self, store: ClusterStore) -> None:
        super().__init__(store, VOLUMES, "volume", Volume.from_json)

    async def all(self) -> list[Volume]:
        return sorted(await super().all(), key=lambda v: v.created_at)
