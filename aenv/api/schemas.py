"""Request bodies and response shapes of the control plane, with E2B's field names.

Request bodies are validated strictly: a JSON boolean is not a number (``timeout: true`` is not
one second), a number is not a boolean and a string is neither; E2B's SDKs send the real types.
"""

from __future__ import annotations

import datetime as dt
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from aenv.config import MAX_NPROC
from aenv.errors import snippet
from aenv.guest.agent import AGENT_VERSION
from aenv.node.service import (
    PUBLIC_STATE,
    LiveSandbox,
    NodeService,
    SandboxRecord,
    SnapshotRecord,
    Spawned,
    TemplateRecord,
)
from aenv.teams.model import DEFAULT_TEAM
from aenv.templates.catalog import TEMPLATE_NAME

# A create's labels and environment: a sandbox's metadata is listed, filtered on, kept in the
# cluster's entries and shown on the dashboard; its env vars reach every process's environment,
# where a NUL cuts a string short and "=" in a name splits it.
MAX_METADATA = 128  # entries
MAX_METADATA_KEY = 256  # bytes (UTF-8)
MAX_METADATA_VALUE = 4096
MAX_METADATA_TOTAL = 64 * 1024  # keys and values together
MAX_ENV_VARS = 1024
MAX_ENV_NAME = 256
MAX_ENV_VALUE = 64 * 1024  # well within Linux's 128 KiB for one "NAME=value"
MAX_ENV_TOTAL = 512 * 1024
ENV_VALUE_CONTROLS = frozenset("\t\n\r")  # multi-line values (a PEM key, a JSON document) are common


def _control(text: str, allowed: frozenset[str] = frozenset()) -> int | None:
    """The offset of the first control character (C0, DEL, C1) not in ``allowed``, or None."""
    return next(
        (i for i, c in enumerate(text) if (c < " " or "\x7f" <= c <= "\x9f") and c not in allowed),
        None,
    )


def check_labels(
    labels: dict[str, str],
    *,
    noun: str,
    entries: int,
    key: int,
    value: int,
    total: int,
    value_controls: frozenset[str] = frozenset(),
    no_equals: bool = False,
) -> None:
    """Raise ValueError for a map a create may not set (its field's 400, saying which entry and why)."""
    if len(labels) > entries:
        raise ValueError(f"at most {entries} entries, not {len(labels)}")
    size = 0
    for k, v in labels.items():
        shown = snippet(k, 64)
        if not k:
            raise ValueError(f"a {noun} must not be empty")
        if len(k.encode()) > key:
            raise ValueError(f"{noun} {shown!r} is longer than {key} bytes")
        if len(v.encode()) > value:
            raise ValueError(f"the value of {shown!r} is longer than {value} bytes")
        if (at := _control(k)) is not None:
            raise ValueError(f"{noun} {shown!r} has a control character at offset {at}")
        if no_equals and "=" in k:
            raise ValueError(f"{noun} {shown!r} contains '='")
        if (at := _control(v, value_controls)) is not None:
            raise ValueError(f"the value of {shown!r} has a control character at offset {at}")
        size += len(k.encode()) + len(v.encode())
    if size > total:
        raise ValueError(f"{size} bytes in all, more than {total}")


def check_metadata(value: dict[str, str]) -> None:
    """A sandbox's metadata within its bounds (ValueError saying which entry and why)."""
    check_labels(
        value,
        noun="key",
        entries=MAX_METADATA,
        key=MAX_METADATA_KEY,
        value=MAX_METADATA_VALUE,
        total=MAX_METADATA_TOTAL,
    )


class Lifecycle(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    on_timeout: str | None = Field(None, alias="onTimeout")
    auto_resume: bool | None = Field(None, alias="autoResume")
    keep_memory: bool | None = Field(None, alias="keepMemory")  # as a sandbox's detail shows its lifecycle


class AutoResume(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    enabled: bool = False
    policy: Literal["any", "off"] | None = None  # E2B's first form of it ("any": enabled)

    @property
    def on(self) -> bool:
        return self.enabled or self.policy == "any"


class SandboxIam(BaseModel):
    """E2B's workload identity (``iam.tokens``): not built; a non-empty ``tokens`` is refused."""

    model_config = ConfigDict(strict=True, extra="forbid")
    tokens: dict[str, dict[str, Any]] | None = None


class Limits(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    cpu_count: float | None = Field(None, alias="cpuCount", gt=0, le=64)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=128, le=262144)
    nproc: int | None = Field(None, ge=16, le=MAX_NPROC)
    disk_mb: int | None = Field(None, alias="diskSizeMB", ge=64, le=1048576)


class NewSandbox(BaseModel):
    """E2B NewSandbox / NewSandboxV2 (every field any version of its spec had), plus aenv's
    lifecycle and limits. An unknown or misspelt field is a 400: ignored, it would make a sandbox
    other than the one asked for (``templateId`` would have been ``base``)."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    # a template or snapshot id, name or alias, or an OCI image reference (aenv/templates/image_sources.py)
    template_id: str = Field("base", alias="templateID", min_length=1, max_length=512)
    timeout: int | None = Field(None, gt=0)
    # aenv's: seconds after its timeout it is held for scoring commands only (aenv/node/grace.py)
    grace: int | None = Field(None, ge=0)
    metadata: dict[str, str] | None = None
    env_vars: dict[str, str] | None = Field(None, alias="envVars")
    auto_pause: bool | None = Field(None, alias="autoPause")
    # false: the timeout's auto-pause keeps only the file system (resuming it reboots the sandbox)
    auto_pause_memory: bool | None = Field(None, alias="autoPauseMemory")
    auto_resume: AutoResume | bool | None = Field(None, alias="autoResume")
    lifecycle: Lifecycle | None = None
    secure: bool | None = None  # None: secure (aenv's default)
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    limits: Limits | None = None
    # aenv's: an OCI image reference to create from, whatever templates there are (not with templateID)
    image: str | None = Field(None, min_length=1, max_length=512)
    # E2B's API only records the MCP servers' names; its SDKs start the MCP gateway inside the
    # sandbox themselves (from an `mcp-gateway` template), which works here unchanged.
    mcp: dict[str, Any] | None = None
    iam: SandboxIam | None = None  # refused unless empty (not built)
    volume_mounts: list[dict[str, Any]] | None = Field(None, alias="volumeMounts", max_length=64)  # aenv/volumes

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            check_metadata(value)
        return value

    @field_validator("env_vars")
    @classmethod
    def _env_vars(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is not None:
            check_labels(
                value,
                noun="name",
                entries=MAX_ENV_VARS,
                key=MAX_ENV_NAME,
                value=MAX_ENV_VALUE,
                total=MAX_ENV_TOTAL,
                value_controls=ENV_VALUE_CONTROLS,
                no_equals=True,
            )
        return value


class NetworkUpdate(BaseModel):
    """PUT /sandboxes/{id}/network: E2B's SandboxNetworkUpdate; it replaces the egress rules."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    allow_out: list[str] | None = Field(None, alias="allowOut")
    deny_out: list[str] | None = Field(None, alias="denyOut")
    # Spelled so by both E2B SDKs in an update (not allowInternetAccess as in a create).
    allow_internet_access: bool | None = None


class ImageTemplate(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    name: str = Field(..., pattern=f"^{TEMPLATE_NAME}$")
    image: str = Field(..., min_length=1, max_length=512)
    # A login for the image's registry (used for this pull only, never stored).
    username: str | None = Field(None, min_length=1, max_length=512)
    password: str | None = Field(None, max_length=8192)


class TemplatePatch(BaseModel):
    """aenv's ``aliases`` (replaced) and E2B's ``public`` (every team may use it), either or both."""

    model_config = ConfigDict(strict=True, extra="forbid")
    aliases: list[str] | None = Field(None, max_length=64)
    public: bool | None = None


class WarmPoolSize(BaseModel):
    """``size``: the most idle sandboxes the template's warm pool keeps; null: the node's default."""

    model_config = ConfigDict(strict=True, extra="forbid")
    size: int | None = Field(..., ge=0, le=1000)


class Timeout(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    timeout: int = Field(..., ge=0)  # 0: expire now (E2B's minimum)


class PauseBody(BaseModel):
    """E2B's SandboxPauseRequest: ``memory: false`` keeps only the file system."""

    model_config = ConfigDict(strict=True, extra="ignore")
    memory: bool = True


class ConnectBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    # None: the sandbox's own timeout (the one it was last given), where E2B's default is 300 s
    timeout: int | None = Field(None, gt=0)
    # false: a paused sandbox boots fresh on its files, whatever its pause kept (E2B's reboot)
    memory: bool = True


class SnapshotBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str | None = Field(None, min_length=1, max_length=200)
    # Answer only once the snapshot is committed to the repository (else it is committed after).
    durable: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        # listed, shown and named in creates as labels are: no NUL, line break or escape
        if value is not None and (at := _control(value)) is not None:
            raise ValueError(f"the name has a control character at offset {at}")
        return value


class ForkBody(BaseModel):
    """E2B's SandboxForkRequest, plus aenv's ``metadata`` for the children (one map added to the
    source's metadata for every child, or a list of ``count`` maps, one per child) and ``volumes``
    (whether the children share the source's volumes or get copies of their own). Unknown fields
    are a 400 (an ``n`` ignored was one child); the node bounds ``count`` by AENV_MAX_FORK."""

    model_config = ConfigDict(strict=True, extra="forbid")
    count: int = Field(1, ge=1)
    timeout: int | None = Field(None, gt=0)
    metadata: dict[str, str] | list[dict[str, str]] | None = None
    # "clone": each child mounts its own copy of each of the source's volumes, as they were at the
    # fork (GRPO children that must not see each other's writes); "shared": the volumes themselves
    volumes: Literal["shared", "clone"] = "shared"

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str] | list[dict[str, str]] | None) -> Any:
        for each in [value] if isinstance(value, dict) else value or []:
            check_metadata(each)
        return value

    def children_metadata(self, source: dict[str, str]) -> list[dict[str, str]] | None:
        """Each child's own metadata (None: the source's for all), checked merged with the source's."""
        if self.metadata is None:
            return None
        each = [self.metadata] * self.count if isinstance(self.metadata, dict) else self.metadata
        if len(each) != self.count:
            raise ValueError(f"metadata names {len(each)} children, the fork makes {self.count}")
        for i, extra in enumerate(each):
            try:
                check_metadata({**source, **extra})
            except ValueError as exc:
                raise ValueError(f"child {i}'s metadata with its source's: {exc}") from None
        return [dict(extra) for extra in each]


class RefreshBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    duration: int = Field(60, gt=0, le=3600)


def rfc3339(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).isoformat().replace("+00:00", "Z")


def sandbox_json(node: NodeService, sb: LiveSandbox, domain: str | None) -> dict[str, Any]:
    """E2B's `Sandbox` (create/connect response)."""
    rec = sb.rec
    out: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.id,
        "clientID": "aenv",
        "envdVersion": AGENT_VERSION,
        "domain": domain,
    }
    if rec.secure:
        out["envdAccessToken"] = node.access_token(rec.id)
    if not rec.public_traffic:
        out["trafficAccessToken"] = node.traffic_token(rec.id)
    if rec.alias:
        out["alias"] = rec.alias
    return out


def sandbox_detail(node: NodeService, sb: LiveSandbox, domain: str | None) -> dict[str, Any]:
    """E2B's `SandboxDetail` / `ListedSandbox`, plus aenv's own fields."""
    rec = sb.rec
    limits = node.limits_of(rec)
    out = sandbox_json(node, sb, domain)
    out.update(
        {
            "startedAt": rfc3339(rec.started_at),
            "endAt": rfc3339(rec.end_at),
            "cpuCount": max(1, int(limits.cpu_count)),
            "memoryMB": limits.memory_mb,
            "diskSizeMB": limits.disk_mb,
            "state": PUBLIC_STATE[rec.state],
            "metadata": rec.metadata,
            "allowInternetAccess": rec.allow_internet_access,
            "network": network_json(rec),
            "lifecycle": {
                "onTimeout": "pause" if rec.auto_pause else "kill",
                "autoResume": rec.auto_resume,
                "keepMemory": rec.auto_pause_memory,
            },
            "aenvState": rec.state.value,
            "teamID": rec.team or DEFAULT_TEAM,  # whose (an operator's listing of every team's)
            "volumeMounts": [{"name": m["name"], "path": m["path"]} for m in rec.volume_mounts],
        }
    )
    if node.is_dozing(sb):
        out["dozing"] = True
    if rec.state.value == "paused":
        out["pausedWithMemory"] = not rec.filesystem_only
        out["durable"] = node.is_durable(rec)
        reason = node.durable_reason(rec)
        if reason:
            out["durableReason"] = reason
    if rec.grace:
        out["grace"] = rec.grace
        out["graceEndAt"] = rfc3339(rec.end_at + rec.grace)
    if rec.parent_id:
        out["parentID"] = rec.parent_id
    if rec.snapshot_id:
        out["snapshotID"] = rec.snapshot_id
    return out


def network_json(rec: SandboxRecord) -> dict[str, Any]:
    """E2B's `SandboxNetworkConfig` of a sandbox: its egress rules and its ingress options when set."""
    out = dict(rec.network)
    if not rec.public_traffic:
        out["allowPublicTraffic"] = False
    if rec.mask_request_host:
        out["maskRequestHost"] = rec.mask_request_host
    return out


def snapshot_json(snap: SnapshotRecord) -> dict[str, Any]:
    return {
        "snapshotID": snap.id,
        "names": [snap.name] if snap.name else [],
        "sandboxID": snap.sandbox_id,
        "templateID": snap.template_id,
        "createdAt": rfc3339(snap.created_at),
        **repository_json(snap),
    }


def repository_json(rec: SnapshotRecord | TemplateRecord) -> dict[str, Any]:
    """Whether the repository holds it yet, and what committing it cost."""
    if not rec.committed_at:
        return {"committed": False}
    c = rec.commit
    return {
        "committed": True,
        "commit": {
            "committedAt": rfc3339(rec.committed_at),
            "logicalBytes": c.get("logical_bytes", 0),
            "uploadedBytes": c.get("new_bytes", 0),
            "chunks": c.get("chunks", 0),
            "newChunks": c.get("new_chunks", 0),
            "seconds": c.get("seconds", 0.0),
        },
    }


DEFAULT_TEMPLATES = ("base", "desktop")  # what every deployment offers, built (E2B's default templates)


def template_json(t: TemplateRecord, node: NodeService, spawns: Spawned | None = None) -> dict[str, Any]:
    """E2B's ``Template`` (every field of its model), and aenv's own: name, layers, sandboxes on
    this node, the repository's commit. ``spawns``: its uses on this node (aenv/node/spawns.py)."""
    limits = {"cpu_count": node.settings.cpu_count, "memory_mb": node.settings.memory_mb}
    limits |= {"disk_mb": node.settings.disk_mb} | {k: v for k, v in t.limits.items() if v is not None}
    used = spawns or Spawned()
    return {
        "templateID": t.id,
        "buildID": t.e2b_build_id(),
        "name": t.name,
        "names": [t.name],
        "aliases": [t.name, *t.aliases],
        "cpuCount": max(1, int(limits.get("cpu_count") or 1)),
        "memoryMB": int(limits.get("memory_mb") or 0),
        "diskSizeMB": int(limits.get("disk_mb") or 0),
        "createdAt": rfc3339(t.created_at),
        "updatedAt": rfc3339(max(t.created_at, t.committed_at)),
        "createdBy": None,
        "lastSpawnedAt": rfc3339(used.last) if used.last else None,
        "spawnCount": used.count,
        "buildCount": max(1, len(t.build_ids)),
        "buildStatus": "ready",
        "isDefault": t.name in DEFAULT_TEMPLATES,
        "layers": len(t.layers),
        "description": t.description,
        "sandboxes": sum(1 for sb in node.sandboxes.values() if sb.rec.template_id in (t.id, t.name)),
        "envdVersion": AGENT_VERSION,
        "public": t.public or t.name in DEFAULT_TEMPLATES,  # every team may use it (aenv/teams)
        **repository_json(t),
    }
