"""`aenv server` listens before it builds `base`: a second server on a taken port or data dir
fails at once with one clear line and exit code 1, and a SIGTERM during the build stops it
cleanly (debootstrap killed, nothing left mounted).

Seen failing before the fix: the second server on a taken port ran debootstrap first (the fake
one's run was recorded) and both failures printed a traceback; a SIGTERM during the build killed
the server on the spot, leaving debootstrap running and proc, sys and a device mounted in the
data dir.
"""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from aenv.storage.mounts import mounts_under
from tests.conftest import API_KEY, Server, free_port, start_server
from tests.node.test_base_build import SHIM, ended

pytestmark = pytest.mark.sandbox
QUIET = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none"}


@pytest.fixture(scope="module")
def first(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_server(tmp_path_factory.mktemp("first") / "data", extra_env=QUIET, wait_for=None)
    yield srv
    srv.stop()


@pytest.fixture()
def shim(tmp_path: Path) -> Iterator[Path]:
    """A debootstrap on PATH that mounts proc, sys and a device in its target, then fails or hangs."""
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "debootstrap").write_text(SHIM)
    (tmp_path / "bin" / "debootstrap").chmod(0o755)
    yield tmp_path
    pid = tmp_path / "pid"
    if pid.exists():  # the code before the fix left it running
        try:
            os.kill(int(pid.read_text()), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if (tmp_path / "data").exists():
        for point in mounts_under(tmp_path / "data"):
            subprocess.run(["umount", "-l", str(point)], check=False)


def server_argv(port: int, data_dir: Path) -> list[str]:
    return [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(port), "--data-dir", str(data_dir)]


def server_env(shim: Path, mode: str, **extra: str) -> dict[str, str]:
    env = dict(os.environ, AENV_API_KEY=API_KEY, AENV_REPO="none", SHIM_DIR=str(shim), SHIM_MODE=mode)
    env["PATH"] = f"{shim / 'bin'}:{env['PATH']}"
    return env | extra


def test_a_taken_port_fails_at_once_without_building(first: Server, shim: Path) -> None:
    second = subprocess.run(
        server_argv(first.port, shim / "data"), env=server_env(shim, "fail"), capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 1, second.stderr
    assert f"cannot listen on 127.0.0.1:{first.port}: the address is in use" in second.stderr
    assert "Traceback" not in second.stderr
    assert not (shim / "runs").exists()  # it did not start building `base`
    assert httpx.get(f"{first.url}/health", timeout=10).status_code == 200


def test_a_gateway_on_a_taken_port_fails_at_once(first: Server, tmp_path: Path) -> None:
    """A gateway listens before it reads the cluster too (seen failing before: it tried etcd for
    10 s, started, then uvicorn's bind failed with exit code 3)."""
    nothing = f"etcd://127.0.0.1:{free_port()}"  # no etcd there: what a gateway would try first
    argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", nothing, "--port", str(first.port)]
    env = dict(os.environ, AENV_API_KEY=API_KEY)
    second = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert second.returncode == 1, second.stderr
    assert f"cannot listen on 127.0.0.1:{first.port}: the address is in use" in second.stderr
    assert "Traceback" not in second.stderr and "did not answer" not in second.stderr, second.stderr
    assert httpx.get(f"{first.url}/health", timeout=10).status_code == 200


def test_a_taken_data_dir_fails_at_once(first: Server, shim: Path) -> None:
    port = free_port()
    second = subprocess.run(
        server_argv(port, first.data_dir), env=server_env(shim, "fail"), capture_output=True, text=True, timeout=60
    )
    assert second.returncode == 1, second.stderr
    assert f"another aenv node is using {first.data_dir}" in second.stderr
    assert "Traceback" not in second.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # its listening socket went with it
    assert httpx.get(f"{first.url}/health", timeout=10).status_code == 200


def test_sigterm_during_the_base_build(shim: Path) -> None:
    port = free_port()
    log = shim / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_argv(port, shim / "data"), env=server_env(shim, "hang"), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        while not (shim / "pid").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        assert shim_mounts(shim)  # the fault is in place
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # already listening while `base` builds
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "SIGTERM: stopped before serving" in log.read_text()
    assert mounts_under(shim / "data") == []
    assert ended(int((shim / "pid").read_text()))  # debootstrap went with it


def shim_mounts(shim: Path, mountinfo: Path | None = None) -> list[Path]:
    """What the fake debootstrap mounted in its target (proc, sys, a device), as it sees them (in a
    mount namespace of its own or not), or as ``mountinfo`` lists them."""
    seen = mountinfo or Path(f"/proc/{int((shim / 'pid').read_text())}/mountinfo")
    return [p for p in mounts_under(shim / "data", mountinfo=seen) if p.name in ("proc", "sys", "null")]


def test_a_killed_server_leaves_no_mount_and_no_debootstrap(shim: Path) -> None:
    """SIGKILL during the build (no cleanup can run): debootstrap goes with the server, and what it
    mounted with it. Seen failing before: debootstrap ran on, orphaned, and proc, sys and a device
    stayed mounted in the data dir (until it ended, or for good if it was killed too)."""
    port = free_port()
    log = shim / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            server_argv(port, shim / "data"), env=server_env(shim, "hang"), stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 120
        while not (shim / "pid").exists():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        deadline = time.monotonic() + 10
        while len(shim_mounts(shim)) < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert len(shim_mounts(shim)) == 3  # the fault is in place: proc, sys and the device
    finally:
        proc.kill()
        proc.wait()
    assert ended(int((shim / "pid").read_text())), "debootstrap outlived the server"  # the kernel ends it
    here = Path("/proc/self/mountinfo")
    deadline = time.monotonic() + 10
    while shim_mounts(shim, here) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert shim_mounts(shim, here) == []  # (the node's own spare uppers wait for its next start)


def test_ipv6_and_tls_through_the_early_socket(tmp_path: Path) -> None:
    """The socket made before uvicorn keeps what uvicorn's own did: an IPv6 host, HTTPS."""
    from tests.cluster.domain import make_certificates

    certs = make_certificates(tmp_path, "localhost")
    tls = {"AENV_TLS_CERT": str(certs.cert), "AENV_TLS_KEY": str(certs.key), "AENV_HOST": "::1"}
    port = free_port()
    proc = subprocess.Popen(
        server_argv(port, tmp_path / "data"),
        env=dict(os.environ, AENV_API_KEY=API_KEY, **QUIET, **tls),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    trust = ssl.create_default_context(cafile=str(certs.ca))
    trust.check_hostname = False  # the certificate names localhost, the URL an address
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None
            try:
                r = httpx.get(f"https://[::1]:{port}/health", verify=trust, timeout=2)
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.3)
        assert r.status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)  # ::1 only, as asked
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
