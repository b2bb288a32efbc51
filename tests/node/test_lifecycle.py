"""Sandbox lifecycle end to end on real runsc sandboxes, driven by the real `e2b` SDK and HTTP."""

from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from e2b import CommandExitException, InvalidArgumentException, Sandbox

from tests.conftest import Server

pytestmark = pytest.mark.sandbox

COUNTER = (
    "nohup bash -c 'i=0; while true; do i=$((i+1)); echo $i > /home/user/count; sleep 0.05; done' >/dev/null 2>&1 &"
)


def count(sbx: Sandbox) -> int:
    # Rarely (about 1 run in 10, only right after a fork) a child has read the count file empty
    # once; a read a moment later is correct. Under investigation (see the single-node issue's
    # note); retried here so the fork semantics below are what this test checks.
    for _ in range(3):
        text = sbx.commands.run("cat /home/user/count").stdout.strip()
        if text:
            return int(text)
        time.sleep(0.1)
    raise AssertionError("the count file stayed empty")


def fork(api: httpx.Client, sandbox_id: str, n: int, timeout: int | None = None) -> list[dict]:
    body: dict = {"count": n}
    if timeout is not None:
        body["timeout"] = timeout
    r = api.post(f"/sandboxes/{sandbox_id}/fork", json=body)
    assert r.status_code == 201, r.text
    return r.json()


def test_create_exec_files(sandbox: Sandbox) -> None:
    r = sandbox.commands.run("echo hello; id -un; pwd; echo $E2B_SANDBOX_ID")
    assert r.stdout.splitlines() == ["hello", "user", "/home/user", sandbox.sandbox_id]
    root = sandbox.commands.run("id -u", user="root")
    assert root.stdout.strip() == "0"
    with pytest.raises(CommandExitException) as exc:
        sandbox.commands.run("echo out; echo err >&2; exit 7")
    assert exc.value.exit_code == 7 and exc.value.stdout == "out\n" and exc.value.stderr == "err\n"
    sandbox.files.write("/home/user/a/b.txt", "content")
    assert sandbox.files.read("/home/user/a/b.txt") == "content"
    assert sandbox.commands.run("stat -c %U /home/user/a/b.txt").stdout.strip() == "user"
    assert sandbox.commands.run("ls /").exit_code == 0


def test_commands_start_with_clean_signals_and_their_own_session(sandbox: Sandbox) -> None:
    # The agent (Python) ignores SIGPIPE; a command must not inherit that, or `yes | head`
    # complains about a broken pipe instead of dying quietly as it does everywhere else.
    assert sandbox.commands.run("trap -p").stdout == ""  # bash lists signals ignored on entry
    piped = sandbox.commands.run("yes | head -n 1")
    assert (piped.stdout, piped.stderr) == ("y\n", "")
    ids = sandbox.commands.run("ps -o sid= -o pid= -p $$").stdout.split()
    assert ids[0] == ids[1]  # the command leads its own session (signals reach its children)
    # A cwd that exists but not for `user`: the start fails, as envd's exec fails it.
    with pytest.raises(InvalidArgumentException, match="chdir '/root': Permission denied"):
        sandbox.commands.run("pwd", cwd="/root")
    # Commands are C strings for the kernel: refused, not cut short or mangled.
    with pytest.raises(InvalidArgumentException, match="invalid environment variable name 'A=B'"):
        sandbox.commands.run("true", envs={"A=B": "1"})
    with pytest.raises(InvalidArgumentException, match="NUL"):
        sandbox.commands.run("echo a\0b")
    # The agent carries no OpenSSL in its memory (every checkpoint and fork child would).
    assert "ssl" not in sandbox.commands.run("cat /proc/1/maps", user="root").stdout


def test_streaming_output_arrives_live(sandbox: Sandbox) -> None:
    seen: list[tuple[float, str]] = []
    sandbox.commands.run(
        "for i in 1 2 3; do echo $i; sleep 0.3; done", on_stdout=lambda line: seen.append((time.monotonic(), line))
    )
    assert [line.strip() for _, line in seen] == ["1", "2", "3"]
    assert seen[-1][0] - seen[0][0] > 0.4  # delivered as produced, not at the end


def test_env_vars_and_metadata(e2b_env: Server) -> None:
    sbx = Sandbox.create(envs={"FOO": "bar"}, metadata={"suite": "lifecycle"})
    try:
        assert sbx.commands.run("echo $FOO").stdout == "bar\n"
        assert sbx.commands.run("echo $X", envs={"X": "y"}).stdout == "y\n"
        listed = Sandbox.list(query=None).next_items()
        assert any(s.sandbox_id == sbx.sandbox_id and s.metadata == {"suite": "lifecycle"} for s in listed)
    finally:
        sbx.kill()


def test_pause_resume_keeps_processes_memory_and_files(sandbox: Sandbox, api: httpx.Client) -> None:
    sandbox.files.write("/home/user/keep.txt", "kept")
    sandbox.commands.run("python3 -c 'import time; x=[1]*10**6; time.sleep(3600)' >/dev/null 2>&1 &")
    sandbox.commands.run(COUNTER)
    time.sleep(0.5)
    assert sandbox.pause() is True
    detail = api.get(f"/sandboxes/{sandbox.sandbox_id}").json()
    assert detail["state"] == "paused"
    assert api.post(f"/sandboxes/{sandbox.sandbox_id}/pause").status_code == 409
    time.sleep(1.0)  # a paused counter does not count
    resumed = Sandbox.connect(sandbox.sandbox_id)
    before = count(resumed)
    time.sleep(0.5)
    after = count(resumed)
    assert after > before
    assert before < 60  # ~0.5 s of counting before the pause, not 1.5 s
    assert resumed.files.read("/home/user/keep.txt") == "kept"
    procs = resumed.commands.run("pgrep -f 'x=\\[1\\]'").stdout.split()
    assert procs, "the background python process survived pause/resume"


def test_fork_children_continue_then_diverge(sandbox: Sandbox, api: httpx.Client) -> None:
    sandbox.files.write("/home/user/shared.txt", "before fork")
    sandbox.commands.run(COUNTER)
    time.sleep(0.3)
    items = fork(api, sandbox.sandbox_id, 3)
    assert len(items) == 3 and all("sandbox" in it for it in items), items
    children = [Sandbox.connect(it["sandbox"]["sandboxID"]) for it in items]
    try:
        at_fork = count(sandbox)
        counts = [count(c) for c in children]
        # every child continues from the fork point: its count is near the source's, not 0
        assert all(abs(c - at_fork) < 60 for c in counts), (at_fork, counts)
        for i, child in enumerate(children):
            assert child.files.read("/home/user/shared.txt") == "before fork"
            child.files.write("/home/user/mine.txt", f"child {i}")
            assert child.commands.run("echo $E2B_SANDBOX_ID").stdout.strip() == child.sandbox_id
        for i, child in enumerate(children):
            assert child.files.read("/home/user/mine.txt") == f"child {i}"
        assert not sandbox.files.exists("/home/user/mine.txt")
        # memory diverges: each child's counter runs on its own
        time.sleep(0.3)
        assert all(count(c) > at_fork for c in children)
        # the source keeps its id and keeps running
        assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "running"
        assert api.get(f"/sandboxes/{children[0].sandbox_id}").json()["parentID"] == sandbox.sandbox_id
    finally:
        for c in children:
            c.kill()


def test_fork_limits_and_bad_input(sandbox: Sandbox, api: httpx.Client) -> None:
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/fork", json={"count": 17})
    assert r.status_code == 400 and "at most 16" in r.json()["message"]
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/fork", json={"count": 0})
    assert r.status_code == 400
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/fork", content=b"{not json")
    assert r.status_code == 400 and r.json()["code"] == 400
    assert api.post("/sandboxes/nosuchsandbox/fork", json={"count": 1}).status_code == 404


def test_snapshot_then_create_from_it(sandbox: Sandbox, api: httpx.Client) -> None:
    sandbox.files.write("/home/user/state.txt", "snapshotted")
    sandbox.commands.run(COUNTER)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/snapshots", json={"name": f"snap-{sandbox.sandbox_id}"})
    assert r.status_code == 201, r.text
    snap = r.json()
    assert snap["snapshotID"] and snap["names"] == [f"snap-{sandbox.sandbox_id}"]
    sandbox.files.write("/home/user/state.txt", "changed after")
    assert sandbox.commands.run("echo still running").stdout == "still running\n"
    copy = Sandbox.create(template=snap["snapshotID"])
    try:
        assert copy.files.read("/home/user/state.txt") == "snapshotted"
        c1 = count(copy)
        time.sleep(0.3)
        assert count(copy) > c1  # the counter process came back running
    finally:
        copy.kill()
    assert any(s["snapshotID"] == snap["snapshotID"] for s in api.get("/snapshots").json())
    assert api.delete(f"/snapshots/{snap['snapshotID']}").status_code == 204
    assert api.delete(f"/snapshots/{snap['snapshotID']}").status_code == 404


def test_ttl_auto_pause_and_auto_kill(e2b_env: Server, api: httpx.Client) -> None:
    killed = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 2}).json()["sandboxID"]
    paused = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 2, "autoPause": True}).json()["sandboxID"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        k = api.get(f"/sandboxes/{killed}").status_code
        p = api.get(f"/sandboxes/{paused}").json().get("state")
        if k == 404 and p == "paused":
            break
        time.sleep(0.5)
    assert api.get(f"/sandboxes/{killed}").status_code == 404
    assert api.get(f"/sandboxes/{paused}").json()["state"] == "paused"
    time.sleep(3)  # paused sandboxes do not expire
    assert api.get(f"/sandboxes/{paused}").json()["state"] == "paused"
    sbx = Sandbox.connect(paused, timeout=60)
    assert sbx.commands.run("echo back").stdout == "back\n"
    assert api.post(f"/sandboxes/{paused}/timeout", json={"timeout": 120}).status_code == 204
    sbx.kill()


def test_concurrent_pauses_join(sandbox: Sandbox, server: Server) -> None:
    def pause() -> int:
        with server.client() as c:
            return c.post(f"/sandboxes/{sandbox.sandbox_id}/pause").status_code

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(lambda _: pause(), range(4)))
    # all four joined the same pause, or came after it and found the sandbox paused
    assert codes.count(204) >= 1 and set(codes) <= {204, 409}, codes
    with server.client() as c:
        assert c.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"
    assert Sandbox.connect(sandbox.sandbox_id).commands.run("echo ok").stdout == "ok\n"


def test_concurrent_mixed_operations_never_corrupt(sandbox: Sandbox, server: Server) -> None:
    ops = ["pause", "connect", "snapshots", "pause", "connect", "fork"]

    def run(op: str) -> int:
        with server.client() as c:
            if op == "connect":
                return c.post(f"/v2/sandboxes/{sandbox.sandbox_id}/connect", json={}).status_code
            if op == "fork":
                r = c.post(f"/sandboxes/{sandbox.sandbox_id}/fork", json={"count": 1})
                if r.status_code == 201:
                    for it in r.json():
                        if "sandbox" in it:
                            c.delete(f"/sandboxes/{it['sandbox']['sandboxID']}")
                return r.status_code
            return c.post(f"/sandboxes/{sandbox.sandbox_id}/{op}", json={}).status_code

    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        codes = list(pool.map(run, ops))
    assert all(code in (200, 201, 204, 409) for code in codes), codes
    sbx = Sandbox.connect(sandbox.sandbox_id)
    assert sbx.commands.run("echo consistent").stdout == "consistent\n"


def test_kill_then_everything_is_404(e2b_env: Server, api: httpx.Client) -> None:
    sbx = Sandbox.create()
    sid = sbx.sandbox_id
    assert sbx.kill() is True
    assert api.get(f"/sandboxes/{sid}").status_code == 404
    assert api.delete(f"/sandboxes/{sid}").status_code == 404
    assert api.post(f"/sandboxes/{sid}/pause").status_code == 404
    assert sbx.is_running() is False


def test_bad_input_is_a_clear_4xx(api: httpx.Client) -> None:
    cases = [
        ("post", "/v2/sandboxes", {"templateID": "no-such-template"}, 404),
        ("post", "/v2/sandboxes", {"templateID": "base", "timeout": -5}, 400),
        ("post", "/v2/sandboxes", {"templateID": "base", "timeout": "soon"}, 400),
        ("post", "/v2/sandboxes", {"templateID": "base", "timeout": 10**9}, 400),
        ("post", "/v2/sandboxes", {"templateID": "base", "limits": {"memoryMB": 1}}, 400),
        ("get", "/sandboxes/doesnotexist", None, 404),
        ("post", "/sandboxes/doesnotexist/pause", None, 404),
        ("post", "/v2/sandboxes/doesnotexist/connect", {}, 404),
        ("post", "/sandboxes/doesnotexist/timeout", {"timeout": 5}, 404),
        ("get", "/v2/sandboxes?state=sleeping", None, 400),
        ("get", "/no/such/route", None, 404),
    ]
    for method, path, body, status in cases:
        r = api.request(method, path, json=body)
        assert r.status_code == status, (path, body, r.status_code, r.text)
        err = r.json()
        assert isinstance(err["code"], int) and err["message"], err
    r = httpx.get(str(api.base_url) + "/v2/sandboxes")
    assert r.status_code == 401 and r.json()["code"] == 401


WRITER = (
    "import os\n"
    "os.makedirs('/home/user/w', exist_ok=True)\n"
    "k = 0\n"
    "while True:\n"
    "    k += 1\n"
    "    with open(f'/home/user/w/{k}', 'w') as f:\n"
    "        f.write(str(k) * 100)\n"
)
# The newest file may be empty: the writer was killed (by the check) between open() and write().
CHECK = (
    "import os\n"
    "names = sorted(os.listdir('/home/user/w'), key=int)[:-1]\n"
    "bad = [n for n in names if open(f'/home/user/w/{n}').read() != n * 100]\n"
    "print(len(names), 'files', len(bad), 'bad', bad[:5])\n"
)


@pytest.mark.parametrize("operation", ["pause", "fork"])
def test_writes_just_before_a_checkpoint_survive(sandbox: Sandbox, api: httpx.Client, operation: str) -> None:
    """A process writing files while the sandbox is checkpointed loses nothing it wrote."""
    sandbox.files.write("/home/user/writer.py", WRITER)
    sandbox.files.write("/home/user/check.py", CHECK)
    sandbox.commands.run("nohup python3 /home/user/writer.py >/dev/null 2>&1 &")
    time.sleep(0.5)
    if operation == "pause":
        assert sandbox.pause()
        targets = [Sandbox.connect(sandbox.sandbox_id)]
    else:
        targets = [Sandbox.connect(it["sandbox"]["sandboxID"]) for it in fork(api, sandbox.sandbox_id, 2)]
    for target in targets:
        target.commands.run("pkill -f '[w]riter.py'; sleep 0.2", user="root")
        out = target.commands.run("python3 /home/user/check.py").stdout
        assert " 0 bad" in out, out
    if operation == "fork":
        for target in targets:
            target.kill()
