"""`aenv doctor`: whether this host runs sandboxes, and how fast a platform it chose.

Each check is a row (ok, warn or fail) with what was found and, when not ok, what to do; the runsc
platform row shows the kept calibration (aenv/runtime/platforms.py) with its measurements, and
`--calibrate` measures the host again. A running server's own view (/health) is shown when one
answers. Exit code 1 when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import typer

from aenv.cli.common import JSON_OPTION, _emit, _opts, app, out
from aenv.sdk._config import ClientConfig

CGROUP_CONTROLLERS = ("cpu", "memory", "pids", "freezer")


@dataclass
class Check:
    name: str
    status: str  # ok, warn or fail
    detail: str

    def row(self) -> dict[str, Any]:
        return {"check": self.name, "status": self.status, "detail": self.detail}


def _python() -> Check:
    version = ".".join(map(str, sys.version_info[:3]))
    in_venv = sys.prefix != sys.base_prefix
    return Check("python", "ok", f"{version} ({'project virtualenv' if in_venv else sys.prefix})")


def _root() -> Check:
    if os.geteuid() == 0:
        return Check("root", "ok", "running as root (the gVisor driver needs it)")
    return Check("root", "warn", "not root: the gVisor driver needs root; only AENV_DRIVER=fake runs without it")


def _runsc(runsc: str) -> Check:
    path = shutil.which(runsc)
    if path is None:
        return Check("runsc", "fail", f"{runsc} not found: ./scripts/install installs it")
    from aenv.runtime.gvisor import RunscVersion

    version = RunscVersion.of(path)
    if not version.modern:
        return Check("runsc", "warn", f"{version.version} at {path}: snapshots and forks stop the source; 20240729+")
    return Check("runsc", "ok", f"{version.version} at {path}")


def _cgroups() -> Check:
    root = Path("/sys/fs/cgroup")
    missing = [c for c in CGROUP_CONTROLLERS if not (root / c).is_dir()]
    if missing:
        return Check("cgroups", "fail", f"no cgroup v1 {', '.join(missing)} controller under {root}")
    return Check("cgroups", "ok", f"v1: {', '.join(CGROUP_CONTROLLERS)}")


def _kvm() -> Check:
    from aenv.runtime.platforms import kvm_available

    if kvm_available():
        return Check("kvm", "ok", "/dev/kvm opens: runsc's kvm platform and QEMU's KVM are candidates")
    return Check("kvm", "ok", "no usable /dev/kvm: ptrace and systrap only (QEMU runs on TCG)")


def _tool(name: str, why: str) -> Check:
    found = shutil.which(name)
    return Check(name, "ok" if found else "warn", found or f"not found: {why}")


def _disk(data_dir: Path) -> Check:
    where = data_dir if data_dir.exists() else data_dir.parent
    try:
        free = shutil.disk_usage(where).free / 2**30
    except OSError as exc:
        return Check("disk", "warn", f"{where}: {exc.strerror}")
    status = "ok" if free >= 10 else "warn"
    return Check("disk", status, f"{free:.1f} GiB free at {where}" + ("" if free >= 10 else " (templates need room)"))


def _platform(settings: Any, *, calibrate: bool) -> tuple[Check, dict[str, Any] | None]:
    from aenv.runtime import platforms

    if settings.runsc_platform != platforms.AUTO:
        return Check("runsc platform", "ok", f"{settings.runsc_platform} (AENV_RUNSC_PLATFORM)"), None
    if calibrate:
        if os.geteuid() != 0 or shutil.which(settings.runsc) is None:
            return Check("runsc platform", "fail", "--calibrate needs root and runsc"), None
        from aenv.runtime.base import Limits
        from aenv.runtime.gvisor import GVisorDriver

        settings.runsc_calibration.unlink(missing_ok=True)
        driver = GVisorDriver(
            state_dir=settings.data_dir / "runtime",
            runsc=settings.runsc,
            flags=settings.runsc_flags.split(),
            calibration=settings.runsc_calibration,
            cpu_limit=settings.cpu_limit,
        )
        asyncio.run(driver.prepare(Limits(cpu_count=settings.cpu_count, memory_mb=settings.memory_mb)))
        report = driver.calibration()
    else:
        kept = platforms.load(settings.runsc_calibration, None)
        report = kept.report() if kept is not None else None
    if report is None:
        return Check("runsc platform", "warn", "auto, not measured yet: the first node start measures it"), None
    trials = report.get("trials", {})
    shown = ", ".join(
        f"{name} {t['totalSeconds']:.2f} s" if "totalSeconds" in t else f"{name} unusable" for name, t in trials.items()
    )
    detail = f"{report['platform']} ({report['by']}, {report.get('measuredAt', '')}): {shown}"
    return Check("runsc platform", "ok" if report["by"] != "fallback" else "warn", detail), report


def _qemu(settings: Any) -> Check:
    """The qemu driver's needs (AENV_DRIVER=qemu): QEMU, qemu-img, a guest kernel; which accelerator
    a node would take is the server's to say (it boots a probe kernel on /dev/kvm at its start)."""
    from aenv.runtime import qemu, vmboot

    lacking = qemu.unmet(settings.qemu, settings.qemu_kernel)
    if lacking:
        return Check("qemu", "fail", lacking)
    release = vmboot.find_kernel(settings.qemu_kernel).release
    return Check("qemu", "ok", f"{settings.qemu} and qemu-img; guest kernel {release} (accel {settings.qemu_accel})")


def _server() -> tuple[Check, dict[str, Any] | None]:
    config = ClientConfig.resolve(_opts["url"], _opts["api_key"])
    try:
        health = httpx.get(f"{config.url}/health", timeout=5).json()
    except (httpx.HTTPError, ValueError) as exc:
        return Check("server", "warn", f"none answers at {config.url} ({type(exc).__name__})"), None
    runtime = health.get("runtime", {})
    detail = f"{config.url}: aenv {health.get('version')}, {runtime.get('driver')} {runtime.get('runsc', '')}"
    if runtime.get("platform"):
        detail += f" on {runtime['platform']} ({runtime.get('platformBy', 'setting')})"
    return Check("server", "ok", detail), health


@app.command()
def doctor(
    calibrate: bool = typer.Option(False, "--calibrate", help="Measure the runsc platforms again (root, runsc)"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Check this host: Python, root, runsc, cgroups, KVM, disk, the runsc platform chosen, a server."""
    from aenv.config import Settings

    settings = Settings()
    checks = [_python(), _root(), _runsc(settings.runsc), _cgroups(), _kvm()]
    if settings.driver == "qemu":
        checks.append(_qemu(settings))
    checks += [_tool("debootstrap", "`base` is built with it"), _disk(settings.data_dir)]
    platform_check, calibration = _platform(settings, calibrate=calibrate)
    server_check, health = _server()
    checks += [platform_check, server_check]
    if as_json or not out.is_terminal:
        print(json.dumps({"checks": [c.row() for c in checks], "calibration": calibration, "server": health}))
    else:
        _emit([c.row() for c in checks], ["check", "status", "detail"], title="aenv doctor")
    if any(c.status == "fail" for c in checks):
        raise typer.Exit(1)
