"""The official Python `e2b` SDK (sync face), unchanged, against aenv."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import (
    CommandExitException,
    FileNotFoundException,
    NotFoundException,
    PtySize,
    Sandbox,
    SandboxException,
    SandboxQuery,
    SandboxState,
    TimeoutException,
)
from e2b.sandbox.filesystem.watch_handle import FilesystemEventType
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from tests.compat.conftest import Deployment
from tests.compat.servers import HTTP_SERVER, WEBSOCKET_SERVER

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture()
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300)
    yield sandbox
    sandbox.kill()


def routed(sandbox: Sandbox, port: int) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": str(port)}


def start_server(sandbox: Sandbox, deployment: Deployment, script: str, port: int) -> None:
    sandbox.files.write(f"/home/user/server-{port}.py", script)
    sandbox.commands.run(f"python3 /home/user/server-{port}.py {port}", background=True)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if httpx.get(f"{deployment.url}/probe", headers=routed(sandbox, port)).status_code != 502:
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing listens on {port} inside the sandbox")


@pytest.mark.root  # commands as root
def test_commands_stream_and_report_exit_codes(sbx: Sandbox) -> None:
    seen: list[tuple[str, float]] = []
    result = sbx.commands.run(
        "for i in 1 2 3; do echo out$i; echo err$i >&2; sleep 0.3; done",
        on_stdout=lambda line: seen.append((line, time.monotonic())),
        on_stderr=lambda line: seen.append((line, time.monotonic())),
    )
    done = time.monotonic()
    assert result.exit_code == 0
    assert result.stdout == "out1\nout2\nout3\n" and result.stderr == "err1\nerr2\nerr3\n"
    assert seen[0][0].startswith(("out1", "err1")) and done - seen[0][1] > 0.4  # streamed, not at the end
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("echo nope >&2; exit 7")
    assert info.value.exit_code == 7 and "nope" in info.value.stderr
    # the documented defaults: bash -l, user `user`, home directory, sandbox-wide env
    who = sbx.commands.run('echo "$(whoami) $PWD $E2B_SANDBOX $0"').stdout.split()
    assert who[:3] == ["user", "/home/user", "true"]
    assert sbx.commands.run("whoami", user="root").stdout.strip() == "root"
    assert sbx.commands.run("echo $X", envs={"X": "42"}, cwd="/tmp").stdout == "42\n"


def test_background_process_stdin_connect_list_and_kill(sbx: Sandbox) -> None:
    reader = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(reader.pid, "hello\n")
    assert reader.pid in [p.pid for p in sbx.commands.list()]
    again = sbx.commands.connect(reader.pid)
    sbx.commands.send_stdin(reader.pid, "again\n")
    sbx.commands.close_stdin(reader.pid)
    result = again.wait()  # cat ends at end of input
    assert result.exit_code == 0 and "again" in result.stdout
    assert reader.wait().stdout == "hello\nagain\n"
    # a client that goes away does not take the command with it
    counter = sbx.commands.run("for i in $(seq 30); do echo $i; sleep 0.1; done", background=True)
    counter.disconnect()
    assert counter.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.connect(counter.pid).wait().exit_code == 0
    sleeper = sbx.commands.run("sleep 600", background=True)
    assert sbx.commands.kill(sleeper.pid) is True
    with pytest.raises(CommandExitException):
        sleeper.wait()
    assert sleeper.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(sleeper.pid) is False


def test_pty_session(sbx: Sandbox) -> None:
    out = bytearray()
    term = sbx.pty.create(PtySize(rows=24, cols=80))
    outcome: list[BaseException] = []

    def collect() -> None:
        try:
            term.wait(on_pty=lambda data: out.extend(data))
        except BaseException as exc:
            outcome.append(exc)

    reader = threading.Thread(target=collect)
    reader.start()

    def until(text: str) -> None:
        deadline = time.monotonic() + 15
        while text.encode() not in out and time.monotonic() < deadline:
            time.sleep(0.05)
        assert text.encode() in out, out.decode(errors="replace")

    until("$ ")  # bash flushes what was typed before its prompt, as on any terminal
    sbx.pty.send_stdin(term.pid, b"stty size; echo marker-$((6*7))\n")
    until("marker-42")
    sbx.pty.resize(term.pid, PtySize(rows=40, cols=100))
    sbx.pty.send_stdin(term.pid, b"stty size; exit 3\n")
    reader.join(15)
    assert "24 80" in out.decode() and "40 100" in out.decode()
    assert isinstance(outcome[0], CommandExitException) and outcome[0].exit_code == 3


def test_files_of_several_megabytes_and_the_filesystem_api(sbx: Sandbox) -> None:
    blob = os.urandom(6 * 1024 * 1024 + 17)
    sbx.files.write("/home/user/data/blob.bin", blob)
    assert bytes(sbx.files.read("/home/user/data/blob.bin", format="bytes")) == blob
    digest = sbx.commands.run("sha256sum /home/user/data/blob.bin").stdout.split()[0]
    assert digest == hashlib.sha256(blob).hexdigest()
    info = sbx.files.get_info("/home/user/data/blob.bin")
    assert info.size == len(blob) and info.owner == "user"
    sbx.files.make_dir("/home/user/data/sub/deeper")
    sbx.files.write("/home/user/data/sub/a.txt", "a")
    names = {e.path for e in sbx.files.list("/home/user/data", depth=2)}
    assert {"/home/user/data/blob.bin", "/home/user/data/sub", "/home/user/data/sub/a.txt"} <= names
    sbx.files.rename("/home/user/data/sub/a.txt", "/home/user/data/b.txt")
    assert sbx.files.read("/home/user/data/b.txt") == "a"
    sbx.files.remove("/home/user/data/sub")
    assert not sbx.files.exists("/home/user/data/sub")
    with pytest.raises(FileNotFoundException):
        sbx.files.read("/home/user/no-such-file")


def test_watch_dir_reports_changes(sbx: Sandbox) -> None:
    sbx.files.make_dir("/home/user/watched")
    watch = sbx.files.watch_dir("/home/user/watched")
    sbx.files.write("/home/user/watched/new.txt", "x")
    sbx.commands.run("echo more >> /home/user/watched/new.txt; rm /home/user/watched/new.txt")
    events = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and FilesystemEventType.REMOVE not in {e.type for e in events}:
        events += watch.get_new_events()
        time.sleep(0.1)
    watch.stop()
    kinds = {e.type for e in events if e.name == "new.txt"}
    assert {FilesystemEventType.CREATE, FilesystemEventType.WRITE, FilesystemEventType.REMOVE} <= kinds


def test_list_with_filters_and_pagination() -> None:
    run = uuid.uuid4().hex[:8]
    boxes = [Sandbox.create(timeout=300, metadata={"suite": run, "n": str(i)}) for i in range(3)]
    try:
        assert boxes[0].pause() is True
        query = SandboxQuery(metadata={"suite": run})
        pager = Sandbox.list(query=query, limit=2)
        found = pager.next_items()
        assert len(found) == 2 and pager.has_next
        found += pager.next_items()
        assert not pager.has_next
        assert sorted(s.sandbox_id for s in found) == sorted(b.sandbox_id for b in boxes)
        running = Sandbox.list(query=SandboxQuery(metadata={"suite": run}, state=[SandboxState.RUNNING])).next_items()
        assert {s.sandbox_id for s in running} == {boxes[1].sandbox_id, boxes[2].sandbox_id}
        paused = Sandbox.list(query=SandboxQuery(metadata={"suite": run, "n": "0"}, state=[SandboxState.PAUSED]))
        assert [s.sandbox_id for s in paused.next_items()] == [boxes[0].sandbox_id]
    finally:
        for box in boxes:
            Sandbox.kill(box.sandbox_id)


def test_timeouts(sbx: Sandbox) -> None:
    with pytest.raises(TimeoutException):
        sbx.commands.run("sleep 30", timeout=1)
    before = sbx.get_info().end_at
    sbx.set_timeout(600)
    assert (sbx.get_info().end_at - before).total_seconds() > 250
    short = Sandbox.create(timeout=2)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and short.is_running():
        time.sleep(0.5)
    with pytest.raises(NotFoundException):  # expired without autoPause: gone
        Sandbox.connect(short.sandbox_id)


@pytest.mark.runsc  # a background command keeps running through pause
def test_pause_connect_and_kill(sbx: Sandbox) -> None:
    sbx.commands.run("n=0; while true; do n=$((n+1)); echo $n > /tmp/count; sleep 0.1; done", background=True)
    time.sleep(0.5)
    assert sbx.pause() is True
    assert sbx.get_info().state == SandboxState.PAUSED
    assert sbx.pause() is False  # already paused: 409, which the SDK reports as False
    frozen = int(Sandbox.connect(sbx.sandbox_id).files.read("/tmp/count").strip() or 0)
    again = Sandbox.connect(sbx.sandbox_id)
    assert again.get_info().state == SandboxState.RUNNING
    time.sleep(0.5)
    assert int(again.files.read("/tmp/count").strip() or 0) > frozen >= 1  # the counter kept counting
    assert Sandbox.kill(sbx.sandbox_id) is True
    assert Sandbox.kill(sbx.sandbox_id) is False
    with pytest.raises(NotFoundException):
        Sandbox.connect(sbx.sandbox_id)


def test_get_host_http_streaming_and_bodies(sbx: Sandbox, deployment: Deployment) -> None:
    start_server(sbx, deployment, HTTP_SERVER, 8000)
    host = sbx.get_host(8000)
    assert host.startswith(f"8000-{sbx.sandbox_id}.")
    by_host = {"Host": host.split(".")[0] + ".aenv.test"}
    r = httpx.get(f"{deployment.url}/hello?q=1", headers=by_host)
    assert r.status_code == 200 and r.json()["path"] == "/hello?q=1"
    assert r.headers.get_list("set-cookie") == ["a=1", "b=2"]
    # a request body streamed in (not buffered whole by the proxy) arrives intact
    blob = os.urandom(8 * 1024 * 1024)
    chunks = (blob[i : i + 65536] for i in range(0, len(blob), 65536))
    r = httpx.post(
        f"{deployment.url}/upload", content=chunks, headers={**routed(sbx, 8000), "Content-Length": str(len(blob))}
    )
    assert r.json()["sha256"] == hashlib.sha256(blob).hexdigest()
    # a streaming response arrives chunk by chunk
    arrivals = []
    with httpx.stream("GET", f"{deployment.url}/stream", headers=routed(sbx, 8000)) as stream:
        for line in stream.iter_lines():
            if line:
                arrivals.append(time.monotonic())
    assert len(arrivals) == 5 and arrivals[-1] - arrivals[0] > 0.6


def test_get_host_websocket(sbx: Sandbox, deployment: Deployment) -> None:
    start_server(sbx, deployment, WEBSOCKET_SERVER, 8765)
    url = deployment.url.replace("http", "ws", 1) + "/ws?x=1"
    with ws_connect(url, additional_headers=routed(sbx, 8765), subprotocols=["chat"]) as ws:
        assert ws.subprotocol == "chat"
        ws.send("hello")
        assert ws.recv() == "hello"
        blob = os.urandom(300_000)
        ws.send(blob)
        assert ws.recv() == blob
        ws.send(["frag", "mented"])  # a fragmented message is reassembled
        assert ws.recv() == "fragmented"
        ws.send("headers")
        assert "e2b-sandbox-id" not in ws.recv()  # routing headers stay at the proxy
        ws.send("close")
        with pytest.raises(ConnectionClosed):
            ws.recv()
        assert ws.close_code == 4001
    # routing by host name: the URL names the sandbox, the socket goes to the deployment
    proxy = httpx.URL(deployment.url)
    sock = socket.create_connection((proxy.host, proxy.port or 80))
    with ws_connect(f"ws://8765-{sbx.sandbox_id}.aenv.test/ws", sock=sock) as ws:
        ws.send(b"\x00\x01")
        assert ws.recv() == b"\x00\x01"
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
    upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
    refused = httpx.get(f"{deployment.url}/ws", headers={**upgrade, **routed(sbx, 9)})
    assert refused.status_code == 502 and "port is not open" in refused.json()["message"]
    refused = httpx.get(f"{deployment.url}/ws", headers={**upgrade, **routed(sbx, 8000)})  # nothing there
    assert refused.status_code == 502


def test_secure_sandbox_requires_its_token(deployment: Deployment) -> None:
    sandbox = Sandbox.create(timeout=120, secure=True)
    try:
        sandbox.files.write("/home/user/secret.txt", "s3cret")
        envd = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
        rpc = f"{deployment.url}/filesystem.Filesystem/Stat"
        body = {"path": "/home/user/secret.txt"}
        assert httpx.post(rpc, json=body, headers=envd).status_code == 401
        bad = httpx.post(rpc, json=body, headers={**envd, "X-Access-Token": "wrong"})
        assert bad.status_code == 401 and bad.json()["code"] == "unauthenticated"
        other = Sandbox.create(timeout=60, secure=True)  # another sandbox's token is wrong here too
        try:
            token = other._envd_access_token
            assert httpx.post(rpc, json=body, headers={**envd, "X-Access-Token": token}).status_code == 401
        finally:
            other.kill()
        url = sandbox.download_url("/home/user/secret.txt")
        assert httpx.get(url).text == "s3cret"
        assert httpx.get(url.replace("signature=", "signature=x")).status_code in (401, 403)
    finally:
        sandbox.kill()


def test_errors_are_the_sdk_exceptions(sbx: Sandbox) -> None:
    with pytest.raises(NotFoundException):
        Sandbox.connect("nosuchsandbox0000000")
    with pytest.raises(SandboxException, match="no-such-template"):
        Sandbox.create(template="no-such-template")
    assert Sandbox.kill("nosuchsandbox0000000") is False
    with pytest.raises(CommandExitException) as info:
        sbx.commands.run("/no/such/binary")
    assert info.value.exit_code == 127


@pytest.mark.runsc  # its server keeps running through pause
def test_paused_sandbox_wakes_on_traffic_only_with_auto_resume(deployment: Deployment) -> None:
    sleepy = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause", "auto_resume": True})
    plain = Sandbox.create(timeout=300)
    try:
        for sandbox in (sleepy, plain):
            start_server(sandbox, deployment, HTTP_SERVER, 8000)
            assert sandbox.pause() is True
        r = httpx.get(f"{deployment.url}/woken", headers=routed(sleepy, 8000), timeout=60)
        assert r.status_code == 200 and r.json()["path"] == "/woken"
        assert sleepy.get_info().state == SandboxState.RUNNING
        r = httpx.get(f"{deployment.url}/asleep", headers=routed(plain, 8000))
        assert r.status_code == 502 and r.json()["message"] == "The sandbox was not found"
        assert plain.get_info().state == SandboxState.PAUSED
    finally:
        sleepy.kill()
        plain.kill()


def test_snapshots_through_the_sdk(sbx: Sandbox) -> None:
    sbx.files.write("/home/user/snap.txt", "in the snapshot")
    snap = sbx.create_snapshot()
    assert snap.snapshot_id in [s.snapshot_id for s in sbx.list_snapshots().next_items()]
    child = Sandbox.create(template=snap.snapshot_id, timeout=60)
    try:
        assert child.files.read("/home/user/snap.txt") == "in the snapshot"
    finally:
        child.kill()
    assert Sandbox.delete_snapshot(snap.snapshot_id) is True
    assert Sandbox.delete_snapshot(snap.snapshot_id) is False
