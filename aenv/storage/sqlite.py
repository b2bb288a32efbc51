"""One SQLite file behind aiosqlite: the node's records and the teams' keys each keep one."""

from __future__ import annotations

import os
from pathlib import Path

import aiosqlite


class SqliteFile:
    """A database file opened in WAL mode (readers never wait for the writer) with its schema
    applied; ``open`` is idempotent. The file is made owner-only: it holds tokens and key digests."""

    schema = ""
    synchronous = "NORMAL"  # WAL: a power cut may lose the last commits, never the file
    label = "database"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._db: aiosqlite.Connection | None = None

    async def open(self) -> None:
        if self._db is not None:
            return
        os.close(os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600))
        self._db = await aiosqlite.connect(self.path)
        await self._db.execute("PRAGMA journal_mode=WAL")
        await self._db.execute(f"PRAGMA synchronous={self.synchronous}")
        await self._db.executescript(self.schema)
        await self._db.commit()

    async def close(self) -> None:
        if self._db is not None:
            await self._db.close()
            self._db = None

    @property
    def db(self) -> aiosqlite.Connection:
        assert self._db is not None, f"{self.label} is not open"
        return self._db
