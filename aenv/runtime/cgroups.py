"""What the drivers share of the host's cgroups: where they are mounted, and removing a group
whose tasks may still be ending (aenv/runtime/gvisor.py's sandboxes, aenv/runtime/vmcgroup.py's
QEMU processes)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
REMOVE_TRIES = 20  # times 50 ms: a killed task leaves its cgroup a moment after the signal


async def remove(dirs: list[Path], tries: int = REMOVE_TRIES) -> bool:
    """Remove ``dirs`` (a group's directories: one per v1 controller, or its one v2 group), killing
    what still runs in them first; retried ``tries`` times 50 ms. False if some outlived that."""
    for _ in range(tries):
        left = []
        for group in dirs:
            if not group.is_dir():
                continue
            try:
                group.rmdir()
            except OSError:
                left.append(group)
        if not left:
            return True
        for group in left:
            try:
                tasks = (group / "cgroup.procs").read_text().split()
            except OSError:
                continue
            for pid in tasks:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (OSError, ValueError):
                    pass
        await asyncio.sleep(0.05)
    return False
