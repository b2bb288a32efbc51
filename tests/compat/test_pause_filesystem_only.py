"""Linux's boot id and E2B's pause without memory, with the official `e2b` SDK.

`/proc/sys/kernel/random/boot_id` is part of a sandbox's memory: a full pause, a snapshot and a
fork keep it, a fresh boot (the resume of a sandbox paused without memory) draws a new one. A
pause without memory (`pause(mode="filesystem")`, `keep_memory=False`, a timeout with
`autoPauseMemory: false`) ends every process and keeps the files; the resume boots the sandbox
anew and starts its template's start command again.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import CommandExitException, Sandbox, SandboxQuery, SandboxState, Template
from e2b.exceptions import NotFoundException, SandboxException

from tests.compat.conftest import Deployment

pytestmark = pytest.mark.sandbox

BOOT_ID = "/proc/sys/kernel/random/boot_id"
HOME = "/home/user"
UUID4 = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}\n")


@pytest.fixture()
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, envs={"KEPT": "across reboots"}, metadata={"suite": "pausefs"})
    yield sandbox
    sandbox.kill()


def boot_id(sandbox: Sandbox) -> str:
    return sandbox.files.read(BOOT_ID).strip()


def processes(sandbox: Sandbox) -> list[str]:
    return [" ".join([p.cmd, *p.args]) for p in sandbox.commands.list()]


def running(sandbox: Sandbox, command: str) -> bool:
    return any(command in p for p in processes(sandbox))


def wait_paused(sandbox: Sandbox, within: float = 30) -> None:
    deadline = time.monotonic() + within
    while sandbox.get_info().state != SandboxState.PAUSED:
        assert time.monotonic() < deadline, "the sandbox was not paused"
        time.sleep(0.2)


# -- boot_id -------------------------------------------------------------------------------------------
def test_boot_id_is_a_uuid_that_users_cannot_change(sbx: Sandbox) -> None:
    raw = sbx.files.read(BOOT_ID)
    assert UUID4.fullmatch(raw), raw
    assert sbx.commands.run(f"cat {BOOT_ID}").stdout == raw  # programs read it as the SDK does
    with pytest.raises(CommandExitException):
        sbx.commands.run(f"echo x > {BOOT_ID}", user="user")
    assert sbx.files.read(BOOT_ID) == raw
    mode = sbx.commands.run(f"stat -c %a {BOOT_ID}").stdout.strip()
    assert mode == "444"


def test_boot_id_differs_between_independent_boots(sbx: Sandbox) -> None:
    """Two sandboxes of one template share the template's boot (they are its memory), but a
    reboot of either draws a fresh id that matches neither."""
    other = Sandbox.create(timeout=120)
    try:
        assert boot_id(other) == boot_id(sbx)  # restored from the same checkpoint, as E2B's are
        other.pause(mode="filesystem")
        other.connect()
        assert boot_id(other) not in (boot_id(sbx), "")
    finally:
        other.kill()


# -- a full pause keeps everything -------------------------------------------------------------------------
def test_full_pause_keeps_boot_id_and_processes(sbx: Sandbox) -> None:
    before = boot_id(sbx)
    sbx.commands.run("sleep 1000", background=True)
    assert sbx.pause() is not False
    assert sbx.get_info().state == SandboxState.PAUSED
    sbx.connect()
    assert boot_id(sbx) == before
    assert running(sbx, "sleep 1000")


# -- a pause without memory reboots ------------------------------------------------------------------------
def test_pause_without_memory_keeps_files_and_reboots(sbx: Sandbox) -> None:
    before = boot_id(sbx)
    sbx.files.write(f"{HOME}/marker.txt", "persisted")
    sbx.commands.run(f"mkdir -p {HOME}/deep/er && echo nested > {HOME}/deep/er/f && echo in-tmp > /tmp/t")
    sbx.commands.run("sleep 1000", background=True)
    assert running(sbx, "sleep 1000")

    assert sbx.pause(mode="filesystem") is not False
    assert not sbx.is_running()
    info = sbx.get_info()
    assert info.state == SandboxState.PAUSED
    listed = Sandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED], metadata={"suite": "pausefs"}))
    assert sbx.sandbox_id in [s.sandbox_id for s in listed.next_items()]

    resumed = sbx.connect()
    assert resumed.sandbox_id == sbx.sandbox_id and resumed.is_running()
    after = boot_id(resumed)
    assert UUID4.fullmatch(after + "\n") and after != before
    assert resumed.files.read(f"{HOME}/marker.txt") == "persisted"
    assert resumed.files.read(f"{HOME}/deep/er/f") == "nested\n"
    assert processes(resumed) == []  # nothing survives a reboot
    # The sandbox's settings do: environment, default user and working directory, its id.
    ran = resumed.commands.run("echo $KEPT; whoami; pwd; cat /run/e2b/.E2B_SANDBOX_ID; echo; test -e /tmp/t || echo no")
    # /tmp is the sandbox's memory (runsc's tmpfs): empty after a reboot, as on many Linux hosts.
    assert ran.stdout.splitlines() == ["across reboots", "user", HOME, sbx.sandbox_id, "no"]
    uptime = float(resumed.commands.run("cat /proc/uptime").stdout.split()[0])
    assert uptime < 60  # a new kernel


def test_pause_without_memory_twice(sbx: Sandbox) -> None:
    ids = [boot_id(sbx)]
    for round_ in range(2):
        sbx.files.write(f"{HOME}/round{round_}.txt", str(round_))
        sbx.pause(keep_memory=False)  # the deprecated spelling of mode="filesystem"
        sbx.connect()
        ids.append(boot_id(sbx))
    assert len(set(ids)) == 3
    assert [sbx.files.read(f"{HOME}/round{n}.txt") for n in range(2)] == ["0", "1"]
    sbx.pause()  # then a full pause keeps the latest boot
    sbx.connect()
    assert boot_id(sbx) == ids[-1]


def test_what_programs_wrote_last_is_kept(sbx: Sandbox) -> None:
    """The agent ends every process and syncs before the instance stops: data a program wrote
    without syncing, and the agent's own store (programs' user.* xattrs), are on disk."""
    script = (
        "import os\n"
        f"open('{HOME}/unsynced.bin', 'wb').write(os.urandom(1) * (8 << 20))\n"
        f"os.setxattr('{HOME}/unsynced.bin', 'user.note', b'kept')\n"
    )
    sbx.files.write(f"{HOME}/w.py", script)
    sbx.commands.run(f"python3 {HOME}/w.py")
    digest = sbx.commands.run(f"sha256sum {HOME}/unsynced.bin").stdout
    before = boot_id(sbx)
    sbx.pause(mode="filesystem")
    sbx.connect()
    assert boot_id(sbx) != before  # it did boot anew
    assert sbx.commands.run(f"sha256sum {HOME}/unsynced.bin").stdout == digest
    note = sbx.commands.run(f"python3 -c \"import os; print(os.getxattr('{HOME}/unsynced.bin', 'user.note'))\"")
    assert note.stdout.strip() == "b'kept'"


def test_kill_and_connect_while_paused_without_memory(sbx: Sandbox) -> None:
    before = boot_id(sbx)
    sbx.pause(mode="filesystem")
    with pytest.raises(SandboxException):  # paused: commands do not wake it, and fail
        sbx.commands.run("true", request_timeout=10)
    assert sbx.get_info().state == SandboxState.PAUSED
    again = Sandbox.connect(sbx.sandbox_id)  # connect by id, as another client would
    assert again.commands.run("echo up").stdout == "up\n"
    assert boot_id(again) != before
    again.pause(mode="filesystem")
    assert sbx.kill() is True
    with pytest.raises(NotFoundException):
        Sandbox.get_info(sbx.sandbox_id)
    assert sbx.kill() is False


def test_traffic_does_not_resume_a_sandbox_paused_without_memory(deployment: Deployment) -> None:
    """Auto-resume wakes a sandbox paused with its memory on traffic; a reboot only on request."""
    sandbox = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sandbox.files.write(f"{HOME}/f", "x")
        sandbox.pause()
        assert sandbox.files.read(f"{HOME}/f") == "x"  # full pause: traffic resumed it
        sandbox.pause(mode="filesystem")
        with pytest.raises(SandboxException):
            sandbox.files.read(f"{HOME}/f", request_timeout=10)
        assert sandbox.get_info().state == SandboxState.PAUSED
        sandbox.connect()
        assert sandbox.files.read(f"{HOME}/f") == "x"
    finally:
        sandbox.kill()


# -- the timeout's pause ----------------------------------------------------------------------------------
def test_auto_pause_without_memory_reboots_every_time(deployment: Deployment) -> None:
    sandbox = Sandbox.create(timeout=60, lifecycle={"on_timeout": {"action": "pause", "mode": "filesystem"}})
    try:
        ids = [boot_id(sandbox)]
        sandbox.files.write(f"{HOME}/marker.txt", "auto")
        for _ in range(2):  # the policy survives the resume
            sandbox.commands.run("sleep 1000", background=True)
            sandbox.set_timeout(0)
            wait_paused(sandbox)
            sandbox.connect()
            ids.append(boot_id(sandbox))
            assert processes(sandbox) == []
        assert len(set(ids)) == 3
        assert sandbox.files.read(f"{HOME}/marker.txt") == "auto"
        info = httpx.get(
            f"{deployment.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-Key": deployment.api_key}
        ).json()
        assert info["lifecycle"] == {"onTimeout": "pause", "autoResume": False, "keepMemory": False}
    finally:
        sandbox.kill()


def test_auto_pause_keep_memory_unset_is_a_full_pause() -> None:
    sandbox = Sandbox.create(timeout=60, lifecycle={"on_timeout": {"action": "pause", "keep_memory": None}})
    try:
        before = boot_id(sandbox)
        sandbox.set_timeout(0)
        wait_paused(sandbox)
        sandbox.connect()
        assert boot_id(sandbox) == before
    finally:
        sandbox.kill()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"autoPauseMemory": False}, "only applies when autoPause is true"),
        ({"autoPause": True, "autoPauseMemory": False, "autoResume": {"enabled": True}}, "cannot be combined"),
        ({"autoPause": True, "autoPauseMemory": "no"}, "autoPauseMemory"),
    ],
)
def test_auto_pause_memory_rules(deployment: Deployment, body: dict[str, object], message: str) -> None:
    r = httpx.post(
        f"{deployment.url}/sandboxes",
        json={"templateID": "base", "timeout": 30, **body},
        headers={"X-API-Key": deployment.api_key},
    )
    assert r.status_code == 400, r.text
    assert message in r.json()["message"]


def test_pause_body_is_checked(deployment: Deployment, sbx: Sandbox) -> None:
    r = httpx.post(
        f"{deployment.url}/sandboxes/{sbx.sandbox_id}/pause",
        json={"memory": "false"},
        headers={"X-API-Key": deployment.api_key},
    )
    assert r.status_code == 400 and "memory" in r.json()["message"]
    assert sbx.is_running()


# -- reboot on request, templates, snapshots and forks --------------------------------------------------------
def test_connect_reboot_boots_a_sandbox_paused_with_memory(sbx: Sandbox) -> None:
    before = boot_id(sbx)
    sbx.files.write(f"{HOME}/f", "kept")
    sbx.commands.run("sleep 1000", background=True)
    sbx.pause()
    rebooted = Sandbox.connect(sbx.sandbox_id, on_resume="reboot")
    assert boot_id(rebooted) != before
    assert processes(rebooted) == [] and rebooted.files.read(f"{HOME}/f") == "kept"


def test_start_command_runs_again_after_a_reboot(deployment: Deployment) -> None:
    name = f"pausefs-start-{uuid.uuid4().hex[:8]}"
    start = f"sh -c 'cat {BOOT_ID} >> {HOME}/starts; exec sleep 100000'"
    Template.build(Template().from_template("base").set_start_cmd(start, "test -s /home/user/starts"), name)
    try:
        sandbox = Sandbox.create(template=name, timeout=120)
        try:
            built = sandbox.files.read(f"{HOME}/starts").splitlines()
            assert len(built) == 1  # started once, when the template was committed
            assert running(sandbox, "sleep 100000")
            sandbox.pause(mode="filesystem")
            sandbox.connect()
            now = boot_id(sandbox)
            deadline = time.monotonic() + 10
            while len(sandbox.files.read(f"{HOME}/starts").splitlines()) < 2 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert sandbox.files.read(f"{HOME}/starts").splitlines() == [*built, now]
            assert running(sandbox, "sleep 100000")
        finally:
            sandbox.kill()
    finally:
        httpx.delete(f"{deployment.url}/templates/{name}", headers={"X-API-Key": deployment.api_key})


def test_snapshots_and_forks_keep_the_boot(deployment: Deployment, sbx: Sandbox) -> None:
    """A sandbox made from a snapshot, and a fork child, are its memory: the same boot. Rebooting
    one of them gives it, alone, a new one, on the snapshot's files."""
    api = httpx.Client(base_url=deployment.url, headers={"X-API-Key": deployment.api_key}, timeout=120)
    sbx.files.write(f"{HOME}/before-snapshot", "s")
    source_boot = boot_id(sbx)
    snap = api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={}).json()["snapshotID"]
    from_snapshot = Sandbox.create(template=snap, timeout=120)
    try:
        assert boot_id(from_snapshot) == source_boot
        from_snapshot.pause(mode="filesystem")
        from_snapshot.connect()
        assert boot_id(from_snapshot) != source_boot
        assert from_snapshot.files.read(f"{HOME}/before-snapshot") == "s"
        rebooted_boot = boot_id(from_snapshot)
        forked = api.post(f"/sandboxes/{from_snapshot.sandbox_id}/fork", json={"count": 1}).json()
        child = Sandbox.connect(forked[0]["sandbox"]["sandboxID"])
        try:
            assert boot_id(child) == rebooted_boot
            assert child.files.read(f"{HOME}/before-snapshot") == "s"
        finally:
            child.kill()
    finally:
        from_snapshot.kill()
        api.delete(f"/templates/{snap}")
        api.close()


def test_node_restart_keeps_a_sandbox_paused_without_memory(
    request: pytest.FixtureRequest, sbx: Sandbox, deployment: Deployment
) -> None:
    server = request.getfixturevalue("server")  # the session's own node, restarted in place
    if deployment.url != server.url:
        pytest.skip("restarts the session's own node; another deployment's nodes are not this test's to restart")
    sbx.files.write(f"{HOME}/survives", "restart")
    before = boot_id(sbx)
    sbx.pause(mode="filesystem")
    server.restart()
    assert sbx.get_info().state == SandboxState.PAUSED
    sbx.connect()
    assert sbx.files.read(f"{HOME}/survives") == "restart"
    assert boot_id(sbx) != before
