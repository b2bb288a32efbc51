"""Mounts below a directory of the node's, as the kernel lists them, and taking them all down.

A tool the node runs on a tree of its own (debootstrap mounts the host's proc, sys and device
nodes in its target) may leave mounts behind when it fails or is killed; the tree can then be
neither removed (the removal does not enter other file systems) nor trusted.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from aenv.runtime import hostexec

_ESCAPE = re.compile(r"\\([0-7]{3})")  # mountinfo writes space, tab, newline and \ as octal


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(path: Path, *, mountinfo: Path = Path("/proc/self/mountinfo")) -> list[Path]:
    """Mount points strictly below ``path``, deepest first (the order to unmount them in);
    a point mounted twice is listed twice."""
    top = os.path.realpath(path).rstrip("/") + "/"
    found = []
    for line in mountinfo.read_text().splitlines():
        fields = line.split()
        if len(fields) > 4:
            point = _unescape(fields[4])
            if point.startswith(top):
                found.append(point)
    found.sort(key=lambda p: p.count("/"), reverse=True)
    return [Path(p) for p in found]


async def unmount_under(path: Path) -> list[Path]:
    """Unmount everything below ``path``; what would not go (busy: a process of the tool still
    holds it) is detached lazily, so nothing is left in the mount table. Returns what was mounted."""
    taken: list[Path] = []
    for _ in range(8):  # mounts stacked on one point come off one per round
        points = mounts_under(path)
        if not points:
            return taken
        for point in points:
            try:
                await hostexec.run(["umount", str(point)], timeout=60)
            except Exception:
                await hostexec.run(["umount", "-l", str(point)], timeout=60, check=False)
            taken.append(point)
    left = mounts_under(path)
    if left:
        raise OSError(f"could not unmount {', '.join(map(str, left[:5]))}")
    return taken
