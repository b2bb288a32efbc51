"""The suite's disk: what a test's servers left (mounts, sandboxes of a killed node, layers) goes
once the test or module is done, so a whole run fits a machine with a few GB free.

pytest keeps every temporary directory of a run until the next; a node's data dir holds ~1 GB once
it has a template, and a node killed on purpose leaves its layers mounted (which pytest's own
cleanup cannot remove, and must not walk into).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from pathlib import Path


def mounts_below(path: Path) -> list[str]:
    """Mount points at or below ``path``, deepest first."""
    root = str(path.resolve())
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].replace("\\040", " ")
            if point == root or point.startswith(root + "/"):
                found.append(point)
    return sorted(found, key=len, reverse=True)


def processes_using(path: Path) -> list[int]:
    """Processes whose command line names ``path`` (runsc of a node killed with SIGKILL), not ours."""
    root = str(path.resolve()).encode()
    mine = {os.getpid(), os.getppid()}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) in mine:
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                args = f.read()
        except OSError:
            continue
        if re.search(re.escape(root) + rb"(?:[/\0=:]|$)", args):  # the path itself, not a sibling's prefix
            found.append(int(entry.name))
    return found


def release(path: Path) -> None:
    """Stop what still runs from ``path``, unmount what is mounted below it, remove it (best
    effort: a cleanup never fails a test)."""
    try:
        _release(path)
    except Exception as exc:  # noqa: BLE001
        print(f"could not remove {path}: {exc!r}")


def _release(path: Path) -> None:
    if not path.exists():
        return
    for pid in processes_using(path):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in mounts_below(path):
        subprocess.run(["umount", "-l", point], capture_output=True, check=False)
    if mounts_below(path):  # never walk into a mount: it could be anything of the host's
        return
    # rm, not shutil.rmtree: hostile-layer tests leave directories deeper than Python's recursion limit
    subprocess.run(["rm", "-rf", "--one-file-system", str(path)], capture_output=True, check=False)


_disposable: set[Path] = set()


def dispose_after_module(path: Path) -> None:
    """``path`` (outside pytest's temporary directories: a named node's data dir) goes once the
    module using it is done."""
    _disposable.add(path)


def dispose_now() -> None:
    for path in sorted(_disposable):
        release(path)
    _disposable.clear()


def free_gib(path: Path) -> float:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize / (1 << 30)
