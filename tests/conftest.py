"""Shared fixtures: one real aenv server (real runsc sandboxes) for the whole session.

The server's data dir persists between local runs (AENV_TEST_DATA_DIR, default
/var/tmp/aenv-test) so the `base` template is built once; CI starts from an empty one.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests import disk

API_KEY = "e2b_" + "0" * 40
# The fast tier (./scripts/test --fast): every node the tests start runs the fake runtime (no runsc,
# no root, no isolation: aenv/runtime/fake.py); AENV_DRIVER reaches them through the environment.
FAKE_RUNTIME = os.environ.get("AENV_DRIVER") == "fake"
DATA_DIR = Path(os.environ.get("AENV_TEST_DATA_DIR", "/var/tmp/aenv-test") + ("-fake" if FAKE_RUNTIME else ""))
# The session server's snapshot repository: its own, or (AENV_TEST_REPO, tests/parallel.py) the one
# another pytest process's server shares with it, where `base` is already committed.
SHARED_REPO = os.environ.get("AENV_TEST_REPO")
REPO_DIR = Path(SHARED_REPO) if SHARED_REPO else DATA_DIR / "repo"
SLOW_CLIENT_DEADLINES = {"AENV_HTTP_HEAD_TIMEOUT": "8", "AENV_HTTP_BODY_TIMEOUT": "10"}
BASE_BUILD_TIMEOUT = 900


_GIVEN_PORTS: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _port_range() -> tuple[int, int]:
    """Below the kernel's ephemeral range; with AENV_TEST_PORTS=i/n (n pytest processes at once,
    tests/parallel.py) the i-th of n slices, so two processes never pick the same port."""
    high = _ephemeral_low()
    low = max(1024, high - 12000)
    index, _, count = os.environ.get("AENV_TEST_PORTS", "0/1").partition("/")
    i, n = int(index), max(1, int(count or 1))
    span = (high - low) // n
    return low + i * span, low + (i + 1) * span


def free_port() -> int:
    """A loopback port for a test's server: below the kernel's ephemeral range, so no outgoing
    connection takes it before the server binds it (one did: an etcd member failed 'address
    already in use' in a CI run), never handed out twice in a run, and free when checked."""
    low, high = _port_range()
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(low, high)
        if port in _GIVEN_PORTS:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _GIVEN_PORTS.add(port)
        return port
    with socket.socket() as s:  # (that range all taken: the kernel's choice)
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    port: int
    data_dir: Path
    proc: subprocess.Popen[bytes]
    log: Path
    env: dict[str, str]
    extra_env: dict[str, str] | None = None
    wait_for: str | None = "base"

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=120)

    @property
    def repo_dir(self) -> Path:
        """Its snapshot repository (a directory: the tests' servers use no other kind here)."""
        return Path((self.extra_env or {}).get("AENV_REPO") or self.data_dir / "repo")

    def restart(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGTERM: graceful; SIGKILL: a crash) and start it again in place."""
        self.stop(sig)
        fresh = start_server(self.data_dir, port=self.port, extra_env=self.extra_env, wait_for=self.wait_for)
        self.proc, self.log = fresh.proc, fresh.log

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_server(
    data_dir: Path,
    *,
    port: int | None = None,
    extra_env: dict[str, str] | None = None,
    timeout: float = BASE_BUILD_TIMEOUT,
    wait_for: str | None = "base",
    verify: ssl.SSLContext | bool = True,
) -> Server:
    """Start `aenv server` on ``data_dir``; ready once it answers and has template ``wait_for``
    (at AENV_HOST over HTTPS when ``extra_env`` gives it a certificate, trusted by ``verify``)."""
    port = port or free_port()
    env = dict(os.environ)
    # Shorter slow-client deadlines than the defaults (30 s, 60 s): the tests that wait them out stay quick.
    env.update({"AENV_API_KEY": API_KEY, "AENV_REAPER_INTERVAL": "0.5"} | SLOW_CLIENT_DEADLINES)
    # The CI machine may have a few GB free: the default 4 GiB kept free would refuse (507) the suite
    env.setdefault("AENV_DISK_HEADROOM_MB", "512")
    env.update(extra_env or {})
    log = data_dir.parent / f"{data_dir.name}-server-{port}.log"
    data_dir.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(port), "--data-dir", str(data_dir)],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env=env,
    )
    url = f"{'https' if 'AENV_TLS_CERT' in env else 'http'}://{env.get('AENV_HOST', '127.0.0.1')}:{port}"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"aenv server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                r = httpx.get(f"{url}/health", timeout=2, verify=verify)
                if r.status_code == 200 and (wait_for is None or wait_for in r.json()["templates"]):
                    return Server(url, port, data_dir, proc, log, env, extra_env, wait_for)
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"aenv server did not become ready:\n{log.read_text()[-4000:]}")
    except BaseException:
        # Not handed to anyone (not ready, or the test gave up: a timeout's exception lands
        # here too): it must not outlive the test holding its data dir's lock.
        proc.kill()
        proc.wait()
        raise


def e2b_client(node: Server, monkeypatch: pytest.MonkeyPatch, *, empty_after: bool = False) -> Iterator[httpx.Client]:
    """For an ``api`` fixture on a node of the module's own: the E2B SDK pointed at ``node`` and a
    client of its API; ``empty_after`` kills every sandbox left, so each test starts on an empty node."""
    monkeypatch.setenv("E2B_API_KEY", node.env["AENV_API_KEY"])
    monkeypatch.setenv("E2B_API_URL", node.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", node.url)
    with node.client() as client:
        yield client
        if empty_after:
            for item in client.get("/sandboxes").json():
                client.delete(f"/sandboxes/{item['sandboxID']}")


def modern_runsc(api: httpx.Client) -> bool:
    """Whether the server runs the runsc a node is made for (20240729 or newer), by its /health."""
    version = api.get("/health").json()["runtime"]["runsc"]
    found = re.search(r"20\d{6}", version)
    return found is None or int(found.group()) >= 20240729


def start_busybox_node(data_dir: Path, extra_env: dict[str, str] | None = None) -> Server:
    """A node without a repository on a busybox template `bb` from a local OCI layout (nothing to
    debootstrap); ``extra_env`` adds or overrides settings."""
    from tests.images.oci import busybox_layer, write_layout

    layout = data_dir / "imports" / "bb"
    env = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none", **(extra_env or {})}
    srv = start_server(data_dir, extra_env=env, wait_for=None)
    try:
        # E2B's defaults, said in the image's config (an image that names none starts as root in /)
        write_layout(layout, [busybox_layer().bytes()], "v1", {"User": "user", "WorkingDir": "/home/user"})
        with srv.client() as api:
            r = api.post("/templates/from-image", json={"name": "bb", "image": f"oci:{layout}:v1"})
            assert r.status_code == 201, r.text
    except BaseException:
        srv.stop()  # a fixture that fails here has no teardown: the node would outlive the session
        raise
    return srv


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Two tiers, each test in one: the fast tier (`-m "fast and not runsc and not slow"`: tests of the
    API, node, gateway, SDK and CLI marked `fast`, their nodes on the fake runtime) and the rest
    (`-m "not fast or runsc or slow"`, on runsc). Under the fake runtime the rest is skipped: much of
    it tests what only runsc does (AENV_TEST_FAKE_ALL=1 runs it there all the same, to see what could
    join the tier)."""
    if not FAKE_RUNTIME or os.environ.get("AENV_TEST_FAKE_ALL"):
        return
    for item in items:
        if item.get_closest_marker("root") and os.geteuid() != 0:
            item.add_marker(pytest.mark.skip(reason="needs root: without it the fake runtime has one id, `user`"))
        if not item.get_closest_marker("fast") or item.get_closest_marker("runsc") or item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.skip(reason="not in the fast tier: needs runsc, or is slow"))


UNSTATED_SKIPS = ("", "unconditional skip")  # what pytest says of a skip that gave no reason


def unstated_skip(item: pytest.Item, report: pytest.TestReport) -> None:
    """On CI a test skipped without a stated reason fails: a skip must say why it cannot run there."""
    if not (os.environ.get("CI") and report.skipped and not hasattr(report, "wasxfail")):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr or "")
    reason = reason.removeprefix("Skipped").lstrip(":").strip()
    if reason in UNSTATED_SKIPS or reason.startswith("condition:"):
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} was skipped on CI without a stated reason ({reason or 'none'})"


def _have_runtime() -> bool:
    if FAKE_RUNTIME:
        return True
    return os.geteuid() == 0 and shutil.which("runsc") is not None and shutil.which("debootstrap") is not None


@pytest.fixture(scope="session")
def server() -> Iterator[Server]:
    if not _have_runtime():
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox tests: need root, runsc and debootstrap")
        pytest.skip("needs root, runsc and debootstrap (the CI machine has them)")
    # A repository shared with another process's server: that one collects its garbage.
    shared = {"AENV_REPO": str(REPO_DIR), "AENV_REPO_GC_INTERVAL": "0"} if SHARED_REPO else None
    srv = start_server(DATA_DIR, extra_env=shared)
    yield srv
    srv.stop()


def prepare_base(data_dir: Path = DATA_DIR, timeout: float = BASE_BUILD_TIMEOUT) -> None:
    """A server on ``data_dir`` until `base` is built and committed to its repository (where
    other servers, and another pytest process's, fetch it from), then stopped."""
    srv = start_server(data_dir, timeout=timeout)
    try:
        deadline = time.monotonic() + timeout
        with srv.client() as api:
            while not api.get("/templates/base").json().get("committed"):
                if time.monotonic() > deadline:
                    raise RuntimeError("`base` was not committed to the repository in time")
                time.sleep(1)
    finally:
        srv.stop()


@pytest.fixture()
def api(server: Server) -> Iterator[httpx.Client]:
    with server.client() as client:
        yield client


@pytest.fixture()
def e2b_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    return server


@pytest.fixture()
def sandbox(e2b_env: Server) -> Iterator[object]:
    yield from e2b_sandbox()


@pytest.fixture(scope="session")
def small_node() -> Iterator[Server]:
    """A busybox node (template `bb`) with room for three sandboxes, emptied of what an earlier run
    left: fork groups that fill it (tests/sdk), counters read as deltas (tests/dashboard)."""
    if not _have_runtime():
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox tests: need root, runsc and debootstrap")
        pytest.skip("needs root, runsc and debootstrap (the CI machine has them)")
    srv = start_busybox_node(Path(f"{DATA_DIR}-small"), {"AENV_MAX_SANDBOXES": "3"})
    with srv.client() as api:
        for item in api.get("/v2/sandboxes").json():  # running and paused
            api.delete(f"/sandboxes/{item['sandboxID']}")
    yield srv
    srv.stop()


def e2b_sandbox() -> Iterator[object]:
    """A sandbox of the deployment the E2B_* variables name, killed after (if it still lives)."""
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=300)
    yield sbx
    try:
        sbx.kill()
    except Exception:
        pass


# What tests leave on disk goes as soon as it may (tests/disk.py): a passed test's tmp_path after its
# teardown, a module's tmp_path_factory directories after its last test. A failed test's are kept
# (its servers' logs) while the disk has room.
KEEP_FAILED_ABOVE_GIB = 15
_failed = pytest.StashKey[bool]()
_tmp = pytest.StashKey[Path]()
_module: dict[str, object] = {"name": None, "before": set(), "failed": False}


def _basetemp(config: pytest.Config) -> Path:
    return config._tmp_path_factory.getbasetemp()  # type: ignore[attr-defined]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> object:
    if _module["name"] != item.nodeid.split("::")[0]:  # before its module fixtures are made
        _module.update(name=item.nodeid.split("::")[0], failed=False, before=set(_basetemp(item.config).iterdir()))
    try:
        return (yield)
    finally:
        tmp = getattr(item, "funcargs", {}).get("tmp_path")
        if isinstance(tmp, Path):
            item.stash[_tmp] = tmp


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    unstated_skip(item, report)
    if report.failed:
        item.stash[_failed] = True
        _module["failed"] = True
    return report


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> object:
    try:
        return (yield)
    finally:
        base = _basetemp(item.config)
        roomy = disk.free_gib(base) > KEEP_FAILED_ABOVE_GIB
        tmp = item.stash.get(_tmp, None)
        if tmp is not None and not (item.stash.get(_failed, False) and roomy):
            disk.release(tmp)
        if nextitem is None or nextitem.nodeid.split("::")[0] != _module["name"]:
            if not (_module["failed"] and roomy):  # the module's fixtures are torn down by now
                before = _module["before"]
                assert isinstance(before, set)
                for path in set(base.iterdir()) - before:
                    if path.is_dir():
                        disk.release(path)
                disk.dispose_now()
