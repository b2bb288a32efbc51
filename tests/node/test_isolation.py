"""Isolation, adversarially: what a hostile rollout tries, and that host and neighbours are unharmed."""

from __future__ import annotations

import hashlib
import secrets
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException, Sandbox

from tests.conftest import Server

pytestmark = pytest.mark.sandbox
REPO = Path(__file__).resolve().parents[2]  # this checkout, on the host


def run(sbx: Sandbox, cmd: str, **kw: object) -> tuple[int, str]:
    """Exit code and combined output, without raising on failure."""
    try:
        r = sbx.commands.run(cmd, **kw)  # type: ignore[arg-type]
        return r.exit_code, r.stdout + r.stderr
    except CommandExitException as exc:
        return exc.exit_code, exc.stdout + exc.stderr


def create_with_limits(api: httpx.Client, **limits: int) -> Sandbox:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, "limits": limits})
    assert r.status_code == 201, r.text
    return Sandbox.connect(r.json()["sandboxID"])


@pytest.fixture()
def neighbour(e2b_env: Server) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300)
    sbx.files.write("/home/user/neighbour.txt", "intact")
    yield sbx
    sbx.kill()


def assert_unharmed(server: Server, neighbour: Sandbox) -> None:
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert neighbour.commands.run("cat /home/user/neighbour.txt").stdout == "intact"


def test_cannot_reach_host_files(sandbox: Sandbox, server: Server, tmp_path: Path) -> None:
    secret = tmp_path / f"host-secret-{secrets.token_hex(4)}"
    secret.write_text("host only")
    passwd_before = hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest()
    code, out = run(sandbox, f"cat {secret}", user="root")
    assert code != 0 and "host only" not in out
    # the node's interpreter: its virtualenv, and its base unless that is the system's /usr (which
    # every image has too)
    interpreter = sys.prefix if sys.base_prefix in ("/usr", "/usr/local") else sys.base_prefix
    host_paths = (str(server.data_dir), str(tmp_path), str(REPO), sys.prefix, interpreter)
    for path in host_paths:
        code, out = run(sandbox, f"ls {path}", user="root")
        assert code != 0, f"{path} is visible inside the sandbox: {out}"
    # the sandbox's root is its own: changing /etc/passwd inside leaves the host's alone
    assert run(sandbox, "echo 'intruder:x:0:0::/:/bin/sh' >> /etc/passwd", user="root")[0] == 0
    assert hashlib.sha256(Path("/etc/passwd").read_bytes()).hexdigest() == passwd_before
    # the agent's runtime is mounted read-only, even for root
    code, out = run(sandbox, "touch /.aenv/evil || echo denied", user="root")
    assert "denied" in out
    code, out = run(sandbox, "cat /proc/version", user="root")
    assert "4.4.0" in out  # gVisor's kernel, not the host's
    code, out = run(sandbox, f"ls /proc/1/root{REPO} /proc/1/root{interpreter} 2>&1", user="root")
    assert code != 0


def test_sandboxes_cannot_see_each_other(e2b_env: Server) -> None:
    marker = secrets.token_hex(6)
    a, b = Sandbox.create(timeout=300), Sandbox.create(timeout=300)
    try:
        a.commands.run(f"echo secret > /home/user/a-{marker}; nohup sleep 987654 >/dev/null 2>&1 &")
        code, out = run(b, f"find / -xdev -name 'a-{marker}' 2>/dev/null; ps -eo args", user="root")
        assert f"a-{marker}" not in out and "sleep 987654" not in out
        assert int(run(b, "ps -e --no-headers | wc -l")[1].strip()) < 10
        assert not b.files.exists(f"/home/user/a-{marker}")
    finally:
        a.kill()
        b.kill()


@pytest.fixture()
def offline(e2b_env: Server) -> Iterator[Sandbox]:
    sbx = Sandbox.create(timeout=300, allow_internet_access=False)
    yield sbx
    sbx.kill()


def test_no_host_services_and_no_internet(offline: Sandbox, server: Server) -> None:
    sandbox = offline
    probe = (
        "import socket,sys\n"
        "def try_(host, port):\n"
        "    try:\n"
        "        socket.create_connection((host, port), timeout=3).close(); return 'open'\n"
        "    except OSError as e:\n"
        "        return type(e).__name__\n"
        f"print('api', try_('127.0.0.1', {server.port}))\n"
        "try:\n"
        "    socket.getaddrinfo('pypi.org', 443); print('dns ok')\n"
        "except OSError as e:\n"
        "    print('dns', type(e).__name__)\n"
        "print('ifaces', sorted(n for _, n in socket.if_nameindex()))\n"
    )
    sandbox.files.write("/home/user/probe.py", probe)
    out = sandbox.commands.run("python3 /home/user/probe.py").stdout
    assert "api ConnectionRefusedError" in out, out
    assert "dns ok" not in out, out
    assert "ifaces ['lo']" in out, out
    code, out = run(sandbox, "curl -sS --max-time 5 https://pypi.org/simple/ -o /dev/null")
    assert code != 0 and "403" in out, out  # refused by the host at once, not left to time out


def test_fork_bomb_hits_the_process_limit(e2b_env: Server, api: httpx.Client, neighbour: Sandbox) -> None:
    sbx = create_with_limits(api, nproc=96)
    try:
        bomb = sbx.commands.run("bomb() { bomb | bomb & }; bomb; sleep 30", background=True, timeout=60)
        time.sleep(4)
        bomb.kill()  # the agent signals the whole process group without forking
        time.sleep(1)
        code, out = run(sbx, "echo alive; ps -e --no-headers | wc -l", user="root")
        assert code == 0 and out.startswith("alive"), out
        assert_unharmed(e2b_env, neighbour)
    finally:
        sbx.kill()


def test_fork_bomb_output_shows_the_limit(e2b_env: Server, api: httpx.Client) -> None:
    sbx = create_with_limits(api, nproc=64)
    try:
        spawn = "for i in $(seq 200); do sleep 30 >/dev/null 2>&1 & done 2>&1 | tail -1; echo started"
        code, out = run(sbx, spawn, timeout=60)
        assert "Resource temporarily unavailable" in out, out
        count = int(run(sbx, "pgrep -c -u user sleep", user="root")[1].strip() or 0)
        assert 0 < count < 64
    finally:
        sbx.kill()


def test_memory_hog_is_stopped_at_its_limit(e2b_env: Server, api: httpx.Client, neighbour: Sandbox) -> None:
    sbx = create_with_limits(api, memoryMB=256)
    hog = "python3 -c 'x=[]\nwhile True: x.append(bytearray(16*2**20))'"
    try:
        code, _ = run(sbx, hog, timeout=60)
        stopped = code != 0
    except Exception:
        stopped = True  # the whole sandbox was stopped by its memory limit
    assert stopped
    # Either the hog alone died inside a live sandbox, or the sandbox was stopped at its limit and
    # the node noticed and removed it. Nothing is left half-alive.
    deadline = time.monotonic() + 20
    settled = False
    while time.monotonic() < deadline and not settled:
        if api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404:
            settled = True
        else:
            try:
                settled = sbx.commands.run("echo up").stdout == "up\n"
            except Exception:
                time.sleep(0.5)
    assert settled
    usage: list[dict[str, int]] = []
    deadline = time.monotonic() + 15  # metrics are the host's samples: a young sandbox may have none yet
    while not usage and time.monotonic() < deadline:
        usage = api.get(f"/sandboxes/{neighbour.sandbox_id}/metrics").json()
        time.sleep(0 if usage else 0.5)
    assert usage and usage[-1]["memUsed"] < 512 * 2**20
    assert_unharmed(e2b_env, neighbour)
    try:
        sbx.kill()
    except Exception:
        pass


def test_disk_filler_hits_its_quota(e2b_env: Server, api: httpx.Client, neighbour: Sandbox) -> None:
    sbx = create_with_limits(api, diskSizeMB=128)
    try:
        code, out = run(sbx, "dd if=/dev/zero of=/home/user/fill bs=1M count=400 2>&1", timeout=120)
        assert code != 0 and "No space left on device" in out, out
        written = int(run(sbx, "stat -c %s /home/user/fill")[1].strip())
        assert written < 140 * 2**20
        # the sandbox lives on, and freeing space makes writing work again
        assert run(sbx, "rm /home/user/fill && echo ok > /home/user/after && cat /home/user/after")[1] == "ok\n"
        assert_unharmed(e2b_env, neighbour)
        upper_disks = list((e2b_env.data_dir / "fs" / "layers").glob("*.img"))
        assert upper_disks and max(p.stat().st_blocks * 512 for p in upper_disks) < 200 * 2**20
    finally:
        sbx.kill()
