"""Grace periods: time after a sandbox's timeout to score what its rollout left.

A sandbox created with ``grace`` G is not ended (killed, or paused by its lifecycle) at its
timeout but G seconds after it. At its timeout its commands stop (the agent kills every process
it started but scoring commands) and from then on only scoring commands start (a process start
with the ``Aenv-Scoring: 1`` header, the SDK's ``exec(..., scoring=True)``); anything else is
refused (409 ``wrong_state``), files and ports stay reachable. So a trainer's verifier can run on
the state the rollout reached in its time, however late it asks, and a scoring command that was
running at the timeout runs on. At timeout + G the sandbox ends as any other does at its timeout;
a kill (the rollout helpers kill what they scored) ends it sooner, a new timeout (set_timeout, a
resume) ends the grace period. Fork children inherit their source's grace.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from aenv.channel import StreamError
from aenv.errors import AenvError
from aenv.node.sandbox import LiveSandbox

if TYPE_CHECKING:
    from aenv.node.store import SandboxRecord

log = logging.getLogger("aenv.node")
SCORING_HEADER = "aenv-scoring"
MAX_STOPPED = 1024  # processes one grace period's start stops at most (an agent's list is hostile)


def scoring(headers: Any) -> bool:
    """Whether a process start asks to be a scoring command."""
    return str(headers.get(SCORING_HEADER, "")).strip().lower() in ("1", "true")


def end_of(rec: SandboxRecord) -> float:
    """When the sandbox ends: its timeout, plus its grace period."""
    return rec.end_at + max(0, rec.grace)


def in_grace(rec: SandboxRecord, now: float | None = None) -> bool:
    now = time.time() if now is None else now
    return rec.grace > 0 and rec.end_at <= now < rec.end_at + rec.grace


def refusal(sb: LiveSandbox) -> str | None:
    """Why a command that is not a scoring one may not start now, or None."""
    if not in_grace(sb.rec):
        return None
    return (
        f"sandbox {sb.id} is past its timeout, in its grace period of {sb.rec.grace} s: "
        "only scoring commands run now (exec(..., scoring=True), the Aenv-Scoring: 1 header)"
    )


async def begin(sb: LiveSandbox) -> None:
    """The grace period starts: every process the agent started stops but scoring commands."""
    sb.events.note(f"timed out: in its grace period of {sb.rec.grace} s (scoring commands only)")
    link = sb.link
    if link is None:
        return
    keep = {r.pid for r in sb.commands.running() if r.scoring}
    try:
        listed = await link.call("process.list", {})
    except (AenvError, StreamError) as exc:
        log.warning("sandbox %s: its processes could not be listed at its timeout: %s", sb.id, exc)
        return
    processes = listed.get("processes") if isinstance(listed, dict) else None
    pids = [p.get("pid") for p in processes[:MAX_STOPPED] if isinstance(p, dict)] if isinstance(processes, list) else []
    for pid in pids:
        if type(pid) is int and 0 < pid < 2**31 and pid not in keep:
            try:
                await link.call("process.signal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
            except (AenvError, StreamError):
                continue  # it ended meanwhile
