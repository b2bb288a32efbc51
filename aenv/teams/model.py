"""What a team is, what its keys are (digests, never the keys), and who a request acts for.

``Principal`` is set per request by the front of the node or gateway (``PRINCIPAL``, a context
variable the routes and the node read): the team it acts for, and whether it holds the admin key.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import math
import re
import secrets
import uuid
from contextvars import ContextVar
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from aenv.errors import InvalidRequest

DEFAULT_TEAM = "default"  # the admin key's team; records made before teams existed are its
ALL_TEAMS = "*"  # X-Team-ID of the deployment's own calls (gateways, drains) with the admin key
KEY_PREFIX = "e2b_"  # E2B's: SDKs that check a key's shape accept these
KEY_HEX = 40
ADMIN_KEY_ID = "00000000-0000-4000-8000-000000000000"  # the admin key as listed under /api-keys
MAX_NAME = 128
MAX_TEAMS = 10_000
MAX_KEYS_PER_TEAM = 100
TEAM_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")  # a path segment and an etcd key segment
PUBLIC_TEMPLATES = frozenset({"base", "desktop"})  # built-in: usable by every team whatever their record says


@dataclass(frozen=True, slots=True)
class Quotas:
    """A team's limits; 0 is no limit. ``running``: sandboxes not paused (creating, running,
    resuming, ...); ``paused``; ``creates_per_second`` (a window of max(1, 1/rate) seconds);
    ``fork``: children of one fork; ``disk_mb``: the disk quotas of its sandboxes, paused ones
    included, added up; ``volumes``: the volumes it keeps."""

    running: int = 0
    paused: int = 0
    creates_per_second: float = 0.0
    fork: int = 0
    disk_mb: int = 0
    volumes: int = 0  # volumes it keeps (aenv/volumes)

    @classmethod
    def parse(cls, body: Any, base: Quotas | None = None) -> Quotas:
        """From a client's JSON (camelCase or snake_case keys), over ``base``; strict types."""
        if not isinstance(body, dict):
            raise InvalidRequest("quotas must be an object")
        values = asdict(base or cls())
        for key, value in body.items():
            name = QUOTA_NAMES.get(key)
            if name is None:
                raise InvalidRequest(f"unknown quota {str(key)[:40]!r} (known: {', '.join(sorted(QUOTA_WIRE))})")
            if value is None:
                value = 0
            kind = float if name == "creates_per_second" else int
            if isinstance(value, bool) or not isinstance(value, int | float) or (kind is int and value != int(value)):
                raise InvalidRequest(f"quota {key} must be a {'number' if kind is float else 'whole number'}")
            if not math.isfinite(value) or value < 0 or value > 1e9:
                raise InvalidRequest(f"quota {key} must be between 0 (no limit) and 1e9")
            values[name] = kind(value)
        return cls(**values)

    def wire(self) -> dict[str, Any]:
        return {QUOTA_WIRE[f.name]: getattr(self, f.name) for f in fields(self)}


QUOTA_WIRE = {
    "running": "maxRunning",
    "paused": "maxPaused",
    "creates_per_second": "createsPerSecond",
    "fork": "maxFork",
    "disk_mb": "maxDiskMB",
    "volumes": "maxVolumes",
}
QUOTA_NAMES = {**{v: k for k, v in QUOTA_WIRE.items()}, **{k: k for k in QUOTA_WIRE}}


@dataclass(frozen=True, slots=True)
class Team:
    id: str
    name: str
    created_at: float
    quotas: Quotas = field(default_factory=Quotas)

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "created_at": self.created_at, "quotas": asdict(self.quotas)}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Team:
        quotas = body.get("quotas") or {}
        known = {f.name for f in fields(Quotas)}
        return cls(
            id=str(body["id"]),
            name=str(body["name"]),
            created_at=float(body["created_at"]),
            quotas=Quotas(**{k: v for k, v in quotas.items() if k in known}),
        )


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A key as kept: its digest and what E2B lists of it (the mask), never the key."""

    id: str
    team: str
    name: str
    digest: str  # sha256 hex of the whole key
    mask_prefix: str  # E2B's IdentifierMaskingDetails: the first 2 and last 4 characters after the prefix
    mask_suffix: str
    length: int
    created_at: float
    prefix: str = KEY_PREFIX

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> ApiKey:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in body.items() if k in known})

    def wire(self) -> dict[str, Any]:
        """E2B's TeamAPIKey."""
        return {
            "id": self.id,
            "name": self.name,
            "mask": {
                "prefix": self.prefix,
                "valueLength": self.length,
                "maskedValuePrefix": self.mask_prefix,
                "maskedValueSuffix": self.mask_suffix,
            },
            "createdAt": rfc3339(self.created_at),
            "createdBy": None,
            "lastUsed": None,
        }


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()


def same_digest(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def new_key(team: str, name: str, now: float) -> tuple[str, ApiKey]:
    """A fresh key (returned once) and its record."""
    value = secrets.token_hex(KEY_HEX // 2)
    raw = KEY_PREFIX + value
    rec = ApiKey(
        id=str(uuid.uuid4()),
        team=team,
        name=name,
        digest=digest(raw),
        mask_prefix=value[:2],
        mask_suffix=value[-4:],
        length=len(value),
        created_at=now,
    )
    return raw, rec


def masked(key: str, *, key_id: str, team: str, name: str, created_at: float) -> ApiKey:
    """The record of a key that is configured, not made here (the admin key)."""
    value = key.removeprefix(KEY_PREFIX) if key.startswith(KEY_PREFIX) else key
    prefix = KEY_PREFIX if key.startswith(KEY_PREFIX) else ""
    return ApiKey(
        id=key_id,
        team=team,
        name=name,
        digest=digest(key),
        mask_prefix=value[:2] if len(value) > 6 else "",
        mask_suffix=value[-4:] if len(value) > 6 else "",
        length=len(value),
        created_at=created_at,
        prefix=prefix,
    )


def check_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidRequest(f"{what} must be a non-empty string")
    if len(value) > MAX_NAME or not value.isprintable():
        raise InvalidRequest(f"{what} must be at most {MAX_NAME} printable characters")
    return value.strip()


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True, slots=True)
class Principal:
    """Who a request acts for. ``team``: the team whose objects it sees and whose new objects it
    makes; ``admin``: it holds the deployment's admin key; ``all_teams``: the admin key acting for
    the deployment itself (X-Team-ID: *), which sees every team's objects."""

    team: str
    admin: bool = False
    all_teams: bool = False
    key_id: str = ""

    def sees(self, owner: str) -> bool:
        return self.all_teams or (owner or DEFAULT_TEAM) == self.team


# Unset outside requests (the node's own tasks: reaper, drains, warm pools): those see everything.
PRINCIPAL: ContextVar[Principal | None] = ContextVar("aenv_principal", default=None)


def current() -> Principal | None:
    return PRINCIPAL.get()


def team_in_view() -> str | None:
    """Whose records a request sees: its team's; None for the deployment's own calls (the admin
    key with X-Team-ID *, every team's); the default team's on a node without an API key."""
    who = PRINCIPAL.get()
    if who is None:
        return DEFAULT_TEAM
    return None if who.all_teams else who.team


def team_of_new() -> str:
    """The team a record made now belongs to: the request's (the default team outside one)."""
    who = PRINCIPAL.get()
    return DEFAULT_TEAM if who is None or who.all_teams else who.team


def sees(owner: str) -> bool:
    who = PRINCIPAL.get()
    return who is None or who.sees(owner)


def template_visible(team: str, name: str, public: bool) -> bool:
    """Whether the current request may use a template owned by ``team``."""
    return public or name in PUBLIC_TEMPLATES or sees(team)
