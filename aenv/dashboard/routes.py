"""The node's dashboard routes: the page (open) and the JSON behind it (API key).

A sandbox's own routes (``/sandboxes/{id}/logs``, ``/sandboxes/{id}/family``) sit under the
sandbox's path so that a gateway sends them to the node that owns the sandbox, as any other.
"""

from __future__ import annotations

import os
import stat
from typing import Any

from fastapi import APIRouter, Query, Request
from starlette.responses import Response

from aenv.api.sandboxes import build_host_of, node_of
from aenv.api.schemas import rfc3339
from aenv.dashboard import data, pages
from aenv.errors import NotFound
from aenv.node.service import LiveSandbox

router = APIRouter()
AGENT_LOG = "agent.log"  # in the instance's state directory: what the sandbox's runtime and agent wrote to stderr
MAX_AGENT_LOG = 64 * 1024  # the end of it that is read


@router.get(pages.PREFIX, include_in_schema=False)
@router.get(pages.PREFIX + "/", include_in_schema=False)
@router.get(pages.STATIC + "{name}", include_in_schema=False)
async def dashboard_file(request: Request) -> Response:
    response = pages.page(request.url.path)
    if response is None:
        raise NotFound(f"no dashboard file {request.url.path[:120]!r}")
    return response


@router.get("/dashboard/api/nodes", summary="This node: state, load, capacity and cache use (the dashboard's)")
async def nodes(request: Request) -> list[dict[str, Any]]:
    return [data.node_summary(node_of(request))]


@router.get("/dashboard/api/stats", summary="Lifecycle counters and latency histograms since the node started")
async def stats(request: Request) -> dict[str, Any]:
    return data.stats(node_of(request))


@router.get("/dashboard/api/artifacts", summary="Templates and snapshots: size, commit state, where cached")
async def artifacts(request: Request) -> list[dict[str, Any]]:
    return data.artifacts(build_host_of(request))  # which are on this node's disk


@router.get("/sandboxes/{sandbox_id}/logs", summary="A sandbox's recent commands and its log")
async def logs(request: Request, sandbox_id: str, limit: int = Query(1000, ge=1, le=10_000)) -> dict[str, Any]:
    """E2B's sandbox logs (``logs``, ``logEntries``: the node's events for the sandbox and its
    agent's log lines, oldest first, the newest ``limit``),
    plus aenv's ``commands``: the commands started through envd, newest first, with their exit codes."""
    sb = node_of(request).get(sandbox_id)
    lines, at = _agent_log(sb)
    # What the node did with it (each at its moment), then what its runtime and agent wrote to
    # stderr (its file's time of last write: lines carry none of their own), the newest ``limit``.
    entries = [(e["timestamp"], "node", e["line"]) for e in sb.events.recent()][-limit:]
    room = limit - len(entries)
    entries += [(at, "agent", line) for line in (lines[-room:] if room > 0 else [])]
    return {
        "logs": [{"timestamp": rfc3339(t) if t else None, "line": line} for t, _, line in entries],
        "logEntries": [
            {"timestamp": rfc3339(t) if t else None, "level": "info", "message": line, "fields": {"source": source}}
            for t, source, line in entries
        ],
        "commands": sb.commands.recent(),
    }


@router.get("/sandboxes/{sandbox_id}/family", summary="A sandbox's fork family on its node")
async def family(request: Request, sandbox_id: str) -> dict[str, Any]:
    node = node_of(request)
    return data.family(node, node.get(sandbox_id))


def _agent_log(sb: LiveSandbox) -> tuple[list[str], float]:
    """The last lines of the running instance's agent log and when it was last written. The file
    is the host's (the runtime's stderr), but what is in it came from the sandbox: read without
    following links, only a regular file, only its end."""
    if sb.instance is None:
        return [], 0.0
    path = sb.instance.state_dir / AGENT_LOG
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return [], 0.0
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return [], 0.0
        start = max(0, info.st_size - MAX_AGENT_LOG)
        raw = os.pread(fd, MAX_AGENT_LOG, start)
    finally:
        os.close(fd)
    lines = raw.decode("utf-8", "replace").splitlines()
    if start > 0 and lines:
        lines = lines[1:]  # the first is cut
    return lines, info.st_mtime
