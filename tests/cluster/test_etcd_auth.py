"""etcd's auth (users and roles): `aenv etcd-auth` turns it on for a real 3-member etcd; nodes and
gateways log in (AENV_CLUSTER_USER, AENV_CLUSTER_PASSWORD_FILE) and may do only what their role
allows; a client with no user or a wrong password is refused with a reason; a login token a member
does not know (simple tokens live in one member's memory: it restarted, or gRPC moved to another)
is renewed without the caller noticing, for calls and for the mirror's watch alike."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.cluster.auth import GATEWAY_USER, NODE_USER, enable_auth
from aenv.cluster.entries import NodeEntry, SandboxEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore, EtcdUser
from aenv.errors import ClusterUnavailable, InvalidRequest
from tests.cluster.cluster import joins_and_serves
from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.conftest import API_KEY, Server

TOKEN_TTL = 2
PASSWORDS = {"root": "root-secret", NODE_USER: "node-secret\n", GATEWAY_USER: "gateway-secret"}


@pytest.fixture(scope="module")
def secrets_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("etcd-auth")
    for user, password in PASSWORDS.items():
        (d / user).write_text(password)  # a trailing newline (as `echo` writes) is not part of it
    return d


@pytest.fixture(scope="module")
def auth_etcd(secrets_dir: Path) -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(3)
    for m in cluster.members:
        m.argv.append(f"--auth-token-ttl={TOKEN_TTL}")  # tokens unused this long are forgotten (default 300 s)
    cluster.start()
    try:
        done = aenv("etcd-auth", "--cluster", cluster.url, *password_args(secrets_dir))
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["enabledNow"] is True
        assert {r["user"]: r["may"] for r in report["users"]} == {
            NODE_USER: "readwrite /aenv/",
            GATEWAY_USER: "read /aenv/, write /aenv/sandboxes/, write /aenv/tombstones/, write /aenv/teams/q/",
        }
        yield cluster
    finally:
        cluster.stop()


def aenv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "aenv.cli.main", *args],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )


def password_args(d: Path) -> list[str]:
    return [
        *("--root-password-file", str(d / "root")),
        *("--node-password-file", str(d / NODE_USER)),
        *("--gateway-password-file", str(d / GATEWAY_USER)),
    ]


def user(name: str) -> EtcdUser:
    return EtcdUser(name, PASSWORDS[name].strip())


def node_entry(node_id: str) -> NodeEntry:
    return NodeEntry(node_id=node_id, address="http://127.0.0.1:9", driver="gvisor", version="test")


async def test_each_user_may_do_what_its_role_allows_and_no_more(auth_etcd: EtcdCluster) -> None:
    node = ClusterStore.from_url(auth_etcd.url, user=user(NODE_USER), timeout=3)
    gateway = ClusterStore.from_url(auth_etcd.url, user=user(GATEWAY_USER), timeout=3)
    nobody = ClusterStore.from_url(auth_etcd.url, timeout=3)
    wrong = ClusterStore.from_url(auth_etcd.url, user=EtcdUser(GATEWAY_USER, "guessed"), timeout=3)
    try:
        lease = await node.grant_lease(30)
        await node.put_node(node_entry("auth-n1"), lease)
        assert (await node.create_sandbox(SandboxEntry(sandbox_id="auth-s1", node_id="auth-gone", state="paused"))).ok
        listing = await gateway.read_all()  # what a gateway mirrors
        assert "auth-n1" in listing.nodes and "auth-s1" in listing.sandboxes
        with pytest.raises(ClusterUnavailable, match="lacks the permission"):
            await gateway.put_node(node_entry("auth-fake"), await gateway.grant_lease(30))
        with pytest.raises(ClusterUnavailable, match="lacks the permission"):  # a create id is a node's to take
            await gateway.release_create("auth-c1", 1)
        # the kill of a lost node's sandbox: its entry goes and a tombstone comes, in one transaction
        current = await gateway.get_sandbox("auth-s1")
        assert current is not None and await gateway.bury_sandbox(current, 60)
        assert await gateway.get_sandbox("auth-s1") is None and "auth-s1" in await node.tombstones(["auth-s1"])
        with pytest.raises(ClusterUnavailable, match="AENV_CLUSTER_USER"):
            await nobody.read_all()
        with pytest.raises(ClusterUnavailable, match="wrong user name or password"):
            await wrong.read_all()
        await node.drop_tombstone("auth-s1")
        await node.revoke_lease(lease)
    finally:
        for store in (node, gateway, nobody, wrong):
            await store.close()


async def test_running_it_again_changes_passwords_and_nothing_else(auth_etcd: EtcdCluster, tmp_path: Path) -> None:
    (tmp_path / "new").write_text("rotated-secret")
    root = PASSWORDS["root"]
    report = await enable_auth(auth_etcd.url, root, {NODE_USER: "rotated-secret", GATEWAY_USER: None})
    assert report.enabled_now is False and set(report.users) == {NODE_USER, GATEWAY_USER}
    old = ClusterStore.from_url(auth_etcd.url, user=user(NODE_USER), timeout=3)
    new = ClusterStore.from_url(auth_etcd.url, user=EtcdUser(NODE_USER, "rotated-secret"), timeout=3)
    kept = ClusterStore.from_url(auth_etcd.url, user=user(GATEWAY_USER), timeout=3)  # none given: unchanged
    try:
        with pytest.raises(ClusterUnavailable, match="wrong user name or password"):
            await old.read_all()
        assert (await new.read_all()).revision > 0
        assert (await kept.read_all()).revision > 0
    finally:
        await old.close()
        await new.close()
        await kept.close()
        # back as the module's other tests know them
        passwords = {NODE_USER: PASSWORDS[NODE_USER].strip(), GATEWAY_USER: PASSWORDS[GATEWAY_USER]}
        await enable_auth(auth_etcd.url, root, passwords)
    refused = aenv("etcd-auth", "--cluster", auth_etcd.url, "--root-password-file", str(tmp_path / "new"))
    assert refused.returncode == 1 and "wrong user name or password" in refused.stderr, refused.stderr


async def test_a_forgotten_token_is_renewed_for_calls_and_the_watch(auth_etcd: EtcdCluster) -> None:
    """A token unused for etcd's TTL is forgotten (a gateway's store sits idle while it serves from
    its mirror; a restarted member forgets them all): the next call logs in again. The mirror's
    watch, made again on another member after its own died, logs in again too (etcd refuses a
    watch's token as a missing permission)."""
    store = ClusterStore.from_url(auth_etcd.url, user=user(NODE_USER), timeout=3)
    watcher = ClusterStore.from_url(auth_etcd.url, user=user(GATEWAY_USER), timeout=3)
    mirror = Mirror(watcher)
    first = auth_etcd.members[0]  # the one gRPC's pick_first talks to
    try:
        assert (await store.create_sandbox(SandboxEntry(sandbox_id="tok-1", node_id="n", state="running"))).ok
        await asyncio.sleep(TOKEN_TTL + 1.5)
        got = await store.get_sandbox("tok-1")
        assert got is not None and got.entry.node_id == "n"
        assert store._client is not None and store._client.logins == 2
        await mirror.start(wait=10)
        assert "tok-1" in mirror.sandboxes
        await asyncio.sleep(TOKEN_TTL + 1.5)  # the watch's token is forgotten; the watch goes on
        first.stop(signal.SIGKILL)
        await until_ok(lambda: store.create_sandbox(SandboxEntry(sandbox_id="tok-2", node_id="n", state="running")))
        assert await mirror.wait_for(lambda m: "tok-2" in m.sandboxes, 20), "the watch did not come back"
        assert watcher._client is not None and watcher._client.logins >= 2
        for sandbox_id in ("tok-1", "tok-2"):
            got = await store.get_sandbox(sandbox_id)
            assert got is not None and (await store.delete_sandbox(sandbox_id, got.mod_revision)).ok
        assert await mirror.wait_for(lambda m: not {"tok-1", "tok-2"} & set(m.sandboxes), 20)
    finally:
        if first.proc is None:
            auth_etcd.restart(first)
        await mirror.stop()
        await store.close()
        await watcher.close()


async def until_ok(call: object, timeout: float = 20.0) -> None:
    """The first call after a member's death may fail while gRPC notices it: no caller waits longer."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            result = await call()  # type: ignore[operator]
            assert result.ok, result
            return
        except ClusterUnavailable as exc:
            assert "permission" not in exc.message and "AENV_CLUSTER_USER" not in exc.message, exc.message
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.3)


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({"AENV_CLUSTER_PASSWORD": "x"}, "needs its user"),
        ({"AENV_CLUSTER_USER": "aenv-node"}, "needs a password"),
        ({"AENV_CLUSTER_USER": "aenv-node", "AENV_CLUSTER_PASSWORD_FILE": "{missing}"}, "cannot read"),
        (
            {"AENV_CLUSTER_USER": "aenv-node", "AENV_CLUSTER_PASSWORD_FILE": "{empty}", "AENV_CLUSTER_PASSWORD": "x"},
            "give the etcd password once",
        ),
        ({"AENV_CLUSTER_USER": "aenv-node", "AENV_CLUSTER_PASSWORD_FILE": "{empty}"}, "needs a password"),
        ({"AENV_CLUSTER_USER": "a\x01b", "AENV_CLUSTER_PASSWORD": "x"}, "printable"),
    ],
)
@pytest.mark.parametrize("command", ["server", "gateway"])
def test_bad_etcd_user_settings_are_refused_at_start(
    command: str, env: dict[str, str], says: str, tmp_path: Path
) -> None:
    (tmp_path / "empty").write_text("")
    names = {"missing": tmp_path / "nope", "empty": tmp_path / "empty"}
    args = ["--cluster", "etcd://127.0.0.1:1"]
    if command == "server":
        args += ["--data-dir", str(tmp_path / "never-made")]
    done = aenv(command, *args, env={"AENV_API_KEY": API_KEY, **{k: v.format(**names) for k, v in env.items()}})
    assert done.returncode == 2 and says in " ".join(done.stderr.split()), done.stderr[-2000:]
    assert not (tmp_path / "never-made").exists()


def test_an_etcd_user_without_a_cluster_is_a_mistake(tmp_path: Path) -> None:
    done = aenv(
        "server",
        "--data-dir",
        str(tmp_path / "never-made"),
        env={"AENV_API_KEY": API_KEY, "AENV_CLUSTER_USER": "aenv-node", "AENV_CLUSTER_PASSWORD": "x"},
    )
    assert done.returncode == 2 and "--cluster etcd://... is missing" in " ".join(done.stderr.split()), done.stderr
    with pytest.raises(InvalidRequest, match="needs its user"):
        EtcdUser.load(None, None, "x")


@pytest.mark.sandbox
def test_a_node_and_a_gateway_log_in_and_serve(
    server: Server, auth_etcd: EtcdCluster, secrets_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def login(name: str) -> dict[str, str]:
        return {"AENV_CLUSTER_USER": name, "AENV_CLUSTER_PASSWORD_FILE": str(secrets_dir / name)}

    joins_and_serves(auth_etcd.url, "node-auth", login(NODE_USER), login(GATEWAY_USER), monkeypatch)
