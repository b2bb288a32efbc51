"""A sandbox is always stoppable: nothing it does to its files or to its agent hangs the node.

- Hostile files (FIFOs, sockets, devices, pseudo files), as the target of every file operation,
  are refused or served at once, and the sandbox then still execs, pauses, resumes and dies.
- A wedged agent (sandbox root can SIGSTOP PID 1) fails every call within the agent deadline
  with a clear error; a DELETE overtakes any operation in flight on it and leaves nothing behind.
- Operations stuck in the runtime (a runsc command that hangs, the one thing faked here, by a
  wrapper around the real runsc) are cancelled by a kill or by the operation deadline.
- A node stopped (SIGTERM) with a wedged sandbox leaves no runsc process, mount, loop device or
  cgroup; after a crash (SIGKILL) the next start removes them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shutil
import signal
import stat
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import InvalidArgumentException, Sandbox, SandboxException, TimeoutException

from aenv.errors import OperationTimeout, SandboxNotFound
from aenv.node.orchestrator import Node
from tests.conftest import Server, start_busybox_node
from tests.node.test_failures import FaultyDriver, count, start_counter, tiny  # noqa: F401  (fixture)
from tests.node.test_restart import runsc_containers

pytestmark = pytest.mark.sandbox

QUICK = 10.0  # "within a few seconds", on a busy two-core machine
GONE = 30.0  # how long a killed instance's background teardown may take


@contextmanager
def quick(limit: float = QUICK) -> Iterator[None]:
    started = time.monotonic()
    yield
    assert time.monotonic() - started < limit, f"took {time.monotonic() - started:.1f}s"


def poll(check: Callable[[], list[str]], timeout: float = GONE) -> list[str]:
    """``check`` until it finds nothing (or the time is up); what it found last."""
    deadline = time.monotonic() + timeout
    while (found := check()) and time.monotonic() < deadline:
        time.sleep(0.3)
    return found


# -- what a runsc instance leaves on the host -------------------------------------------------------
def _processes(needle: str) -> list[str]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if needle in cmdline:
                out.append(f"process {proc.name}: {cmdline[:120]}")
    return out


def _mounts_under(path: Path) -> list[str]:
    lines = Path("/proc/mounts").read_text().splitlines()
    return [f"mount {line.split()[1]}" for line in lines if line.split()[1].startswith(f"{path}/")]


def _loop_devices_of(path: Path) -> list[str]:
    out = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            if backing.read_text().strip().startswith(f"{path}/"):
                out.append(f"loop device {backing.parent.parent.name} on {backing.read_text().strip()}")
        except OSError:
            continue
    return out


def _cgroups(instance_ids: set[str]) -> list[str]:
    return [f"cgroup {p}" for x in instance_ids for p in Path("/sys/fs/cgroup").glob(f"*/aenv/{x}")]


def instance_traces(server: Server, instance_id: str, upper: Path) -> list[str]:
    """What is left of one instance: its container, processes, mounts, cgroups, upper."""
    bundle = server.data_dir / "runtime" / "instances" / instance_id
    found = [f"runsc container {instance_id}"] if instance_id in runsc_containers(server) else []
    found += _processes(str(bundle)) + _mounts_under(bundle) + _cgroups({instance_id})
    found += [f"upper {upper}"] if upper.exists() or upper.with_suffix(".img").exists() else []
    return found


def node_traces(server: Server, instance_ids: set[str]) -> list[str]:
    """What a stopped node left: anything running, mounted or looped under its data dir."""
    data = server.data_dir
    return (
        runsc_traces(server)
        + _processes(str(data))
        + _mounts_under(data)
        + _loop_devices_of(data)
        + _cgroups(instance_ids)
    )


def runsc_traces(server: Server) -> list[str]:
    return [f"runsc container {x}" for x in runsc_containers(server)]


def new_instance(server: Server, before: set[str]) -> tuple[str, Path]:
    """The one runsc instance started since ``before``, and its upper's directory."""
    [instance_id] = runsc_containers(server) - before
    rootfs = server.data_dir / "runtime" / "instances" / instance_id / "rootfs"
    line = next(x for x in Path("/proc/mounts").read_text().splitlines() if x.split()[1] == str(rootfs))
    upperdir = next(o for o in line.split()[3].split(",") if o.startswith("upperdir="))
    return instance_id, Path(upperdir.removeprefix("upperdir=")).parent


def wedge(sbx: Sandbox) -> None:
    """Stop the agent (PID 1) from inside, as sandbox root may (once it has said the command started)."""
    sbx.commands.run("sleep 0.5; kill -STOP 1", user="root", background=True)
    time.sleep(1.5)


# -- hostile files, on the session node (real `base`, real e2b SDK) ------------------------------------
def hostile_files(sbx: Sandbox) -> None:
    sbx.commands.run(
        "mkfifo /home/user/answer.txt && ln -s /dev/zero /home/user/zeros && mknod /tmp/zero c 1 5"
        " && python3 -c 'import socket; socket.socket(socket.AF_UNIX).bind(\"/home/user/sock\")'",
        user="root",
    )


@pytest.mark.parametrize(
    "path",
    ["/home/user/answer.txt", "/home/user/sock", "/dev/zero", "/dev/urandom", "/dev/tty", "/home/user/zeros"],
)
def test_reading_what_is_not_a_regular_file_is_refused_at_once(sandbox: Sandbox, path: str) -> None:
    hostile_files(sandbox)
    with quick(), pytest.raises(InvalidArgumentException, match="not a regular file"):
        sandbox.files.read(path, request_timeout=30)


def test_every_file_operation_on_hostile_files_answers_and_the_sandbox_stays_stoppable(
    sandbox: Sandbox, api: httpx.Client
) -> None:
    hostile_files(sandbox)
    with quick():
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sandbox.files.write("/home/user/answer.txt", "no reader waits", request_timeout=30)
        sandbox.commands.run("sleep 60 < /home/user/answer.txt", background=True)  # now a reader does
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sandbox.files.write("/home/user/answer.txt", "x" * 2**20, request_timeout=30)
        with pytest.raises(InvalidArgumentException, match="not a regular file"):
            sandbox.files.write("/dev/null", "a device", request_timeout=30)
        info = sandbox.files.get_info("/home/user/answer.txt", request_timeout=30)
        assert info.name == "answer.txt" and info.size == 0
        names = {e.name for e in sandbox.files.list("/home/user", request_timeout=30)}
        # envd types a FIFO, a socket and a link to a device FILE_TYPE_UNSPECIFIED; the SDK leaves those out
        assert ".profile" in names and not names & {"answer.txt", "sock", "zeros"}
        with pytest.raises(InvalidArgumentException, match="not a directory"):
            sandbox.files.watch_dir("/home/user/answer.txt", request_timeout=30)
        with pytest.raises(InvalidArgumentException):
            sandbox.files.rename("/tmp/zero", "/home/user/zero", request_timeout=30)  # a copy would never end
        status = sandbox.files.read("/proc/self/status", request_timeout=30)  # reports size 0: read whole
        assert "Pid:" in status
        sandbox.files.rename("/home/user/answer.txt", "/home/user/moved.fifo", request_timeout=30)
        sandbox.files.remove("/home/user/moved.fifo", request_timeout=30)
    assert not sandbox.files.exists("/home/user/zero") and not sandbox.files.exists("/home/user/moved.fifo")
    assert_stoppable(sandbox, api)


def test_the_agents_own_files_cannot_block_it(sandbox: Sandbox, api: httpx.Client) -> None:
    """Files the agent itself reads or writes (user lookups, the sandbox id at every resume)."""
    sandbox.commands.run(
        "mv /etc/group /etc/group.real && mkfifo /etc/group && rm -f /run/e2b/.E2B_SANDBOX_ID"
        " && mkfifo /run/e2b/.E2B_SANDBOX_ID",
        user="root",
    )
    with quick():
        assert sandbox.commands.run("id -un", timeout=30).stdout == "user\n"
        sandbox.files.write("/home/user/f.txt", "ok", request_timeout=30)
        assert [e.owner for e in sandbox.files.list("/home/user", request_timeout=30) if e.name == "f.txt"] == ["user"]
    assert_stoppable(sandbox, api)


def assert_stoppable(sbx: Sandbox, api: httpx.Client) -> None:
    """exec, metrics, pause, resume and kill each answer within a few seconds."""
    sid = sbx.sandbox_id
    with quick():
        assert sbx.commands.run("echo alive", timeout=30).stdout == "alive\n"
    with quick():
        assert api.get(f"/sandboxes/{sid}/metrics", timeout=30).status_code == 200
    with quick():
        assert api.post(f"/sandboxes/{sid}/pause", timeout=30).status_code == 204
    with quick():
        assert api.post(f"/sandboxes/{sid}/resume", json={}, timeout=30).status_code == 201
    with quick():
        assert sbx.commands.run("cat /run/e2b/.E2B_SANDBOX_ID", timeout=30).stdout == sid
    with quick():
        assert api.delete(f"/sandboxes/{sid}", timeout=30).status_code == 204


# -- kill wins over operations in flight on a wedged agent (session node) -----------------------------
def _in_flight(e2b: Sandbox, api: httpx.Client, op: str) -> Callable[[], Any]:
    sid = e2b.sandbox_id
    return {
        "pause": lambda: api.post(f"/sandboxes/{sid}/pause", timeout=60),
        "snapshot": lambda: api.post(f"/sandboxes/{sid}/snapshots", json={}, timeout=60),
        "fork": lambda: api.post(f"/sandboxes/{sid}/fork", json={"count": 2}, timeout=60),
        "exec": lambda: e2b.commands.run("echo never", timeout=60),
        "download": lambda: e2b.files.read("/etc/hostname", request_timeout=60),
        "upload": lambda: e2b.files.write("/tmp/big", "x" * 8 * 2**20, request_timeout=60),
    }[op]


@pytest.mark.parametrize("op", ["pause", "snapshot", "fork", "exec", "download", "upload"])
def test_delete_overtakes_operations_on_a_wedged_agent(e2b_env: Server, api: httpx.Client, op: str) -> None:
    """``op`` and a pause in flight (it holds the sandbox's lock; ``op`` may queue behind it)."""
    listed = {s["sandboxID"] for s in api.get("/sandboxes").json()}
    before = runsc_containers(e2b_env)
    sbx = Sandbox.create(timeout=120)
    instance_id, upper = new_instance(e2b_env, before)
    wedge(sbx)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pending = [pool.submit(_in_flight(sbx, api, "pause")), pool.submit(_in_flight(sbx, api, op))]
        time.sleep(1.5)  # they are waiting on the agent, or for the lock, now
        assert not any(p.done() for p in pending)
        with quick(5):
            if op in ("pause", "snapshot", "fork"):
                assert api.delete(f"/sandboxes/{sbx.sandbox_id}", timeout=30).status_code == 204
            else:
                assert sbx.kill(request_timeout=30)  # the SDK's kill: the same DELETE
        concurrent.futures.wait(pending, timeout=QUICK)
        assert all(p.done() for p in pending)  # the operations in flight ended too, with errors
    for p in pending:
        outcome = p.result() if p.exception() is None else p.exception()
        if isinstance(outcome, httpx.Response):
            assert outcome.status_code == 404 and "was killed" in outcome.json()["message"], outcome.text
        else:
            assert isinstance(outcome, SandboxException), outcome
    assert api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404
    assert {s["sandboxID"] for s in api.get("/sandboxes").json()} <= listed  # no fork child either
    assert poll(lambda: instance_traces(e2b_env, instance_id, upper)) == []


def test_the_timeout_kills_a_sandbox_whatever_is_in_flight(e2b_env: Server, api: httpx.Client) -> None:
    before = runsc_containers(e2b_env)
    sbx = Sandbox.create(timeout=6)
    instance_id, upper = new_instance(e2b_env, before)
    wedge(sbx)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        snapshot = pool.submit(lambda: api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={}, timeout=60))
        gone = poll(lambda: [] if api.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 404 else ["alive"], 6 + QUICK)
        assert gone == []  # at its timeout, though the snapshot still waits on the wedged agent
        r = snapshot.result(timeout=QUICK)
    assert r.status_code == 404 and "was killed" in r.json()["message"], r.text
    assert poll(lambda: instance_traces(e2b_env, instance_id, upper)) == []


# -- a wedged agent, on a node of its own with a short agent deadline ----------------------------------
AGENT_TIMEOUT = 3


@pytest.fixture(scope="module")
def own(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A node this module stops and crashes, on a busybox template from a local OCI layout
    (nothing to debootstrap), whose agents must answer within AGENT_TIMEOUT seconds."""
    srv = start_busybox_node(tmp_path_factory.mktemp("stoppable") / "data", {"AENV_AGENT_TIMEOUT": str(AGENT_TIMEOUT)})
    yield srv
    srv.stop()


def use(server: Server, monkeypatch: pytest.MonkeyPatch) -> httpx.Client:
    monkeypatch.setenv("E2B_API_KEY", server.env["AENV_API_KEY"])
    monkeypatch.setenv("E2B_API_URL", server.url)
    monkeypatch.setenv("E2B_SANDBOX_URL", server.url)
    return server.client()


def test_calls_to_a_wedged_agent_fail_within_the_deadline(own: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    api = use(own, monkeypatch)
    before = runsc_containers(own)
    sbx = Sandbox.create(template="bb", timeout=120)
    instance_id, upper = new_instance(own, before)
    wedge(sbx)
    limit = AGENT_TIMEOUT + 5
    with quick(limit), pytest.raises(TimeoutException, match="did not answer"):
        sbx.commands.run("echo never", timeout=60)
    with quick(limit):
        r = api.get(f"/sandboxes/{sbx.sandbox_id}/metrics", timeout=60)
    assert r.status_code == 200, r.text  # sampled on the host: the agent is never asked
    with quick(limit), pytest.raises(SandboxException, match="504"):
        sbx.files.read("/etc/passwd", request_timeout=60)
    with quick(limit), pytest.raises(SandboxException, match="504"):
        sbx.files.write("/tmp/big", "x" * 8 * 2**20, request_timeout=60)  # more than the pipe and the window hold
    with quick(limit), pytest.raises(TimeoutException):
        sbx.files.list("/", request_timeout=60)
    with quick(limit):
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/pause", timeout=60)
    assert r.status_code == 504 and r.json()["error_code"] == "agent_timeout", r.text
    assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "running"  # not left pausing
    with quick(5):
        assert api.delete(f"/sandboxes/{sbx.sandbox_id}", timeout=30).status_code == 204
    assert poll(lambda: instance_traces(own, instance_id, upper)) == []


def test_a_stream_on_a_wedged_agent_ends_at_a_keepalive(own: Server) -> None:
    """A quiet command is normal; a quiet agent is not: the stream's keepalive pings it."""
    with own.client() as api:
        created = api.post("/sandboxes", json={"templateID": "bb", "timeout": 120}).json()
        headers = {
            "E2b-Sandbox-Id": created["sandboxID"],
            "E2b-Sandbox-Port": "49983",
            "X-Access-Token": created["envdAccessToken"],
            "Keepalive-Ping-Interval": "1",
            "Authorization": "Basic cm9vdDo=",  # root
        }
        body = {"process": {"cmd": "/bin/sh", "args": ["-c", "sleep 0.5; kill -STOP 1; sleep 600"]}}
        started = time.monotonic()
        r = api.post("/process.Process/Start", json=body, headers=headers, timeout=60)
        assert time.monotonic() - started < 2 * (1 + AGENT_TIMEOUT) + QUICK
        assert b"did not answer a ping" in r.content, r.content[-300:]
        assert api.delete(f"/sandboxes/{created['sandboxID']}").status_code == 204


# -- a node stopped or crashed with a wedged sandbox leaves nothing behind -----------------------------
def test_stopping_or_crashing_a_node_with_a_wedged_sandbox_leaves_nothing(
    own: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = use(own, monkeypatch)
    assert poll(lambda: runsc_traces(own)) == []  # earlier tests' sandboxes are torn down
    kept = Sandbox.create(template="bb", timeout=600)
    kept.files.write("/home/user/kept.txt", "kept")
    wedged = Sandbox.create(template="bb", timeout=600)
    wedge(wedged)
    instances = runsc_containers(own)
    assert len(instances) == 2
    started = time.monotonic()
    own.stop(signal.SIGTERM)
    assert own.proc.returncode == -signal.SIGTERM and time.monotonic() - started < 60  # not killed by the test
    assert node_traces(own, instances) == []

    own.restart()  # the graceful stop paused what it could and killed the wedged one
    api = use(own, monkeypatch)
    assert api.get(f"/sandboxes/{kept.sandbox_id}").json()["state"] == "paused"
    assert api.get(f"/sandboxes/{wedged.sandbox_id}").status_code == 404
    back = Sandbox.connect(kept.sandbox_id)
    assert back.files.read("/home/user/kept.txt") == "kept"

    # A crash in the middle of a pause of a wedged sandbox: the next start removes every trace.
    wedged = Sandbox.create(template="bb", timeout=600)
    wedge(wedged)
    instances = runsc_containers(own)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: api.post(f"/sandboxes/{wedged.sandbox_id}/pause", timeout=60))
        time.sleep(1)
        own.restart(signal.SIGKILL)
    api = use(own, monkeypatch)
    assert api.get(f"/sandboxes/{wedged.sandbox_id}").status_code == 404
    assert api.get(f"/sandboxes/{kept.sandbox_id}").status_code == 404  # it was running: reconciled away
    assert runsc_traces(own) == [] and _cgroups(instances) == []
    assert _processes(str(own.data_dir / "runtime")) == []
    own.stop()
    assert node_traces(own, instances) == []
    own.restart()


# -- runsc commands that hang (in-process node on the tiny template) ------------------------------------
HANGING_RUNSC = """#!/bin/sh
# runsc, except that while {flag} exists the subcommand it names waits (a runsc that hangs)
for arg in "$@"; do
  if [ -f {flag} ] && [ "$arg" = "$(cat {flag})" ]; then
    touch {flag}.hit
    while [ -f {flag} ]; do sleep 0.1; done
  fi
done
exec {real} "$@"
"""


@asynccontextmanager
async def hanging(driver: FaultyDriver, tmp: Path, subcommand: str) -> AsyncIterator[Callable[[], None]]:
    """Make ``runsc <subcommand>`` hang until the returned function is called (or the block ends)."""
    flag = tmp / "hang"
    wrapper = tmp / "runsc"
    real = shutil.which(driver.runsc) or driver.runsc  # the node's runsc (AENV_RUNSC), not PATH's
    wrapper.write_text(HANGING_RUNSC.format(flag=flag, real=real))
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR)
    flag.write_text(subcommand)
    real, driver.runsc = driver.runsc, str(wrapper)
    try:
        yield lambda: flag.unlink(missing_ok=True)
    finally:
        flag.unlink(missing_ok=True)
        driver.runsc = real


async def hit(tmp: Path) -> None:
    for _ in range(600):
        if (tmp / "hang.hit").exists():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("the operation never reached the hanging runsc")


async def assert_killed_quickly(node: Node, sandbox_id: str, op: asyncio.Task[Any]) -> None:
    started = time.monotonic()
    await asyncio.wait_for(node.kill(sandbox_id), QUICK)
    assert time.monotonic() - started < QUICK
    with pytest.raises(SandboxNotFound, match="was killed"):
        await asyncio.wait_for(op, QUICK)
    with pytest.raises(SandboxNotFound):
        node.get(sandbox_id)


async def assert_nothing_left(node: Node, driver: FaultyDriver) -> None:
    await node.settle()
    assert [sb.id for sb in node.sandboxes.values()] == []
    assert await driver.cleanup_orphans(keep=set()) == []  # no container, bundle, mount or cgroup


@pytest.mark.parametrize("where", ["create", "pause", "resume", "snapshot", "fork"])
async def test_kill_overtakes_an_operation_stuck_in_the_runtime(
    tiny: tuple[Node, FaultyDriver],  # noqa: F811
    tmp_path: Path,
    where: str,
) -> None:
    node, driver = tiny
    rec = None if where == "create" else await node.create("tiny")
    if where == "resume":
        assert rec is not None
        await node.pause(rec.id)
    # A snapshot restores nothing where runsc leaves the source running: its checkpoint hangs then.
    stuck_in_checkpoint = where == "pause" or (where == "snapshot" and driver.leaves_running)
    subcommand = "checkpoint" if stuck_in_checkpoint else "restore"
    async with hanging(driver, tmp_path, subcommand):
        if rec is None:
            op = asyncio.ensure_future(node.create("tiny"))
        else:
            op = asyncio.ensure_future(
                {
                    "pause": lambda: node.pause(rec.id),
                    "resume": lambda: node.resume(rec.id),
                    "snapshot": lambda: node.snapshot(rec.id),
                    "fork": lambda: node.fork(rec.id, count=2),
                }[where]()
            )
        await hit(tmp_path)
        sandbox_id = rec.id if rec is not None else next(iter(node.sandboxes))
        await assert_killed_quickly(node, sandbox_id, op)
    await assert_nothing_left(node, driver)


async def test_killing_a_fork_child_in_flight_fails_only_that_child(
    tiny: tuple[Node, FaultyDriver],  # noqa: F811
    tmp_path: Path,
) -> None:
    node, driver = tiny
    rec = await node.create("tiny")
    async with hanging(driver, tmp_path, "restore") as release:
        fork = asyncio.ensure_future(node.fork(rec.id, count=2))
        await hit(tmp_path)
        first, second = [sb.id for sb in node.sandboxes.values() if sb.rec.parent_id == rec.id]
        await asyncio.wait_for(node.kill(first), QUICK)
        release()
        results = await asyncio.wait_for(fork, 60)
    assert isinstance(results[0].error, SandboxNotFound) and results[0].sandbox is None
    assert results[1].sandbox is not None and results[1].sandbox.id == second
    assert node.get(rec.id).state.value == "running" and node.get(second).state.value == "running"
    for sandbox_id in (second, rec.id):
        await node.kill(sandbox_id)
    await assert_nothing_left(node, driver)


async def test_an_operation_past_its_deadline_is_cancelled_and_the_sandbox_goes_on(
    tiny: tuple[Node, FaultyDriver],  # noqa: F811
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, driver = tiny
    rec = await node.create("tiny")
    await start_counter(node, rec.id)
    monkeypatch.setattr(node.settings, "operation_timeout", 2.0)
    async with hanging(driver, tmp_path, "checkpoint"):
        with pytest.raises(OperationTimeout, match="did not finish within 2s"):
            await asyncio.wait_for(node.pause(rec.id), 30)
    assert node.get(rec.id).state.value == "running"  # thawed, not left frozen or pausing
    first = await count(node, rec.id)
    await asyncio.sleep(0.3)
    assert await count(node, rec.id) > first
    await node.kill(rec.id)
    await assert_nothing_left(node, driver)
