"""A sandbox's lifecycle events and a team's webhooks, in E2B's shapes.

An event is what a trainer follows thousands of sandboxes by without polling them: created,
resumed, updated (a new timeout, new egress rules), paused, killed, checkpointed (a snapshot or
a fork of a sandbox that runs on). E2B answers them camelCase over REST and delivers them
snake_case to webhooks; both shapes are here, made from one record.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

from aenv.teams.model import rfc3339

CREATED = "sandbox.lifecycle.created"
RESUMED = "sandbox.lifecycle.resumed"
UPDATED = "sandbox.lifecycle.updated"
PAUSED = "sandbox.lifecycle.paused"
KILLED = "sandbox.lifecycle.killed"
CHECKPOINTED = "sandbox.lifecycle.checkpointed"
TYPES = (CREATED, RESUMED, UPDATED, PAUSED, KILLED, CHECKPOINTED)
# E2B's deprecated pair, still in its payloads: category "lifecycle" and a one-word label.
LABELS = {CREATED: "create", RESUMED: "resume", UPDATED: "update", PAUSED: "pause", KILLED: "kill"}
VERSION = "v2"
RETENTION_DAYS = 7  # E2B's default: a sandbox's events are there for a week
MAX_LIMIT = 100

MAX_NAME = 256
MAX_URL = 2048
MAX_SECRET = 1024
MIN_SECRET = 8
WEBHOOK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def new_id() -> str:
    """A UUID whose first 48 bits are the time in milliseconds (as UUIDv7): ids sort by age."""
    raw = bytearray(uuid.uuid4().bytes)
    raw[0:6] = int(time.time() * 1000).to_bytes(6, "big")
    raw[6] = (raw[6] & 0x0F) | 0x70
    return str(uuid.UUID(bytes=bytes(raw)))


@dataclass(frozen=True, slots=True)
class LifecycleEvent:
    id: str
    type: str
    timestamp: float
    sandbox_id: str
    team: str
    execution_id: str = ""
    template_id: str = ""
    build_id: str = ""
    data: dict[str, Any] = field(default_factory=dict)

    def api(self) -> dict[str, Any]:
        """E2B's REST shape (GET /events/sandboxes...)."""
        body: dict[str, Any] = {
            "id": self.id,
            "version": VERSION,
            "type": self.type,
            "eventCategory": "lifecycle",
            "eventLabel": LABELS.get(self.type, "checkpoint"),
            "eventData": self.data or None,
            "timestamp": rfc3339(self.timestamp),
            "sandboxId": self.sandbox_id,
            "sandboxExecutionId": self.execution_id,
            "sandboxTemplateId": self.template_id,
            "sandboxBuildId": self.build_id,
            "sandboxTeamId": self.team,
        }
        return body

    def delivery(self) -> dict[str, Any]:
        """What a webhook receives: E2B's payload (snake_case, ``event_data`` left out when
        empty), and the REST names of its fields too for receivers written against E2B's earlier
        documentation, which showed those."""
        body: dict[str, Any] = {
            "id": self.id,
            "version": VERSION,
            "type": self.type,
            "timestamp": rfc3339(self.timestamp),
            "event_category": "lifecycle",
            "event_label": LABELS.get(self.type, "checkpoint"),
        }
        if self.data:
            body["event_data"] = self.data
        body |= {
            "sandbox_id": self.sandbox_id,
            "sandbox_execution_id": self.execution_id,
            "sandbox_template_id": self.template_id,
            "sandbox_build_id": self.build_id,
            "sandbox_team_id": self.team,
            "events_ttl_days": RETENTION_DAYS,
        }
        api = self.api()
        body |= {k: api[k] for k in ("eventData", "sandboxId", "sandboxExecutionId", "sandboxTemplateId")}
        body |= {k: api[k] for k in ("sandboxBuildId", "sandboxTeamId")}
        return body

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "at": self.timestamp,
            "sandbox": self.sandbox_id,
            "team": self.team,
            "execution": self.execution_id,
            "template": self.template_id,
            "build": self.build_id,
            "data": self.data,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> LifecycleEvent:
        data = body.get("data")
        return cls(
            id=str(body["id"]),
            type=str(body["type"]),
            timestamp=float(body["at"]),
            sandbox_id=str(body["sandbox"]),
            team=str(body["team"]),
            execution_id=str(body.get("execution", "")),
            template_id=str(body.get("template", "")),
            build_id=str(body.get("build", "")),
            data=data if isinstance(data, dict) else {},
        )


@dataclass(frozen=True, slots=True)
class Webhook:
    """A team's webhook. ``secret`` signs each delivery and is never answered back."""

    id: str
    team: str
    name: str
    url: str
    events: tuple[str, ...]
    secret: str
    enabled: bool = True
    created_at: float = 0.0

    def api(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "teamId": self.team,
            "name": self.name,
            "createdAt": rfc3339(self.created_at),
            "enabled": self.enabled,
            "url": self.url,
            "events": list(self.events),
        }

    def wants(self, event: LifecycleEvent) -> bool:
        return self.enabled and event.team == self.team and event.type in self.events

    def changed(self, **changes: Any) -> Webhook:
        return replace(self, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "team": self.team,
            "name": self.name,
            "url": self.url,
            "events": list(self.events),
            "secret": self.secret,
            "enabled": self.enabled,
            "createdAt": self.created_at,
        }

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Webhook:
        return cls(
            id=str(body["id"]),
            team=str(body["team"]),
            name=str(body["name"]),
            url=str(body["url"]),
            events=tuple(str(e) for e in body["events"]),
            secret=str(body["secret"]),
            enabled=bool(body.get("enabled", True)),
            created_at=float(body.get("createdAt", 0.0)),
        )


def signature(secret: str, body: bytes) -> str:
    """E2B's ``e2b-signature``: SHA-256 of the secret followed by the raw body, base64 in the
    URL-safe alphabet without padding (as E2B's own verification snippets compute it)."""
    digest = hashlib.sha256(secret.encode() + body).digest()
    return base64.urlsafe_b64encode(digest).decode().rstrip("=")
