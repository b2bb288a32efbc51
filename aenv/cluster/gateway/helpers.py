"""Small pure helpers of the gateway: what a sandbox's entry says about where it may run, and how a
node's JSON answers are read. No I/O here, so every other module of the gateway may use them."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

import httpx
from starlette.requests import Request

from aenv.api import listing
from aenv.cluster.entries import NodeEntry, SandboxEntry
from aenv.cluster.gateway.settings import MAX_HINTS
from aenv.cluster.mirror import Mirror
from aenv.errors import AenvError, InvalidRequest, UpstreamError, from_body

SANDBOX_INFO = re.compile(r"^/sandboxes/[^/]+$")  # a sandbox itself: its GET is its info, its DELETE a kill


@dataclass(frozen=True, slots=True)
class Traffic:
    """Sandbox traffic that may wake a paused sandbox: its port, its (lowercased) headers, and
    whether a signed URL already proved it holds the sandbox's token."""

    port: int
    headers: dict[str, str]
    signed: bool = False


@dataclass(frozen=True, slots=True)
class NodePage:
    """One node's answer to a list: its items, whether it has more, its X-Total-Running."""

    items: list[dict[str, object]]
    more: bool
    running: int | None


# -- a sandbox's entry ----------------------------------------------------------------------------
def cluster_paused(entry: SandboxEntry) -> bool:
    """Paused and in the snapshot repository: any node may resume it (its own node or not)."""
    return entry.durable and entry.state == "paused"


def cluster_paused_at(mirror: Mirror, sandbox_id: str, node: NodeEntry) -> bool:
    """Durably paused, by the mirror, on ``node`` (its owner, up)."""
    entry, owner = mirror.owner(sandbox_id)
    return entry is not None and owner is not None and owner.node_id == node.node_id and cluster_paused(entry)


def movable(entry: SandboxEntry, node: NodeEntry | None) -> bool:
    """A resume of this sandbox goes to another node: it is durably paused on a node that is gone
    or draining (which takes no new work)."""
    return cluster_paused(entry) and (node is None or node.draining)


def full_owner(entry: SandboxEntry, node: NodeEntry | None) -> bool:
    """Durably paused on a node that is up but, by its last entry, has no room to resume it."""
    return cluster_paused(entry) and node is not None and not node.draining and node.room <= 0


def becoming_durable(entry: SandboxEntry | None, node: NodeEntry | None) -> bool:
    """Paused (or being paused) on a draining node, its pause not durable yet but to be."""
    return (
        entry is not None
        and node is not None
        and node.draining
        and entry.state == "paused"
        and not entry.durable
        and "durableReason" not in entry.listed
    )


def auto_resumes(entry: SandboxEntry) -> bool:
    lifecycle = entry.listed.get("lifecycle")
    return isinstance(lifecycle, dict) and lifecycle.get("autoResume") is True


def wakes(entry: SandboxEntry) -> bool:
    """Whether traffic resumes this paused sandbox: auto-resume, and paused with its memory (a
    resume without it is a reboot, which only an explicit connect does)."""
    return auto_resumes(entry) and entry.listed.get("pausedWithMemory") is True


# -- a node's answers -----------------------------------------------------------------------------
def note_node(answer: object, node: NodeEntry) -> None:
    """``GET /sandboxes/{id}`` says which node serves the sandbox."""
    if isinstance(answer, dict):
        answer["nodeID"] = node.node_id


def json_answer(upstream: httpx.Response, content: bytes) -> object | None:
    """A node's successful JSON answer, parsed; None for anything else (passed on as it came)."""
    if not 200 <= upstream.status_code < 300 or "content-encoding" in upstream.headers:
        return None
    try:
        answer: object = json.loads(content)
    except ValueError:
        return None
    return answer if isinstance(answer, dict | list) else None


def note(table: dict[str, tuple[str, float]], key: str, node_id: str, keep: float) -> None:
    """Note ``key`` -> ``node_id`` in a table bounded in size (MAX_HINTS) and age (``keep``)."""
    now = time.monotonic()
    if len(table) >= MAX_HINTS:
        for old in [k for k, (_, at) in table.items() if now - at >= keep]:
            del table[old]
    if len(table) < MAX_HINTS:
        table[key] = (node_id, now)


def parsed(content: bytes) -> object:
    try:
        return json.loads(content)
    except ValueError:
        return None


def error_code(content: bytes) -> str:
    try:
        body = json.loads(content)
    except ValueError:
        return ""
    return str(body.get("error_code", "")) if isinstance(body, dict) else ""


def position(item: dict[str, object]) -> listing.Position:
    """Where a node's listed sandbox stands in a list's order (its start time and id)."""
    try:
        return listing.Position(listing.parse_time(str(item.get("startedAt")), "startedAt"), str(item.get("sandboxID")))
    except InvalidRequest:
        raise UpstreamError("a node listed a sandbox without a valid startedAt") from None


def snapshot_position(item: dict[str, object]) -> listing.Position:
    """Where a node's listed snapshot stands in the snapshots' order (its creation time and id)."""
    try:
        return listing.Position(
            listing.parse_time(str(item.get("createdAt")), "createdAt"), str(item.get("snapshotID"))
        )
    except InvalidRequest:
        raise UpstreamError("a node listed a snapshot without a valid createdAt") from None


def limit_of(request: Request) -> int:
    """A v2 list's page size, checked as a node checks it."""
    raw_limit = request.query_params.get("limit", "100")
    if not raw_limit.isdecimal() or not 1 <= int(raw_limit) <= 100:
        raise InvalidRequest("limit must be an integer from 1 to 100")
    return int(raw_limit)


def node_error(status: int, content: bytes, node: NodeEntry) -> AenvError:
    """A node's refusal of a fan-out request, as the node said it (a client's mistake stays 4xx)."""
    body = parsed(content)
    if status < 500 and isinstance(body, dict):
        return from_body(status, body)
    return UpstreamError(f"node {node.node_id} answered the list with {status}")
