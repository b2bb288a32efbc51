"""`./scripts/cluster up|status|down`: a real cluster on loopback (3 etcd members, 2 nodes, 1 gateway),
driven by the real E2B SDK through the variables `up` prints; etcd out of any other local user's
reach; `up` again brings back only what is down; nothing of it left after `down`.

One cluster for the module (its tests run in this order). Each was seen failing before its fix:
the local user read cluster.json's neighbours' logs and talked to etcd in plaintext; `up` on a
partly-down cluster stopped everything and started a new one; scripts/cluster ran pip."""

from __future__ import annotations

import asyncio
import json
import os
import pwd
import random
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.cluster.entries import ClusterConfig, NodeEntry
from aenv.cluster.local import ClusterError, Layout, alive, etcd_tls, loops_under, mounts_under
from aenv.cluster.local_up import check_ports
from aenv.cluster.store import ClusterStore, EtcdTls
from aenv.errors import ClusterUnavailable
from tests import disk
from tests.cluster.conftest import require_etcd
from tests.conftest import DATA_DIR, REPO_DIR, Server

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[2]
NODES, GATEWAYS = 2, 2  # the second gateway serves a client while the first is down


@dataclass
class Local:
    root: Path
    env: dict[str, str]
    base: int
    exports: dict[str, str]
    pip_log: Path

    @property
    def state(self) -> dict[str, object]:
        return json.loads((self.root / "cluster.json").read_text())  # type: ignore[no-any-return]

    @property
    def etcd_url(self) -> str:
        return "etcds://" + ",".join(m["url"].removeprefix("https://") for m in self.state["etcd"])  # type: ignore[attr-defined]

    def tls(self, part: str) -> EtcdTls:
        d = self.root / "certs" / part
        return EtcdTls(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))


def run(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(ROOT / "scripts/cluster"), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def free_base_port() -> int:
    for _ in range(50):
        # below the kernel's ephemeral range (32768..): no outgoing connection takes one of them
        # between this check and `up`, or while a process killed by the test is started again
        base = random.randrange(20000, 32000, 10)
        try:
            check_ports(Layout(Path("/nonexistent"), base), NODES, GATEWAYS)
        except ClusterError:
            continue
        return base
    raise RuntimeError("no free range of ports")


def exports(stdout: str) -> dict[str, str]:
    pairs = [line.removeprefix("export ").split("=", 1) for line in stdout.splitlines() if line.startswith("export ")]
    return dict(pairs)


@pytest.fixture(scope="module")
def local(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Local]:
    require_etcd()
    root = DATA_DIR.parent / f"{DATA_DIR.name}-local-cluster"
    disk.dispose_after_module(root)  # three nodes' data dirs, after `down`
    bin_dir = tmp_path_factory.mktemp("python")
    pip_log = bin_dir / "calls"
    wrapper = bin_dir / "python"  # records what scripts/cluster asks of Python
    wrapper.write_text(f'#!/bin/sh\necho "$@" >> {pip_log}\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = {
        **os.environ,
        "PYTHON": str(wrapper),
        "AENV_CLUSTER_DIR": str(root),
        "AENV_SPARE_UPPERS": "1",  # two cores shared by every node of the test
        "AENV_REPO_GC_INTERVAL": "0",  # the repository is the session server's too
    }
    env.pop("AENV_API_KEY", None)  # the cluster makes its own
    run("down", env=env)  # a previous run's leftovers
    # The node dirs are kept between local runs (the fetched `base` layers stay); the repository
    # is the session server's, where `base` is committed, so no node builds it.
    root.mkdir(exist_ok=True)
    (root / "repo").unlink(missing_ok=True)
    (root / "repo").symlink_to(REPO_DIR)
    (root / "api-key").unlink(missing_ok=True)
    base = free_base_port()
    try:
        started = time.monotonic()
        up = run("up", "--nodes", str(NODES), "--gateways", str(GATEWAYS), "--base-port", str(base), env=env)
        assert up.returncode == 0, up.stderr
        print(f"up in {time.monotonic() - started:.1f}s")
        yield Local(root, env, base, exports(up.stdout), pip_log)
    finally:
        run("down", "--timeout", "60", env=env)


def test_up_prints_what_the_e2b_sdk_needs(local: Local) -> None:
    root, variables, state = local.root, local.exports, local.state
    assert "pip" not in local.pip_log.read_text()  # scripts/cluster installs nothing
    assert state["apiKey"] == variables["E2B_API_KEY"] == (root / "api-key").read_text().strip()
    assert state["gateways"][0] == f"http://127.0.0.1:{local.base}" == variables["E2B_API_URL"]  # type: ignore[index]
    assert len(state["gateways"]) == GATEWAYS  # type: ignore[arg-type]
    assert variables["E2B_SANDBOX_URL"] == variables["E2B_API_URL"]
    nodes = state["nodes"]
    assert [n["nodeID"] for n in nodes] == ["n0", "n1"]  # type: ignore[attr-defined]
    assert len({n["dataDir"] for n in nodes}) == NODES  # type: ignore[attr-defined]
    for node in nodes:  # type: ignore[attr-defined]
        assert alive(node["pid"], node["dataDir"])
        assert Path(node["dataDir"]).parent == root / "nodes"
        assert httpx.get(f"{node['url']}/health", timeout=5).json()["status"] == "ok"
    assert len(state["etcd"]) == 3  # type: ignore[arg-type]
    for member in state["etcd"]:  # type: ignore[attr-defined]
        assert alive(member["pid"], "etcd") and member["url"].startswith("https://")
        health = httpx.get(f"{member['url']}/health", timeout=5, verify=etcd_tls(Layout(root)))
        assert health.json()["health"] == "true"
    key = {"X-API-Key": str(state["apiKey"])}
    listed = httpx.get(f"{variables['E2B_API_URL']}/nodes", headers=key, timeout=5).json()
    assert sorted(n["nodeID"] for n in listed) == ["n0", "n1"]
    assert (root / "logs" / "node-n0.log").stat().st_size > 0

    with sdk_env(variables):
        sbx = Sandbox.create(timeout=300)
        assert sbx.commands.run("echo through the cluster").stdout == "through the cluster\n"
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        sbx.kill()


class Commands:
    """A client running commands in a sandbox through one gateway, one after another, from a
    thread, for as long as the block lasts: how many ran, and every error it saw."""

    def __init__(self, variables: dict[str, str], gateway: str, sandbox_id: str) -> None:
        self.variables, self.gateway, self.sandbox_id = variables, gateway, sandbox_id
        self.ran, self.errors = 0, []  # type: list[str]
        self.stop = threading.Event()

    def _loop(self) -> None:
        key = self.variables["E2B_API_KEY"]
        try:
            sandbox = Sandbox.connect(self.sandbox_id, api_key=key, api_url=self.gateway, sandbox_url=self.gateway)
        except Exception as exc:  # noqa: BLE001 - reported by the test
            self.errors.append(f"connect: {exc!r}")
            return
        while not self.stop.is_set():
            try:
                out = sandbox.commands.run(f"echo {self.ran}", timeout=30).stdout
                if out != f"{self.ran}\n":
                    self.errors.append(f"command {self.ran} printed {out!r}")
                self.ran += 1
            except Exception as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(f"command {self.ran} at {time.monotonic():.1f}: {exc!r}")
                self.ran += 1
            time.sleep(0.2)

    def __enter__(self) -> Commands:
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(60)


class sdk_env:  # noqa: N801  (a context manager over os.environ, which the SDK reads)
    def __init__(self, variables: dict[str, str], url: str | None = None) -> None:
        self.set = {k: variables[k] for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
        if url:
            self.set["E2B_API_URL"] = self.set["E2B_SANDBOX_URL"] = url

    def __enter__(self) -> None:
        self.saved = {k: os.environ.get(k) for k in self.set}
        os.environ.update(self.set)

    def __exit__(self, *exc: object) -> None:
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- another local user ----------------------------------------------------------------------------


@pytest.fixture()
def stranger() -> Iterator[str]:
    """A host user of no privilege, as any local account is."""
    name = f"aenvprobe{secrets.token_hex(3)}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/bin/sh", name], check=True, capture_output=True)
    try:
        yield name
    finally:
        subprocess.run(["userdel", name], check=False, capture_output=True)


def as_user(user: str, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["runuser", "-u", user, "--", *argv], capture_output=True, text=True, timeout=30, cwd="/")


def test_a_local_user_reads_nothing_and_reaches_no_etcd(local: Local, stranger: str) -> None:
    root, state = local.root, local.state
    secret = asyncio.run(read_config(local, local.tls("node"))).secret  # what they are after
    # the cluster's files: the dir and everything the script keeps there, owner-only
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    for path in [root / "logs", root / "certs", root / "etcd", root / "nodes", root / "nodes" / "n0"]:
        assert stat.S_IMODE(path.stat().st_mode) == 0o700, path
    for path in [root / "cluster.json", root / "api-key", *(root / "logs").iterdir(), *(root / "certs").rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    readable = [
        root / "cluster.json",
        root / "api-key",
        root / "logs" / "node-n0.log",
        root / "logs" / "etcd-m0.log",
        root / "certs" / "ca.key",
        root / "certs" / "root" / "password",
        *(root / "certs" / part / "client.key" for part in ("node", "gateway", "root")),
        root / "certs" / "member" / "member.key",
        root / "nodes" / "n0" / "api-key",
    ]
    for path in readable:
        r = as_user(stranger, "cat", str(path))
        assert r.returncode != 0 and "Permission denied" in r.stderr and r.stdout == "", (path, r)
    assert as_user(stranger, "ls", str(root)).returncode != 0

    # etcd: a client and a peer need a certificate of the cluster's CA, which the user has not
    scratch = Path(tempfile.mkdtemp(prefix="aenv-probe-"))
    try:
        shutil.copy(root / "certs" / "ca.crt", scratch / "ca.crt")  # a CA certificate is no secret
        who = pwd.getpwnam(stranger)
        os.chown(scratch, who.pw_uid, who.pw_gid)
        (scratch / "ca.crt").chmod(0o644)
        pem, own_key = scratch / "own.crt", scratch / "own.key"
        own = ["openssl", "req", "-x509", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        own += ["-subj", "/CN=aenv-node", "-days", "2", "-keyout", str(own_key), "-out", str(pem)]
        made = as_user(stranger, *own)  # a certificate of the user's own, named as a node's
        assert made.returncode == 0, made.stderr
        body = json.dumps({"key": "L2FlbnYvY2x1c3Rlcg=="})  # /aenv/cluster
        node_put = json.dumps({"key": "L2FlbnYvbm9kZXMvZmFrZQ==", "value": "e30="})  # /aenv/nodes/fake
        for member in state["etcd"]:  # type: ignore[attr-defined]
            client = int(member["url"].rsplit(":", 1)[1])
            for port in (client, client + 1):  # clients, peers
                tries = [
                    ["curl", "-sS", "--max-time", "5", f"http://127.0.0.1:{port}/v3/kv/range", "-d", body],
                    ["curl", "-sS", "-k", "--max-time", "5", f"https://127.0.0.1:{port}/v3/kv/range", "-d", body],
                    ["curl", "-sS", "-k", "--max-time", "5", f"https://127.0.0.1:{port}/v3/kv/put", "-d", node_put],
                    ["curl", "-sS", "--max-time", "5", "--cacert", str(scratch / "ca.crt"), "--cert", str(pem)]
                    + ["--key", str(own_key), f"https://127.0.0.1:{port}/v3/kv/range", "-d", body],
                    ["curl", "-sS", "-k", "--max-time", "5", f"https://127.0.0.1:{port}/members"],
                ]
                for argv in tries:
                    r = as_user(stranger, *argv)
                    said = r.stdout + r.stderr
                    assert "kvs" not in said and secret not in said and '"header"' not in said, (argv, said)
                    assert r.returncode != 0 or "HTTP request to an HTTPS server" in r.stdout, (argv, said)
        # the same request with a certificate of the cluster's CA gets through: the probe could tell
        ok = subprocess.run(
            ["curl", "-sS", "--max-time", "5", "--cacert", str(root / "certs" / "ca.crt")]
            + ["--cert", str(root / "certs/node/client.crt"), "--key", str(root / "certs/node/client.key")]
            + [f"{state['etcd'][0]['url']}/version"],  # type: ignore[index]
            capture_output=True,
            text=True,
        )
        assert ok.returncode == 0 and "etcdserver" in ok.stdout, ok
        asyncio.run(only_aenv_users_get_in(local, *intruder_certificate(local, scratch)))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


async def read_config(local: Local, tls: EtcdTls) -> ClusterConfig:
    store = ClusterStore.from_url(local.etcd_url, tls=tls, timeout=3)
    try:
        config = await store.get_config()
    finally:
        await store.close()
    assert config is not None
    return config


def intruder_certificate(local: Local, scratch: Path) -> tuple[Path, Path]:
    """A certificate of the cluster's CA (one that leaked, say) for a user etcd does not know."""
    ca = local.root / "certs"
    key, csr, cert = scratch / "k.pem", scratch / "r.csr", scratch / "c.pem"
    subprocess.run(
        ["openssl", "req", "-new", "-nodes", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256"]
        + ["-subj", "/CN=intruder", "-keyout", str(key), "-out", str(csr)],
        check=True,
        capture_output=True,
    )
    subprocess.run(
        ["openssl", "x509", "-req", "-in", str(csr), "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key")]
        + ["-set_serial", "7", "-days", "1", "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return cert, key


async def only_aenv_users_get_in(local: Local, cert: Path, key: Path) -> None:
    """Past TLS, etcd's auth: a certificate of the CA for a user etcd does not know reads nothing,
    a gateway's cannot register a node; a node's reads the configuration."""
    ca = local.root / "certs"
    fake = NodeEntry(node_id="fake", address="http://127.0.0.1:9", driver="gvisor", version="x")
    refused = [
        EtcdTls(str(ca / "ca.crt"), str(cert), str(key)),  # signed by the CA, no etcd user
        EtcdTls(str(ca / "ca.crt")),  # no certificate
        EtcdTls(None, str(cert), str(key)),  # the system's roots: not the members' CA
    ]
    for tls in refused:
        store = ClusterStore.from_url(local.etcd_url, tls=tls, timeout=2)
        try:
            with pytest.raises(ClusterUnavailable):
                await store.get_config()
            with pytest.raises(ClusterUnavailable):
                await store.put_node(fake, 0)
        finally:
            await store.close()
    gateway = ClusterStore.from_url(local.etcd_url, tls=local.tls("gateway"), timeout=3)
    try:
        assert await gateway.get_config() is not None  # it signs URLs with the secret
        with pytest.raises(ClusterUnavailable, match="lacks the permission"):
            await gateway.put_node(fake, await gateway.grant_lease(10))
    finally:
        await gateway.close()
    assert "fake" not in [n.node_id for n in await nodes_of(local)]


async def nodes_of(local: Local) -> list[NodeEntry]:
    store = ClusterStore.from_url(local.etcd_url, tls=local.tls("node"), timeout=3)
    try:
        return await store.nodes()
    finally:
        await store.close()


# -- up again ------------------------------------------------------------------------------------------


def test_up_again_brings_back_only_what_is_down(local: Local) -> None:
    env, base, before = local.env, local.base, local.state
    again = run("up", env=env)  # everything up: nothing done, the same variables
    assert again.returncode == 0 and exports(again.stdout) == local.exports and "already up" in again.stderr
    assert local.state == before
    other_shape = run("up", "--nodes", "3", env=env)
    assert other_shape.returncode == 1 and "already up" in other_shape.stderr
    elsewhere = {**env, "AENV_CLUSTER_DIR": str(local.root) + "-second"}
    taken = run("up", "--nodes", "1", "--gateways", "1", "--base-port", str(base), env=elsewhere)
    assert taken.returncode == 1 and f"{base} (gateway g0)" in taken.stderr, taken.stderr
    shutil.rmtree(elsewhere["AENV_CLUSTER_DIR"], ignore_errors=True)
    status = run("status", env=env)
    assert status.returncode == 0 and all(n["alive"] for n in json.loads(status.stdout)["nodes"])
    assert "apiKey" not in status.stdout

    # a sandbox on n0, and what the cluster's etcd says, before part of it goes down
    with httpx.Client(base_url=before["nodes"][0]["url"], headers={"X-API-Key": local.exports["E2B_API_KEY"]}) as n0:  # type: ignore[index]
        made = n0.post("/sandboxes", json={"templateID": "base", "timeout": 300}, timeout=120)
        assert made.status_code == 201, made.text
    sandbox_id = made.json()["sandboxID"]
    secret = asyncio.run(read_config(local, local.tls("node"))).secret
    gone = [before["etcd"][1], before["nodes"][1], before["gatewayProcesses"][0]]  # type: ignore[index]
    with Commands(local.exports, before["gateways"][1], sandbox_id) as client:  # type: ignore[index]
        for entry in gone:
            os.kill(entry["pid"], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while any(alive(e["pid"], "") for e in gone) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert run("status", env=env).returncode == 1
        back = run("up", env=env)
        assert back.returncode == 0, back.stderr
    assert client.ran > 10 and client.errors == [], (client.ran, client.errors[:5])
    assert exports(back.stdout) == local.exports  # the same URLs and key
    after = local.state
    for role in ("etcd", "nodes", "gatewayProcesses"):
        for old, new in zip(before[role], after[role], strict=True):  # type: ignore[call-overload]
            assert {k: v for k, v in old.items() if k != "pid"} == {k: v for k, v in new.items() if k != "pid"}
            assert (old["pid"] == new["pid"]) == (old not in gone), (role, old, new)  # only the gone ones again
            assert alive(new["pid"], "")
    assert asyncio.run(read_config(local, local.tls("node"))).secret == secret  # etcd's data kept
    headers = {"X-API-Key": local.exports["E2B_API_KEY"]}
    gateway = local.exports["E2B_API_URL"]
    assert sorted(n["nodeID"] for n in httpx.get(f"{gateway}/nodes", headers=headers, timeout=5).json()) == ["n0", "n1"]
    info = httpx.get(f"{gateway}/sandboxes/{sandbox_id}", headers=headers, timeout=10).json()
    assert info["state"] == "running" and info["nodeID"] == "n0", info
    listed = httpx.get(f"{gateway}/v2/sandboxes", headers=headers, timeout=10).json()
    assert {i["sandboxID"]: i.get("nodeID") for i in listed}[sandbox_id] == "n0"
    with sdk_env(local.exports):
        assert Sandbox.connect(sandbox_id).commands.run("echo still here").stdout == "still here\n"
    assert httpx.delete(f"{gateway}/sandboxes/{sandbox_id}", headers=headers, timeout=30).status_code == 204


def test_down_leaves_nothing(local: Local) -> None:
    env, root, state = local.env, local.root, local.state
    with sdk_env(local.exports, url=state["nodes"][1]["url"]):  # type: ignore[index]
        orphan = Sandbox.create(timeout=300)  # straight on n1, which is then killed -9: down's to clean up
        assert orphan.commands.run("true").exit_code == 0
    os.kill(state["nodes"][1]["pid"], signal.SIGKILL)  # type: ignore[index]
    time.sleep(0.5)
    down = run("down", "--timeout", "60", env=env)  # a node not stopped by then is killed, and cleaned up after
    assert down.returncode == 0, down.stderr
    nothing_left(root, state)
    assert run("status", env=env).returncode == 3
    assert run("down", env=env).returncode == 0  # again: nothing to do


def nothing_left(root: Path, state: dict[str, object]) -> None:
    every = [*state["nodes"], *state["etcd"], *state["gatewayProcesses"]]  # type: ignore[misc]
    assert not [e for e in every if Path(f"/proc/{e['pid']}").exists() and alive(e["pid"], "")]
    ours = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(root).encode() in (proc / "cmdline").read_bytes():
                ours.append(proc.name)
        except OSError:
            continue
    assert ours == [], "processes of the cluster outlived `down`"
    assert mounts_under(root) == []
    assert loops_under(root) == []
    for node in state["nodes"]:  # type: ignore[attr-defined]
        runsc_root = Path(node["dataDir"]) / "runtime" / "runsc"
        assert not list(runsc_root.iterdir()), "runsc containers outlived `down`"
    for member in state["etcd"]:  # type: ignore[attr-defined]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{member['url']}/health", timeout=2, verify=False)
    assert not (root / "cluster.json").exists()


def test_scripts_cluster_says_how_to_install_instead_of_installing(tmp_path: Path) -> None:
    """A Python without aenv's dependencies: scripts/cluster says what to run, and runs no pip."""
    calls = tmp_path / "calls"
    bare = tmp_path / "python"
    bare.write_text(f'#!/bin/sh\necho "$@" >> {calls}\nexec {sys.executable} -S "$@"\n')  # no site-packages
    bare.chmod(0o755)
    env = {**os.environ, "PYTHON": str(bare), "AENV_CLUSTER_DIR": str(tmp_path / "cluster")}
    done = run("up", "--nodes", "1", env=env, timeout=60)
    assert done.returncode == 1 and "./scripts/install" in done.stderr and "pip install -e ." in done.stderr
    assert "pip" not in calls.read_text()
    assert not (tmp_path / "cluster").exists()


def test_a_cluster_dir_another_user_made_is_refused(stranger: str) -> None:
    """A local user who makes the cluster dir first (in /var/tmp, before root's first `up`) would
    own the keys written there: `up` refuses it, writing nothing."""
    planted = Path(tempfile.mkdtemp(prefix="aenv-planted-", dir="/var/tmp"))
    try:
        who = pwd.getpwnam(stranger)
        os.chown(planted, who.pw_uid, who.pw_gid)
        env = {**os.environ, "PYTHON": sys.executable, "AENV_CLUSTER_DIR": str(planted)}
        done = run("up", "--nodes", "1", "--gateways", "1", "--base-port", str(free_base_port()), env=env, timeout=60)
        assert done.returncode == 1 and "belongs to another user" in done.stderr, done.stderr
        assert list(planted.iterdir()) == []
    finally:
        shutil.rmtree(planted, ignore_errors=True)
