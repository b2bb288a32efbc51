"""Fork across nodes, the gateway's part: what it reads from a fork's answer and what it asks
other nodes for the children the source's node had no room for.

A node forks as many children as it has room for and answers the rest with a per-child 429
``limit_exceeded`` (or the whole fork with one, when it has no room at all, or is draining). The
gateway then snapshots the source durably (committed to the shared repository) and creates the
missing children on other nodes from that snapshot, with the source's metadata, lifecycle,
network and ingress settings, grace period and the fork's timeout (the snapshot carries its env
vars, limits, user and workdir), each with its own metadata of the fork's, as the node gives it.
Pure functions here; the requests are the gateway's (aenv/cluster/gateway/forking.py).
"""

from __future__ import annotations

import datetime as dt
import json
import math
from typing import Any

from aenv.errors import parse_json

ROOM = "limit_exceeded"  # the error a node answers a child (or a fork) it has no room for


# E2B's SandboxForkRequest and aenv's per-child metadata; a node refuses any other
FIELDS = frozenset({"count", "timeout", "metadata", "volumes"})


def asked(body: bytes, max_fork: int) -> tuple[int, int | None, list[dict[str, str]] | None] | None:
    """The fork's ``count``, ``timeout`` and each child's own ``metadata`` (None: none) as a node
    reads them, or None when the body is not one this gateway spreads: one a node refuses (its
    answer goes back as it came), or a ``count`` past the gateway's own ``max_fork``, whatever a
    node configured otherwise answered."""
    try:
        parsed = parse_json(body) if body.strip() else {}
    except ValueError:
        return None
    if not isinstance(parsed, dict) or not FIELDS.issuperset(parsed):
        return None
    if parsed.get("volumes", "shared") != "shared":  # copies of volumes are made on the source's node alone
        return None
    count, timeout, metadata = parsed.get("count", 1), parsed.get("timeout"), parsed.get("metadata")
    if not _positive(count) or count > max_fork or not (timeout is None or _positive(timeout)):
        return None
    if isinstance(metadata, dict):
        metadata = [metadata] * count
    if metadata is not None and not (
        isinstance(metadata, list) and len(metadata) == count and all(_labels(m) for m in metadata)
    ):
        return None
    return count, timeout, metadata


def _labels(value: object) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _positive(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def results_of(status: int, answer: object, count: int) -> list[dict[str, Any]] | None:
    """The node's fork results, one per child asked: its 201 list as it is, its 429 (no room at
    all) as that error for every child. None for anything else (passed on as it came)."""
    if status == 201 and isinstance(answer, list) and len(answer) == count:
        return [r if isinstance(r, dict) else {} for r in answer]
    if status == 429 and isinstance(answer, dict) and answer.get("error_code") == ROOM:
        return [{"error": answer} for _ in range(count)]
    return None


def refused_for_room(result: dict[str, Any]) -> bool:
    error = result.get("error")
    return isinstance(error, dict) and error.get("error_code") == ROOM


def child_body(
    source: dict[str, Any], snapshot_id: str, timeout: int | None, metadata: dict[str, str] | None = None
) -> dict[str, Any]:
    """A create of one child from the source's snapshot with the source's settings (its
    ``GET /sandboxes/{id}``): metadata (with the child's own ``metadata`` added), lifecycle,
    network and ingress, secure, grace; the fork's ``timeout``, else what is left of the source's
    (as the node gives its own children)."""
    lifecycle: dict[str, Any] = source["lifecycle"] if isinstance(source.get("lifecycle"), dict) else {}
    body: dict[str, Any] = {
        "templateID": snapshot_id,
        "timeout": timeout or _left(source.get("endAt")),
        "metadata": {**(source.get("metadata") or {}), **(metadata or {})},
        "secure": "envdAccessToken" in source,
        "network": source.get("network") or {},
        "lifecycle": {
            "onTimeout": lifecycle.get("onTimeout", "kill"),
            "autoResume": bool(lifecycle.get("autoResume", False)),
        },
        "autoPauseMemory": bool(lifecycle.get("keepMemory", True)),
    }
    if isinstance(source.get("allowInternetAccess"), bool):
        body["allow_internet_access"] = source["allowInternetAccess"]
    if _positive(source.get("grace")):
        body["grace"] = source["grace"]
    return body


def _left(end_at: object) -> int:
    """Whole seconds until ``end_at`` (RFC 3339), at least 1."""
    try:
        end = dt.datetime.fromisoformat(str(end_at))
    except ValueError:
        return 1
    if end.tzinfo is None:
        end = end.replace(tzinfo=dt.UTC)
    return max(1, math.floor((end - dt.datetime.now(dt.UTC)).total_seconds()))


def error_of(status: int, content: bytes) -> dict[str, Any]:
    """A node's error answer as a child's error (``{code, message, error_code}``)."""
    try:
        body = json.loads(content)
    except ValueError:
        body = None
    if isinstance(body, dict) and "message" in body:
        return {"code": body.get("code", status), "message": body["message"], "error_code": body.get("error_code")}
    return {"code": status, "message": content[:300].decode("utf-8", "replace"), "error_code": None}
