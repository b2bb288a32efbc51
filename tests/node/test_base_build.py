"""The `base` build's debootstrap when it fails: faults injected by a `debootstrap` on PATH that
mounts what the real one mounts in its target (proc, sys, a device node) and then fails, fails
once, or hangs until it is killed.

Seen failing before the fix: the error said only "debootstrap failed (exit 1): ", there was no
retry, and proc, sys and the device stayed mounted under the data dir after every failure, a
timeout and a cancellation.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.config import Settings
from aenv.errors import OperationTimeout, RuntimeFailure
from aenv.storage.layers import LayerStore
from aenv.storage.mounts import mounts_under
from aenv.templates import builder

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

# Writes to stdout only, as debootstrap's "I:" lines; the details are in the target's own log.
SHIM = r"""#!/bin/bash
target="$4"
n=$(( $(cat "$SHIM_DIR/runs" 2>/dev/null || echo 0) + 1 )); echo $n > "$SHIM_DIR/runs"
mkdir -p "$target/proc" "$target/sys" "$target/dev" "$target/debootstrap"
mount -t proc proc "$target/proc"
mount -t sysfs sysfs "$target/sys"
touch "$target/dev/null" && mount --bind /dev/null "$target/dev/null"
echo "I: Retrieving InRelease (attempt $n)"
echo "dpkg: error processing package shim-$n (--configure):" >> "$target/debootstrap/debootstrap.log"
case "$SHIM_MODE:$n" in
  fail:*|fail-once:1) exit 1 ;;
  fail-once:*) mkdir -p "$target/etc" && echo debian > "$target/etc/marker"; exit 0 ;;
  hang:*) # its pid on the host ($$ is 1 in a PID namespace of its own); /proc is the host's
    while read -r key host _; do [ "$key" = NSpid: ] && echo "$host" > "$SHIM_DIR/pid.new"; done < /proc/self/status
    mv "$SHIM_DIR/pid.new" "$SHIM_DIR/pid"; exec sleep 30 ;;
esac
"""


def mounted_under(path: Path) -> list[Path]:
    return mounts_under(path) if path.exists() else []


@pytest.fixture()
def shim(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("needs root (the fake debootstrap mounts proc)")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "debootstrap").write_text(SHIM)
    (bin_dir / "debootstrap").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("SHIM_DIR", str(tmp_path))
    monkeypatch.setattr(builder, "DEBOOTSTRAP_RETRY_AFTER", 0.0, raising=False)
    yield tmp_path
    pid = tmp_path / "pid"
    if pid.exists():  # the code before the fix left it running
        try:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    for point in mounted_under(tmp_path / "data"):  # nor leave the runner's host with mounts
        subprocess.run(["umount", "-l", str(point)], check=False)


def fake_node(data: Path) -> Any:
    """What build_base uses of a node: its settings and layer store (nothing is booted)."""
    settings = Settings(data_dir=data, debian_mirror="http://127.0.0.1:9/debian", repo="none", build_base=False)
    return SimpleNamespace(settings=settings, files=LayerStore(data / "fs"))


def ended(pid: int, limit: float = 10) -> bool:
    """Whether ``pid`` is gone (or a zombie: dead, its reaping up to whoever adopted it) within
    ``limit`` seconds (a liveness bound)."""
    deadline = time.monotonic() + limit
    while True:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return True
        except (OSError, IndexError):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def runs(shim: Path) -> int:
    return int((shim / "runs").read_text())


async def test_failures_quote_the_log_unmount_and_retry(shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHIM_MODE", "fail")
    monkeypatch.setattr(builder, "DEBOOTSTRAP_ATTEMPTS", 2, raising=False)
    node = fake_node(shim / "data")
    with pytest.raises(RuntimeFailure) as failed:
        await builder.build_base(node)
    message = failed.value.message
    assert runs(shim) == 2  # tried again, on a clean target
    assert "I: Retrieving InRelease (attempt 2)" in message  # its output's last lines
    assert "dpkg: error processing package shim-2" in message  # and its own log's, from the target
    assert "exit 1" in message and "attempt 2 of 2" in message
    kept = (shim / "data" / "logs" / "debootstrap.log").read_text()  # both attempts, under the data dir
    assert "package shim-1" in kept and "package shim-2" in kept
    assert mounted_under(shim / "data") == []
    assert node.files.layer_ids() == set()  # no half-made target left


async def test_a_failure_then_a_success(shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHIM_MODE", "fail-once")
    committed: list[Path] = []

    async def commit(node: Any, layer_id: str, log: Any) -> str:
        committed.append(node.files.layer(layer_id))
        return layer_id

    monkeypatch.setattr(builder, "_commit_base", commit)
    node = fake_node(shim / "data")
    lines: list[str] = []
    layer_id = await builder.build_base(node, on_log=lines.append)
    assert runs(shim) == 2
    assert committed and (committed[0] / "etc" / "marker").read_text() == "debian\n"
    assert any("trying again" in line for line in lines)
    # The successful run left proc mounted (the real one unmounts it): the layer must hold none.
    assert mounted_under(shim / "data") == []
    assert node.files.layer_ids() == {layer_id}  # the failed attempt's target is gone


async def test_a_failed_commit_leaves_no_layer(shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """debootstrap succeeds, the commit after it fails (a boot, a setup step): the Debian layer
    goes too (seen failing before: it stayed, some 300 MB, until the next start collected it)."""
    monkeypatch.setenv("SHIM_MODE", "fail-once")

    async def commit(node: Any, layer_id: str, log: Any) -> str:
        raise RuntimeFailure("step 1 failed: the setup broke")

    monkeypatch.setattr(builder, "_commit_base", commit)
    node = fake_node(shim / "data")
    with pytest.raises(RuntimeFailure, match="the setup broke"):
        await builder.build_base(node)
    assert runs(shim) == 2
    assert mounted_under(shim / "data") == []
    assert node.files.layer_ids() == set()


async def test_a_timeout_is_not_retried_and_unmounts(shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHIM_MODE", "hang")
    monkeypatch.setattr(builder, "DEBOOTSTRAP_TIMEOUT", 3.0, raising=False)
    node = fake_node(shim / "data")
    with pytest.raises(OperationTimeout) as failed:
        await builder.build_base(node)
    assert runs(shim) == 1  # a mirror that does not answer in half an hour would not in the next
    assert "dpkg: error processing package shim-1" in failed.value.message
    assert mounted_under(shim / "data") == []
    assert node.files.layer_ids() == set()
    assert ended(int((shim / "pid").read_text()))


async def test_a_cancelled_build_unmounts(shim: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHIM_MODE", "hang")
    node = fake_node(shim / "data")
    build = asyncio.create_task(builder.build_base(node))
    for _ in range(200):
        if (shim / "pid").exists():
            break
        await asyncio.sleep(0.05)
    pid = int((shim / "pid").read_text())  # the fault is in place: the target has its mounts (as it sees them)
    assert mounts_under(shim / "data", mountinfo=Path(f"/proc/{pid}/mountinfo"))
    build.cancel()
    with pytest.raises(asyncio.CancelledError):
        await build
    assert mounted_under(shim / "data") == []
    assert node.files.layer_ids() == set()
    assert ended(int((shim / "pid").read_text()))


async def test_a_layer_removed_later_loses_its_mounts(shim: Path) -> None:
    """A node killed mid-build (SIGKILL: no cleanup) leaves the target mounted; the next start's
    collection removes the orphan layer, mounts and all."""
    node = fake_node(shim / "data")
    layer_id, path = node.files.new_layer_dir()
    (path / "proc").mkdir()
    await asyncio.to_thread(subprocess.run, ["mount", "-t", "proc", "proc", str(path / "proc")], check=True)
    await node.files.remove(layer_id)
    assert mounted_under(shim / "data") == []
    assert not path.exists()
