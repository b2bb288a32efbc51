"""The host's limits on a microVM's QEMU process (aenv/runtime/qemu.py): a cgroup of its own.

The VM's size bounds what its guest has (its RAM, its vCPUs); the cgroup bounds what QEMU takes
from the host around it and what a fractional CPU limit means:

- cpu: a CFS quota of ``cpu_count`` CPUs (a VM of one vCPU at 0.5 runs half the time);
- memory: the guest's RAM plus QEMU's own (its heap, its devices; under TCG its translation
  cache, which ``-accel tcg,tb-size`` caps): past it the kernel reclaims the clean pages of the
  image's RAM file first, then ends QEMU, which ends the sandbox as under gVisor;
- pids: QEMU's threads (a vCPU each, its I/O workers), whatever the guest runs.

cgroup v1 (a directory per controller, as on this machine) or v2 (one directory), under
``aenv-vm/<scope>/<instance>``: a scope per node (its state directory's), so that a node's
clean-up never touches another's VMs on the same host. A host where none can be made (not root,
a read-only /sys/fs/cgroup) runs VMs without, and says so once.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from pathlib import Path

from aenv.runtime import cgroups
from aenv.runtime.cgroups import ROOT

log = logging.getLogger(__name__)

PARENT = "aenv-vm"
V1 = ("cpu", "memory", "pids")
PERIOD_US = 100_000
TASKS = 512  # QEMU's threads: a vCPU each, up to 64 I/O workers, its main loop and helpers
_warned = False


@dataclass
class VmGroup:
    """One VM's cgroup: its directories (one per v1 controller, or one v2 group)."""

    dirs: list[Path]

    def join(self, pid: int) -> None:
        for d in self.dirs:
            (d / "cgroup.procs").write_text(str(pid))


def unified() -> bool:
    """Whether the host mounts cgroup v2 alone at /sys/fs/cgroup."""
    return (ROOT / "cgroup.controllers").is_file()


def _parents(scope: str) -> list[Path]:
    return [ROOT / PARENT / scope] if unified() else [ROOT / c / PARENT / scope for c in V1]


def create(scope: str, name: str, *, cpus: float, memory_bytes: int, tasks: int = TASKS) -> VmGroup | None:
    """A new cgroup ``aenv-vm/<scope>/<name>`` with these limits; None where the host lets none be
    made."""
    global _warned
    group = VmGroup([])
    quota = max(1000, int(cpus * PERIOD_US))
    try:
        if unified():
            [parent] = _parents(scope)
            parent.mkdir(parents=True, exist_ok=True)
            for level in (ROOT, parent.parent, parent):  # the controllers handed down to the VMs' groups
                (level / "cgroup.subtree_control").write_text("+cpu +memory +pids")
            d = parent / name
            d.mkdir()
            group.dirs.append(d)
            (d / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            (d / "memory.max").write_text(str(memory_bytes))
            if (d / "memory.swap.max").exists():
                (d / "memory.swap.max").write_text("0")
            (d / "pids.max").write_text(str(tasks))
        else:
            for parent in _parents(scope):
                d = parent / name
                d.mkdir(parents=True)
                group.dirs.append(d)
            cpu, memory, pids = group.dirs
            (cpu / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (cpu / "cpu.cfs_quota_us").write_text(str(quota))
            (memory / "memory.limit_in_bytes").write_text(str(memory_bytes))
            (pids / "pids.max").write_text(str(tasks))
    except OSError as exc:
        for d in reversed(group.dirs):
            with contextlib.suppress(OSError):
                d.rmdir()
        if not _warned:
            log.warning("microVMs run without a host cgroup (%s): their size is their only limit", exc)
            _warned = True
        return None
    return group


async def remove(scope: str, name: str) -> None:
    """Remove a VM's cgroup (by name: also one a crashed node left), ending what still runs in it."""
    dirs = [parent / name for parent in _parents(scope)]
    if not await cgroups.remove(dirs, tries=40):
        log.warning("the cgroup of VM %s outlived its QEMU", name)
        return
    for d in dirs:  # the scope too once its last VM is gone (a test's node, say)
        with contextlib.suppress(OSError):
            d.parent.rmdir()


def names(scope: str) -> set[str]:
    """The VMs of ``scope`` that have a cgroup (running, or left by a node that ended)."""
    found: set[str] = set()
    for parent in _parents(scope):
        with contextlib.suppress(OSError):
            found |= {p.name for p in parent.iterdir() if p.is_dir()}
    return found
