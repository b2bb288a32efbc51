"""What happened to a sandbox, as its node saw it: created, paused, resumed, snapshots, forks,
timeouts, durable commits, takeovers, failures. What an operator reads next to the commands
(``aenv logs``, the dashboard, E2B's ``GET /sandboxes/{id}/logs``): the node's words, each with
the moment it happened and, for an operation, how long it took.

Bounded (the newest ``MAX_EVENTS``, short lines); it lives with the sandbox in the node's memory
(through pauses and resumes on that node; not across a node restart or a move to another node).
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from aenv.node.state import SandboxState as S

MAX_EVENTS = 100
MAX_LINE = 300

# States an operation passes through; the stable state after one says how it ended.
TRANSITIONAL = frozenset({S.CREATING, S.PAUSING, S.RESUMING, S.SNAPSHOTTING, S.FORKING, S.KILLING})
ENDED = {
    (S.CREATING, S.RUNNING): "created",
    (S.PAUSING, S.PAUSED): "paused",
    (S.PAUSING, S.RUNNING): "pause failed: it runs on",
    (S.RESUMING, S.RUNNING): "resumed",
    (S.RESUMING, S.PAUSED): "resume failed: it stays paused",
    (S.SNAPSHOTTING, S.RUNNING): "snapshot taken",
    (S.SNAPSHOTTING, S.PAUSED): "snapshot taken; it could not run on: paused",
    (S.FORKING, S.RUNNING): "forked",
    (S.FORKING, S.PAUSED): "forked; it could not run on: paused",
    (S.KILLING, S.KILLED): "killed",
}


class SandboxEvents:
    def __init__(self) -> None:
        self._events: deque[tuple[float, str]] = deque(maxlen=MAX_EVENTS)
        self._began = time.monotonic()  # when the operation in flight began (a sandbox is born creating)

    def transition(self, old: S, new: S) -> None:
        """A state change (``Records.set_state``): an operation's start, or its end with its duration."""
        if new in TRANSITIONAL:
            self._began = time.monotonic()
            return
        words = ENDED.get((old, new))
        if words is None:
            return
        self.note(f"{words} in {(time.monotonic() - self._began) * 1000:.0f} ms")

    def note(self, line: str) -> None:
        self._events.append((time.time(), line[:MAX_LINE]))

    def recent(self) -> list[dict[str, Any]]:
        """Oldest first: ``{"timestamp": seconds, "line": text}``."""
        return [{"timestamp": at, "line": line} for at, line in self._events]
