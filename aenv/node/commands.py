"""The recent commands of a sandbox, as the node saw them started through envd: what an operator
looks at (the dashboard, ``aenv logs``). Bounded: a few commands per sandbox, short texts; the
history lives with the sandbox in the node's memory (gone with it, or with a restart of the node).

The exit code is the one the sandbox's agent reported on the command's stream: the sandbox's own
word, shown as such; a command whose client stopped following it has none.

Each command is also counted on the node's metrics, once, by how it ended (``OUTCOMES``), and the
time from its request to its start in the sandbox is observed (``aenv.node.metrics``). Once it has
ended it goes to the sandbox's rollout log with the end of its output (aenv/node/rollout.py).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.channel import StreamError
from aenv.node import metrics
from aenv.node.rollout import MAX_CMD, OutputTail

MAX_COMMANDS = 50  # per sandbox, the newest kept
MAX_TEXT = 512  # characters of a command line, a directory, a user or a tag kept
MAX_EVENT = 4096  # bytes of a stream message read for its end event (output messages are larger)


@dataclass
class CommandRecord:
    cmd: str
    cwd: str | None
    user: str | None
    tag: str | None
    started_at: float
    pid: int | None = None
    ended_at: float | None = None
    exit_code: int | None = None
    status: str | None = None  # the agent's words for how it ended ("exit status 1", "signal: killed")
    error: str | None = None  # the start failed, or the stream ended with an error
    since: float = field(default_factory=time.monotonic, repr=False)  # its request, for the start latency
    outcome: str | None = field(default=None, repr=False)  # how it was counted (metrics.COMMAND_OUTCOMES)
    line: str = field(default="", repr=False)  # the command line as the rollout log keeps it (longer)
    scoring: bool = False  # started as a scoring command (it may run in the sandbox's grace period)
    output: OutputTail | None = field(default=None, repr=False)  # the end of its output, for the log
    on_end: Callable[[CommandRecord], None] | None = field(default=None, repr=False)  # called once, at its end

    def to_json(self) -> dict[str, Any]:
        return {
            "cmd": self.cmd,
            "cwd": self.cwd,
            "user": self.user,
            "tag": self.tag,
            "pid": self.pid,
            "startedAt": self.started_at,
            "endedAt": self.ended_at,
            "exitCode": self.exit_code,
            "status": self.status,
            "error": self.error,
        }

    def started(self, first: Any) -> None:
        """The stream's first message: ``{"event": {"start": {"pid": N}}}``."""
        start = _event(first).get("start")
        self.pid = _integer(start.get("pid")) if isinstance(start, dict) else None
        metrics.COMMAND_START_SECONDS.observe(time.monotonic() - self.since)

    def message(self, data: bytes) -> None:
        """A later message of the stream; its end event gives the exit code."""
        if self.output is not None and b'"data"' in data:
            self._output(data)
        if len(data) > MAX_EVENT or b'"end"' not in data:
            return
        try:
            end = _event(json.loads(data)).get("end")
        except ValueError:
            return
        if not isinstance(end, dict):
            return
        self.exit_code = _integer(end.get("exitCode"))
        status = end.get("status")
        self.status = _clip(status) if isinstance(status, str) else None
        self.ended_at = time.time()

    def _output(self, data: bytes) -> None:
        assert self.output is not None
        try:
            chunk = _event(json.loads(data)).get("data")
        except ValueError:
            return
        if not isinstance(chunk, dict):
            return
        for stream in ("stdout", "stderr", "pty"):
            text = chunk.get(stream)
            if isinstance(text, str):
                try:
                    self.output.add(stream, base64.b64decode(text, validate=True))
                except (binascii.Error, ValueError):
                    continue

    def log_entry(self) -> dict[str, Any]:
        """Its line of the rollout log (aenv/node/rollout.py adds ``seq``)."""
        entry = self.to_json()
        entry["cmd"] = self.line or self.cmd
        entry["outcome"] = self.outcome
        if self.scoring:
            entry["scoring"] = True
        if self.output is not None:
            entry.update(self.output.json())
        return entry

    def failed(self, message: str, outcome: str = "error") -> None:
        """It did not start, or its stream broke (the sandbox or its agent went away)."""
        self.error = _clip(message)
        self.ended_at = self.ended_at or time.time()
        self._count(outcome)

    def ended(self, error: StreamError | None) -> None:
        """The stream's END: with the agent's error (the command's timeout killed it, or the
        sandbox went away), else after the exit code its end event gave."""
        if error is not None:
            # deadline_exceeded: the agent's words for a command its own timeout killed
            self.failed(error.message, "timeout" if error.code == "deadline_exceeded" else "error")
            return
        self.ended_at = self.ended_at or time.time()
        self._count("error" if self.exit_code is None else "ok" if self.exit_code == 0 else "nonzero")

    def detached(self) -> None:
        """The client stopped following it before its end (the process keeps running)."""
        self._count("detached")

    def _count(self, outcome: str) -> None:
        if self.outcome is None:
            self.outcome = outcome
            metrics.COMMANDS.labels(outcome=outcome).inc()
            if self.on_end is not None:
                self.on_end(self)


class CommandHistory:
    """One sandbox's recent commands (the newest ``MAX_COMMANDS``)."""

    def __init__(self) -> None:
        self._records: deque[CommandRecord] = deque(maxlen=MAX_COMMANDS)

    def start(
        self, process: dict[str, Any], *, user: str | None, tag: str | None, scoring: bool = False
    ) -> CommandRecord:
        args = process.get("args") or []
        cwd = process.get("cwd")
        line = " ".join([str(process.get("cmd", "")), *(str(a) for a in args)])
        record = CommandRecord(
            cmd=_clip(line),
            line=line if len(line) <= MAX_CMD else line[: MAX_CMD - 1] + "…",
            scoring=scoring,
            cwd=_clip(cwd) if isinstance(cwd, str) else None,
            user=_clip(user) if user else None,
            tag=_clip(tag) if tag else None,
            started_at=time.time(),
        )
        self._records.append(record)
        return record

    def running(self) -> list[CommandRecord]:
        """Its commands that started and have not ended (as far as the node saw)."""
        return [r for r in self._records if r.outcome is None and r.pid is not None]

    def recent(self) -> list[dict[str, Any]]:
        """Newest first."""
        return [r.to_json() for r in reversed(self._records)]


def _event(message: Any) -> dict[str, Any]:
    event = message.get("event") if isinstance(message, dict) else None
    return event if isinstance(event, dict) else {}


def _integer(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[: MAX_TEXT - 1] + "…"
