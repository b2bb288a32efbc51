"""Durable node records in SQLite (WAL): sandboxes, templates and snapshots.

A record is the truth about what exists; node-local directories (layers, uppers, images) are
named by the ids stored here.
"""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, TypeVar, get_args, get_origin, get_type_hints

from aenv.node.state import SandboxState
from aenv.storage.sqlite import SqliteFile

log = logging.getLogger("aenv.node")
MAX_BUILD_IDS = 64  # E2B build ids a template record answers to (its rebuilds that changed nothing)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sandboxes (id TEXT PRIMARY KEY, body TEXT NOT NULL, state TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS templates (id TEXT PRIMARY KEY, name TEXT UNIQUE NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS snapshots (id TEXT PRIMARY KEY, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass
class SandboxRecord:
    id: str
    template_id: str
    started_at: float
    end_at: float
    # The lease it was last given, in seconds (its create, a set_timeout, a resume naming one): what
    # a resume that names none gives it again (0: a record from before, the node's default).
    timeout: int = 0
    # Seconds after its timeout it is held for scoring commands only (aenv/node/grace.py); 0: none.
    grace: int = 0
    # A new sandbox is being created; every later change is Records.set_state's (checked).
    state: SandboxState = SandboxState.CREATING
    auto_pause: bool = False
    auto_resume: bool = False
    auto_pause_memory: bool = True  # a timeout's auto-pause keeps memory (E2B's autoPauseMemory)
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    layers: list[str] = field(default_factory=list)  # layer ids, lowest first
    upper: str = ""  # upper id (its directory holds upper/ and work/)
    image: str = ""  # checkpoint image id while paused
    # Paused without memory: only the layers and upper are kept; the resume boots fresh.
    filesystem_only: bool = False
    instance_id: str = ""  # driver instance while running
    alias: str = ""
    parent_id: str = ""  # the sandbox this one was forked from
    snapshot_id: str = ""  # the snapshot this one was created from
    allow_internet_access: bool = False
    network: dict[str, Any] = field(default_factory=dict)  # E2B's allowOut / denyOut lists
    secure: bool = True
    # E2B's ingress options: ports answer only requests with the traffic token; the Host a port sees
    public_traffic: bool = True
    mask_request_host: str = ""
    paused_at: float = 0.0
    durable_at: float = 0.0  # when the repository got this pause (its entry); 0 = only on this node
    guest: str = ""  # guest bundle of the agent inside (see RootfsSpec.guest)
    user: str = ""  # default user of commands and files ("" = `user`), from the template
    workdir: str = ""  # default working directory ("" = the default user's home)
    start: dict[str, Any] = field(default_factory=dict)  # the template's start command (StartCommand.record)
    team: str = ""  # the team it belongs to ("": the default team's; aenv/teams)
    # Volumes bound into it: {"name", "path", "id"} each (aenv/volumes); its forks mount them too.
    volume_mounts: list[dict[str, str]] = field(default_factory=list)

    def to_json(self) -> str:
        body = asdict(self)
        body["state"] = self.state.value
        return json.dumps(body)

    @classmethod
    def from_json(cls, text: str) -> SandboxRecord:
        body = _known(cls, json.loads(text))
        body["state"] = SandboxState(body["state"])
        return cls(**body)


@dataclass
class TemplateRecord:
    id: str
    name: str
    layers: list[str]
    image: str
    created_at: float
    aliases: list[str] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    description: str = ""
    guest: str = ""
    user: str = ""  # default user and workdir of its sandboxes (the recipe's last USER / WORKDIR)
    workdir: str = ""
    build_id: str = ""  # the E2B build (a UUID) that made it
    # Every E2B build that ended in this record, newest last: a rebuild that changed nothing is this
    # record again, and `name:<its build id>` must start it as well.
    build_ids: list[str] = field(default_factory=list)
    # Its start command (StartCommand.record), run again when a sandbox of it boots fresh.
    start: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0  # when the snapshot repository got it; 0 = only on this node
    commit: dict[str, Any] = field(default_factory=dict)  # the commit's report (bytes, chunks, time)
    # Made from an OCI image: the reference it was pulled as (registry/repository[:tag][@digest])
    # and the digest of the manifest pulled (aenv/templates/image_sources.py finds it by either).
    image_ref: str = ""
    image_digest: str = ""
    team: str = ""  # the team that made it ("": the default team's); others use it only when public
    public: bool = False  # usable by every team (E2B's template `public`; `base` always is)
    # Its image's layers as pulled: layer id -> compressed bytes (the manifest's sizes); the
    # image's size is their sum (GET /images reports it against what the node stores).
    image_layers: dict[str, int] = field(default_factory=dict)

    def e2b_build_id(self) -> str:
        """The build E2B clients see it as: the newest that made it, or one derived from its id."""
        if self.build_ids:
            return self.build_ids[-1]
        return self.build_id or str(uuid.uuid5(uuid.NAMESPACE_OID, self.id))

    def made_by(self, build_id: str) -> bool:
        return build_id == self.e2b_build_id() or build_id == self.build_id or build_id in self.build_ids

    def add_build(self, build_id: str) -> bool:
        """Record that E2B build ``build_id`` ended in this record; whether that changed it."""
        if build_id in self.build_ids:
            return False
        self.build_id = self.build_id or build_id
        self.build_ids = [*self.build_ids, build_id][-MAX_BUILD_IDS:]
        return True

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> TemplateRecord:
        return cls(**_known(cls, json.loads(text)))


@dataclass
class SnapshotRecord:
    id: str
    name: str
    sandbox_id: str
    template_id: str
    layers: list[str]
    image: str
    created_at: float
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    limits: dict[str, Any] = field(default_factory=dict)
    ephemeral: bool = False  # made for a fork; removed when its children are up
    guest: str = ""
    user: str = ""
    workdir: str = ""
    start: dict[str, Any] = field(default_factory=dict)
    committed_at: float = 0.0
    commit: dict[str, Any] = field(default_factory=dict)
    team: str = ""  # its sandbox's team

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> SnapshotRecord:
        return cls(**_known(cls, json.loads(text)))


T = TypeVar("T")


def _known(cls: type[Any], body: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in body.items() if k in names}


def well_typed(rec: Any) -> bool:
    """Whether every field of a record has the type it declares. Records are made from JSON by
    field names alone, and the repository's are written by others: a number for `aliases` made
    every template lookup raise, a number for `name` every /health."""
    hints = get_type_hints(type(rec))
    return all(_has_type(getattr(rec, f.name), hints[f.name]) for f in fields(rec))


def _has_type(value: Any, hint: Any) -> bool:
    if hint is Any:
        return True
    origin, args = get_origin(hint), get_args(hint)
    if origin is list:
        return isinstance(value, list) and all(_has_type(v, args[0]) for v in value)
    if origin is dict:
        key, item = args
        return isinstance(value, dict) and all(_has_type(k, key) and _has_type(v, item) for k, v in value.items())
    if hint is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _kept(records: list[T]) -> list[T]:
    """The records of the right types: an older version imported the repository's untyped."""
    for rec in records:
        if not well_typed(rec):
            log.error("record %.100r has fields of the wrong type: ignored", getattr(rec, "id", "?"))
    return [rec for rec in records if well_typed(rec)]


class Store(SqliteFile):
    schema = SCHEMA
    label = "store"

    # -- sandboxes --------------------------------------------------------------------------------
    async def put_sandbox(self, rec: SandboxRecord) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO sandboxes (id, body, state) VALUES (?, ?, ?)",
            (rec.id, rec.to_json(), rec.state.value),
        )
        await self.db.commit()

    async def delete_sandbox(self, sandbox_id: str) -> None:
        await self.db.execute("DELETE FROM sandboxes WHERE id = ?", (sandbox_id,))
        await self.db.commit()

    async def sandboxes(self) -> list[SandboxRecord]:
        async with self.db.execute("SELECT body FROM sandboxes") as cur:
            return [SandboxRecord.from_json(row[0]) async for row in cur]

    # -- templates --------------------------------------------------------------------------------
    async def put_template(self, rec: TemplateRecord) -> None:
        await self.db.execute(
            "INSERT OR REPLACE INTO templates (id, name, body) VALUES (?, ?, ?)", (rec.id, rec.name, rec.to_json())
        )
        await self.db.commit()

    async def delete_template(self, template_id: str) -> None:
        await self.db.execute("DELETE FROM templates WHERE id = ?", (template_id,))
        await self.db.commit()

    async def templates(self) -> list[TemplateRecord]:
        async with self.db.execute("SELECT body FROM templates") as cur:
            return _kept([TemplateRecord.from_json(row[0]) async for row in cur])

    # -- snapshots --------------------------------------------------------------------------------
    async def put_snapshot(self, rec: SnapshotRecord) -> None:
        await self.db.execute("INSERT OR REPLACE INTO snapshots (id, body) VALUES (?, ?)", (rec.id, rec.to_json()))
        await self.db.commit()

    async def delete_snapshot(self, snapshot_id: str) -> None:
        await self.db.execute("DELETE FROM snapshots WHERE id = ?", (snapshot_id,))
        await self.db.commit()

    async def snapshots(self) -> list[SnapshotRecord]:
        async with self.db.execute("SELECT body FROM snapshots") as cur:
            return _kept([SnapshotRecord.from_json(row[0]) async for row in cur])

    # -- meta ---------------------------------------------------------------------------------------
    async def get_meta(self, key: str) -> str | None:
        async with self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)) as cur:
            row = await cur.fetchone()
            return row[0] if row else None

    async def set_meta(self, key: str, value: str) -> None:
        await self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))
        await self.db.commit()
