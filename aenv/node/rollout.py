"""Rollout logs: every command a sandbox ran through envd, with the end of its output and its exit
code, one JSON line each, kept on the node's disk with the sandbox (``GET
/sandboxes/{id}/rollout-log``, the SDK's ``rollout_log()``, ``aenv logs --output``).

A log is a file per sandbox under ``<data-dir>/rollout``, named by the sandbox's id: it lives as
long as the sandbox does on this node (pauses, resumes and node restarts included) and is removed
with it. A fork child starts with a copy of its source's log (its commands are the child's past
too), a snapshot keeps a copy that sandboxes created from it on this node start with. Bounded:
each command keeps the last ``AENV_ROLLOUT_OUTPUT_KB`` of each stream, each log at most
``AENV_ROLLOUT_LOG_KB`` (its oldest lines go first; ``seq`` numbers every command the log ever
had, so a gap at the start says how many went). What the sandbox printed is hostile data: it is
only ever stored as JSON strings, never interpreted.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("aenv.node")

KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")  # sandbox ids, and "snapshot-" + a snapshot's id
MAX_CMD = 16 * 1024  # characters of a command line kept in the log
KEEP_RATIO = 3 / 4  # a log past its cap is cut to this much of it


def snapshot_key(snapshot_id: str) -> str:
    return f"snapshot-{snapshot_id}"


class OutputTail:
    """The last ``limit`` bytes of each stream a command wrote, and how many it wrote in all."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.kept: dict[str, bytearray] = {}
        self.total: dict[str, int] = {}

    def add(self, stream: str, data: bytes) -> None:
        buf = self.kept.setdefault(stream, bytearray())
        self.total[stream] = self.total.get(stream, 0) + len(data)
        buf += data[-self.limit :] if self.limit else b""
        if len(buf) > 2 * self.limit:  # trimmed now and then, not on every chunk
            del buf[: len(buf) - self.limit]

    def json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for stream in ("stdout", "stderr", "pty"):
            if stream in self.total:
                data = bytes(self.kept[stream][-self.limit :]) if self.limit else b""
                out[stream] = data.decode("utf-8", "replace")
                out[f"{stream}Bytes"] = self.total[stream]
        return out


class RolloutLogs:
    """The node's rollout logs (one per sandbox, one per snapshot), under ``root``."""

    def __init__(self, root: Path, *, log_bytes: int, output_bytes: int) -> None:
        self.root = root
        self.log_bytes = log_bytes
        self.output_bytes = output_bytes
        self._next: dict[str, int] = {}  # key -> the seq of its next entry
        if self.enabled:
            root.mkdir(mode=0o700, parents=True, exist_ok=True)

    @property
    def enabled(self) -> bool:
        return self.log_bytes > 0

    def path(self, key: str) -> Path:
        if not KEY.match(key):
            raise ValueError(f"not a rollout log key: {key[:64]!r}")
        return self.root / f"{key}.jsonl"

    def tail(self) -> OutputTail | None:
        """What a command's output is kept in, or None when logs are off."""
        return OutputTail(self.output_bytes) if self.enabled else None

    def append(self, key: str, entry: dict[str, Any]) -> None:
        """Add one command's entry (its ``seq`` is given here) and keep the log within its cap."""
        if not self.enabled:
            return
        path = self.path(key)
        seq = self._next.get(key)
        if seq is None:
            seq = _next_seq(path)
        self._next[key] = seq + 1
        line = (json.dumps({"seq": seq, **entry}, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, line)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            if size > self.log_bytes:
                self._cut(path)
        except OSError as exc:  # a full disk loses log lines, never a command
            log.warning("rollout log of %s: %s", key, exc)

    def _cut(self, path: Path) -> None:
        lines = path.read_bytes().splitlines(keepends=True)
        keep: list[bytes] = []
        size = 0
        for line in reversed(lines):
            if keep and size + len(line) > self.log_bytes * KEEP_RATIO:
                break
            keep.append(line)
            size += len(line)
        fresh = path.with_suffix(".cut")
        fresh.write_bytes(b"".join(reversed(keep)))
        os.replace(fresh, path)

    def read(self, key: str) -> bytes:
        """The log as JSON lines, oldest first (empty when it has none)."""
        try:
            fd = os.open(self.path(key), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return b""
        with os.fdopen(fd, "rb") as f:
            return f.read(self.log_bytes + 1024 * 1024)

    def copy(self, source: str, target: str) -> None:
        """``target`` starts with ``source``'s log (a fork's child, a snapshot, a create from one)."""
        if not self.enabled:
            return
        try:
            shutil.copyfile(self.path(source), self.path(target), follow_symlinks=False)
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("rollout log of %s not copied to %s: %s", source, target, exc)
            return
        if source in self._next:
            self._next[target] = self._next[source]

    def remove(self, key: str) -> None:
        self._next.pop(key, None)
        try:
            self.path(key).unlink()
        except FileNotFoundError:
            pass
        except (OSError, ValueError) as exc:
            log.warning("rollout log of %s not removed: %s", key, exc)

    def sweep(self, keep: Iterable[str]) -> None:
        """Remove every log whose sandbox or snapshot is gone (at start: what a crash left)."""
        if not self.root.is_dir():
            return
        wanted = {f"{key}.jsonl" for key in keep}
        for entry in os.scandir(self.root):
            if entry.name not in wanted and entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)


def _next_seq(path: Path) -> int:
    """One past the last entry's seq of a log this node run has not written yet."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return 0
    for line in reversed(data.splitlines()):
        try:
            seq = json.loads(line).get("seq")
        except (ValueError, AttributeError):
            continue
        if isinstance(seq, int):
            return seq + 1
    return 0
