"""A secret's record and E2B's rules for names, values and metadata."""

from __future__ import annotations

import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from aenv.errors import InvalidRequest
from aenv.teams.model import rfc3339

NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
ID_PREFIX = "sec_"
MAX_VALUE = 64 * 1024
MAX_METADATA = 32
MAX_KEY, MAX_META_VALUE, MAX_META_TOTAL = 128, 1024, 8192


@dataclass(frozen=True, slots=True)
class Secret:
    id: str
    name: str  # lowercase, unique in its team
    team: str
    version: int
    sealed: str  # the value, encrypted (aenv/secrets/sealing.py); never answered
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0
    updated_at: float = 0.0

    @classmethod
    def new_id(cls) -> str:
        raw = bytearray(uuid.uuid4().bytes)  # time-ordered, as E2B's (a UUIDv7 after the prefix)
        raw[0:6] = int(time.time() * 1000).to_bytes(6, "big")
        raw[6] = (raw[6] & 0x0F) | 0x70
        return ID_PREFIX + uuid.UUID(bytes=bytes(raw)).hex

    def api(self) -> dict[str, Any]:
        return {
            "secretID": self.id,
            "name": self.name,
            "currentVersion": self.version,
            "metadata": dict(self.metadata),
            "createdAt": rfc3339(self.created_at),
            "updatedAt": rfc3339(self.updated_at),
        }

    def changed(self, **changes: Any) -> Secret:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "name": self.name,
            "team": self.team,
            "version": self.version,
            "sealed": self.sealed,
            "metadata": self.metadata,
            "createdAt": self.created_at,
            "updatedAt": self.updated_at,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Secret:
        return cls(
            id=str(body["id"]),
            name=str(body["name"]),
            team=str(body["team"]),
            version=int(body["version"]),
            sealed=str(body["sealed"]),
            metadata={str(k): str(v) for k, v in dict(body.get("metadata") or {}).items()},
            created_at=float(body["createdAt"]),
            updated_at=float(body["updatedAt"]),
        )


def check_name(name: str) -> str:
    name = name.strip()
    if not NAME.fullmatch(name):
        raise InvalidRequest("name: 1-128 letters, digits, '_' or '-'")
    name = name.lower()
    if name.startswith(ID_PREFIX):
        raise InvalidRequest(f"name: may not start with {ID_PREFIX!r} (secret ids do)")
    return name


def check_value(value: str) -> str:
    if not value or len(value.encode()) > MAX_VALUE:
        raise InvalidRequest(f"value: 1 to {MAX_VALUE} bytes")
    return value


def check_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA:
        raise InvalidRequest(f"metadata: at most {MAX_METADATA} entries")
    total = 0
    for key, value in metadata.items():
        if not key or len(key.encode()) > MAX_KEY or len(value.encode()) > MAX_META_VALUE:
            raise InvalidRequest(f"metadata: keys of 1-{MAX_KEY} bytes, values of at most {MAX_META_VALUE}")
        total += len(key.encode()) + len(value.encode())
    if total > MAX_META_TOTAL:
        raise InvalidRequest(f"metadata: at most {MAX_META_TOTAL} bytes in all")
    return dict(metadata)
