"""Which runsc platform runs this host's sandboxes fastest: measured once per host and kept.

`AENV_RUNSC_PLATFORM=auto` (the default) runs a short probe (spawning processes, system calls,
small files written and scanned: what an agent's steps spend their time on) in a sandbox of each
platform the host can run, with a default sandbox's cgroup limits, checks that the platform can
checkpoint and restore (pause, snapshot and fork need it), and picks the fastest that can. The
choice and its measurements are kept in one file per host, keyed by what would change them (runsc,
kernel, CPUs, the sandboxes' CPU limit, extra runsc flags): every node of the host, and every
restart, reuses it. A platform named in the setting is used as it is, without a probe.

On the development machines (2 cores, no usable KVM) systrap ran the probe ~2.5x faster than
ptrace; kvm hangs there (/dev/kvm from kvm_pvm), which its deadline turns into "unusable".
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import logging
import os
import platform as host_platform
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

AUTO = "auto"
KNOWN = ("systrap", "ptrace", "kvm")
FALLBACK = "ptrace"  # the one every runsc and host runs, when no probe succeeded
# Seconds per runsc command of a probe: a platform that hangs (kvm on a host whose /dev/kvm boots
# nothing) fails.
PROBE_TIMEOUT = 20.0
CACHE_MAX = 64 * 1024

# Run by python3 inside the probe sandbox (the host's root, read-only) with its one argument a host
# directory mounted writable, as a sandbox's upper is: seconds per phase, as JSON on the last line.
PROBE = r"""
import json, os, subprocess, sys, time
work = sys.argv[1]
t = {}
s = time.perf_counter()
for _ in range(40):
    subprocess.run(["/bin/true"], check=True)
t["spawn"] = time.perf_counter() - s
s = time.perf_counter()
for i in range(300):
    d = "%s/d%d" % (work, i % 10)
    os.makedirs(d, exist_ok=True)
    with open("%s/f%d.txt" % (d, i), "w") as f:
        f.write("line %d\n" % i * 20)
t["write"] = time.perf_counter() - s
s = time.perf_counter()
subprocess.run(["grep", "-rl", "line 7", work], stdout=subprocess.DEVNULL, check=True)
for _ in range(20000):
    os.stat(work + "/d3")
t["stat"] = time.perf_counter() - s
s = time.perf_counter()
x = 0
for i in range(300000):
    x += i * i % 7
t["cpu"] = time.perf_counter() - s
print(json.dumps(t))
"""


@dataclass
class Trial:
    """One platform's probe: seconds per phase, or why it cannot be used."""

    platform: str
    seconds: dict[str, float] = field(default_factory=dict)
    checkpoints: bool = False  # a checkpoint of a running sandbox restored
    error: str = ""

    @property
    def usable(self) -> bool:
        return not self.error and bool(self.seconds) and self.checkpoints

    @property
    def total(self) -> float:
        return sum(self.seconds.values())


@dataclass
class Choice:
    """The platform a node runs new sandboxes on, and why."""

    platform: str
    by: str  # "setting", "calibration", "kept calibration" or "fallback"
    trials: list[Trial] = field(default_factory=list)
    key: dict[str, Any] = field(default_factory=dict)
    measured_at: float = 0.0

    def report(self) -> dict[str, Any]:
        """What /health and `aenv doctor` show."""
        out: dict[str, Any] = {"platform": self.platform, "by": self.by}
        if self.trials:
            out["measuredAt"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.measured_at))
            out["trials"] = {
                t.platform: (
                    {"totalSeconds": round(t.total, 3), **{k: round(v, 3) for k, v in t.seconds.items()}}
                    if t.usable
                    else {"unusable": t.error or "checkpoint and restore failed"}
                )
                for t in self.trials
            }
        return out


def host_key(*, runsc_version: str, flags: tuple[str, ...], cpu_count: float, cpu_limit: str) -> dict[str, Any]:
    """What a calibration depends on: when any of it changes, the host is measured again."""
    return {
        "runsc": runsc_version,
        "kernel": host_platform.release(),
        "cpus": os.cpu_count() or 0,
        "cpuModel": _cpu_model(),
        "kvm": kvm_available(),
        "flags": list(flags),
        "sandboxCpus": cpu_count,
        "cpuLimit": cpu_limit,
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()[:200]
    except OSError:
        pass
    return ""


def kvm_available() -> bool:
    return os.access("/dev/kvm", os.R_OK | os.W_OK)


def candidates() -> list[str]:
    """The platforms worth a probe on this host (kvm only with a /dev/kvm to open)."""
    return [p for p in KNOWN if p != "kvm" or kvm_available()]


def pick(trials: list[Trial]) -> str | None:
    usable = [t for t in trials if t.usable]
    return min(usable, key=lambda t: t.total).platform if usable else None


def load(path: Path, key: dict[str, Any] | None) -> Choice | None:
    """The kept calibration, if it was made for this very host (``key``; None: whichever host,
    as `aenv doctor` shows it)."""
    try:
        with open(path, "rb") as f:
            raw = json.loads(f.read(CACHE_MAX))
        if (key is not None and raw.get("key") != key) or raw.get("platform") not in KNOWN:
            return None
        trials = [Trial(**t) for t in raw.get("trials", [])]
        kept_key = raw.get("key", {}) if key is None else key
        return Choice(raw["platform"], "kept calibration", trials, kept_key, float(raw.get("measured_at", 0)))
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return None


def save(path: Path, choice: Choice) -> None:
    raw = {"platform": choice.platform, "key": choice.key, "measured_at": choice.measured_at}
    raw["trials"] = [asdict(t) for t in choice.trials]
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(raw, indent=2))
    os.replace(tmp, path)


async def choose(
    setting: str,
    *,
    probe: Callable[[str], Awaitable[Trial]],
    cache: Path,
    key: dict[str, Any],
) -> Choice:
    """The platform for ``setting``: itself, or for "auto" the kept calibration of this host or a
    new one. Nodes starting together on one host wait for one calibration (a lock on the file)."""
    if setting != AUTO:
        return Choice(setting, "setting")
    cache.parent.mkdir(parents=True, exist_ok=True)
    lock_fd = os.open(cache.with_name(cache.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        await _locked(lock_fd)
        kept = load(cache, key)
        if kept is not None:
            return kept
        trials = []
        for name in candidates():
            trial = await probe(name)
            log.info(
                "runsc platform %s: %s",
                name,
                f"{trial.total:.2f} s" if trial.usable else f"unusable ({trial.error or 'no checkpoint'})",
            )
            trials.append(trial)
        chosen = pick(trials)
        choice = Choice(chosen or FALLBACK, "calibration" if chosen else "fallback", trials, key, time.time())
        if chosen is None:
            log.warning("no runsc platform passed its probe on this host; using %s", FALLBACK)
        else:
            save(cache, choice)
        return choice
    finally:
        os.close(lock_fd)  # releases the lock


async def _locked(fd: int, wait: float = 300.0) -> None:
    """Take the calibration lock without blocking the event loop; past ``wait`` (another node's
    calibration stuck), go on without it: two calibrations cost time, never correctness."""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            await asyncio.sleep(0.2)
    log.warning("another node's runsc calibration held its lock for %.0f s; calibrating anyway", wait)
