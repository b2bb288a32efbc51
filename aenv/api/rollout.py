"""A sandbox's rollout log: its commands with their output and exit codes, as JSON lines."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response

from aenv.api.sandboxes import node_of

router = APIRouter()
JSONL = "application/jsonl"


@router.get(
    "/sandboxes/{sandbox_id}/rollout-log",
    summary="A sandbox's rollout log: its commands with their output and exit codes (JSON lines)",
    response_class=Response,
    responses={200: {"content": {JSONL: {}}}},
)
async def rollout_log(request: Request, sandbox_id: str) -> Response:
    """One JSON object a line, oldest first, one per command that ended (``seq``, ``sandboxID``
    of the sandbox that ran it, ``cmd``, ``exitCode``, ``stdout``/``stderr`` ends and their
    sizes, ...): running or paused, inherited from a fork's source or a snapshot (aenv/node/rollout.py)."""
    node = node_of(request)
    sb = node.get(sandbox_id)  # 404 for a sandbox this node does not hold
    return Response(node.rollouts.read(sb.id), media_type=JSONL)
