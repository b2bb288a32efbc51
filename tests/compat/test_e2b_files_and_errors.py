"""What E2B's own SDK test suite found aenv answering differently from envd and E2B's API, checked
with the official `e2b` SDK: entries' modes and symlinks, file metadata, E2B's error wording, idle
keep-alive connections and the `base` template's `python`."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import httpx
import pytest
from e2b import (
    AsyncSandbox,
    AuthenticationException,
    BuildException,
    FileType,
    Sandbox,
    Template,
    TimeoutException,
)

from aenv.templates import builder
from tests.compat.conftest import Deployment

pytestmark = pytest.mark.sandbox

HOME = "/home/user"


@pytest.fixture()
def sbx() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300)
    yield sandbox
    sandbox.kill()


# -- entries: envd's mode, type and symlink target ------------------------------------------------
def test_modes_are_the_permission_bits_only(sbx: Sandbox) -> None:
    assert sbx.files.make_dir(f"{HOME}/d") is True
    sbx.files.write(f"{HOME}/d/f.txt", "x")
    sbx.commands.run(f"mkdir -m 1777 {HOME}/sticky && touch {HOME}/suid && chmod 4755 {HOME}/suid && mkfifo {HOME}/p")
    directory, file = sbx.files.get_info(f"{HOME}/d"), sbx.files.get_info(f"{HOME}/d/f.txt")
    assert (directory.type, directory.mode, directory.permissions) == (FileType.DIR, 0o755, "drwxr-xr-x")
    assert (file.type, file.mode, file.permissions) == (FileType.FILE, 0o644, "-rw-r--r--")
    sticky, suid, fifo = (sbx.files.get_info(f"{HOME}/{n}") for n in ("sticky", "suid", "p"))
    assert (sticky.mode, sticky.permissions) == (0o777, "dtrwxrwxrwx")
    assert (suid.mode, suid.permissions) == (0o755, "urwxr-xr-x")
    assert (fifo.type, fifo.mode, fifo.permissions) == (None, 0o644, "prw-r--r--")  # envd: type unspecified
    listed = {e.name: e for e in sbx.files.list(HOME)}
    assert (listed["d"].mode, listed["sticky"].mode, listed["suid"].mode) == (0o755, 0o777, 0o755)
    assert sbx.files.get_info("/tmp").mode == 0o777


def test_symlinks_report_what_they_lead_to(sbx: Sandbox) -> None:
    sbx.files.write(f"{HOME}/t/file.txt", "hello")
    sbx.commands.run(
        "cd ~/t && mkdir -m 700 dir && ln -s file.txt to-file && ln -s dir to-dir && ln -s to-file chain"
        " && ln -s missing broken && ln -s loop loop && ln -s ../t/./dir/.. up && chmod 600 file.txt"
    )
    infos = {n: sbx.files.get_info(f"{HOME}/t/{n}") for n in ("to-file", "to-dir", "chain", "broken", "loop", "up")}
    listed = {e.name: e for e in sbx.files.list(f"{HOME}/t")}
    assert "broken" not in listed and "loop" not in listed  # no type: the SDK leaves them out of lists
    for name, info in infos.items():
        assert info.path == f"{HOME}/t/{name}" and info.name == name
        assert info.permissions == "Lrwxrwxrwx", name  # the link's own, as Go's FileMode.String()
        if info.type is not None:
            same = listed[name]
            assert (same.type, same.mode, same.symlink_target, same.path) == (
                info.type,
                info.mode,
                info.symlink_target,
                info.path,
            ), name
    assert (infos["to-file"].type, infos["to-file"].mode) == (FileType.FILE, 0o600)
    assert infos["to-file"].symlink_target == infos["chain"].symlink_target == f"{HOME}/t/file.txt"
    assert infos["to-file"].size == len("file.txt")  # lstat's size, as envd
    assert (infos["to-dir"].type, infos["to-dir"].mode, infos["to-dir"].symlink_target) == (
        FileType.DIR,
        0o700,
        f"{HOME}/t/dir",
    )
    assert (infos["up"].type, infos["up"].symlink_target) == (FileType.DIR, f"{HOME}/t")
    for name in ("broken", "loop"):  # envd: no type, mode 0, the link's own path as target
        assert (infos[name].type, infos[name].mode, infos[name].symlink_target) == (None, 0, f"{HOME}/t/{name}")
    assert sbx.files.get_info(f"{HOME}/t/file.txt").symlink_target is None
    # reading through a link still reads the target; listing through a link to a directory lists it
    assert sbx.files.read(f"{HOME}/t/chain") == "hello"
    sbx.files.write(f"{HOME}/t/dir/inner", "i")
    assert [e.path for e in sbx.files.list(f"{HOME}/t/to-dir")] == [f"{HOME}/t/to-dir/inner"]


# -- E2B's words for its errors -------------------------------------------------------------------
def _refusal(url: str, method: str = "GET", **kwargs: object) -> tuple[int, object]:
    response = httpx.request(method, url, timeout=30, **kwargs)  # type: ignore[arg-type]
    return response.status_code, response.json() if response.status_code != 200 else response.text


@pytest.mark.parametrize("routed", [False, True], ids=["signature-names-the-sandbox", "sandbox-header"])
def test_signed_urls_are_refused_in_envds_words(sbx: Sandbox, routed: bool) -> None:
    sbx.files.write(f"{HOME}/signed.txt", "signed")
    headers = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"} if routed else {}
    expired = {"code": 401, "message": "signature is already expired"}
    assert _refusal(sbx.download_url("signed.txt", "user", 120), headers=headers) == (200, "signed")
    assert _refusal(sbx.download_url("signed.txt", "user", use_signature_expiration=-120), headers=headers) == (
        401,
        expired,
    )
    upload = sbx.upload_url("up.txt", "user", use_signature_expiration=-5)
    assert _refusal(upload, "POST", files={"file": ("up.txt", b"x")}, headers=headers) == (401, expired)
    assert not sbx.files.exists("up.txt")
    good = sbx.download_url("signed.txt", "user", 120)
    tampered = good.replace("signature=v1_", "signature=v1_A")
    invalid = {"code": 401, "message": "invalid signature"}
    if routed:  # without a sandbox in the URL, a signature no sandbox made names none: the API refuses it
        assert _refusal(tampered, headers=headers) == (401, invalid)
        unsigned = good.split("&signature=")[0]
        missing = {"code": 401, "message": "missing signature query parameter"}
        assert _refusal(unsigned, headers=headers) == (401, missing)
    # a signature for reading does not write, and one for another path does not read this one
    assert _refusal(good, "POST", files={"file": ("signed.txt", b"y")}, headers=headers)[0] == 401
    other = sbx.download_url("other.txt", "user", 120).replace("other.txt", "signed.txt")
    assert _refusal(other, headers=headers)[0] == 401
    assert sbx.files.read("signed.txt") == "signed"


# -- connections ------------------------------------------------------------------------------------
def _exchange(sock: socket.socket, host: str) -> bytes:
    """One GET /health on an open connection: the response's status line, or b"" if it was closed."""
    sock.sendall(f"GET /health HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    reader = sock.makefile("rb")
    status = reader.readline()
    length = 0
    while (line := reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    reader.read(length)
    return status


def test_idle_keepalive_connections_outlive_the_sdks_pools(deployment: Deployment) -> None:
    """The SDK's pools reuse a connection idle for up to 300 s: the server must not close it first."""
    url = httpx.URL(deployment.url)
    with socket.create_connection((url.host, url.port or 80), timeout=30) as sock:
        assert _exchange(sock, url.netloc.decode()).startswith(b"HTTP/1.1 200")
        for gap in (6, 10):
            time.sleep(gap)
            assert _exchange(sock, url.netloc.decode()).startswith(b"HTTP/1.1 200"), f"closed after {gap} s idle"


def test_calls_after_an_idle_gap_on_one_client(sbx: Sandbox) -> None:
    for gap in (5.0, 7.0):  # about uvicorn's default 5 s, when a reused connection could be closing
        time.sleep(gap)
        assert sbx.commands.run("echo ok").stdout == "ok\n"
        assert sbx.files.exists(HOME)


# -- a sandbox killed while a command streams ---------------------------------------------------------
KILLED = "sandbox was killed or reached its end of life"  # what the SDKs say once /health confirms it


def _raw_stream_of_a_running_command(deployment: Deployment, sandbox: Sandbox) -> tuple[str, bytes]:
    """Start a chatty command over envd's Connect protocol, kill the sandbox while it streams and
    read on: (how the answer ended: "reset", "cut" or "ended", the bytes that came)."""
    headers = {
        "E2b-Sandbox-Id": sandbox.sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": sandbox._envd_access_token or "",
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }
    request = json.dumps({"process": {"cmd": "/bin/sh", "args": ["-c", "while true; do echo tick; sleep 0.1; done"]}})
    body = struct.pack(">BI", 0, len(request)) + request.encode()
    received = b""
    with httpx.stream(
        "POST", f"{deployment.url}/process.Process/Start", headers=headers, content=body, timeout=60
    ) as response:
        assert response.status_code == 200
        chunks = response.iter_raw()
        try:
            while b"tick" not in base64_decoded(received):
                received += next(chunks)
            Sandbox.kill(sandbox.sandbox_id)
            for chunk in chunks:
                received += chunk
        except httpx.ReadError:
            return "reset", received
        except httpx.RemoteProtocolError:
            return "cut", received
    return "ended", received


def base64_decoded(raw: bytes) -> bytes:
    """The stdout bytes of the Connect envelopes in ``raw`` (each event's data is base64)."""
    out, offset = b"", 0
    while offset + 5 <= len(raw):
        (length,) = struct.unpack(">I", raw[offset + 1 : offset + 5])
        payload = raw[offset + 5 : offset + 5 + length]
        if len(payload) < length:
            break
        stdout = json.loads(payload).get("event", {}).get("data", {}).get("stdout")
        out += base64.b64decode(stdout) if stdout else b""
        offset += 5 + length
    return out


def _end_of_stream_in(raw: bytes) -> bool:
    offset = 0
    while offset + 5 <= len(raw):
        flags, length = struct.unpack(">BI", raw[offset : offset + 5])
        if flags & 0x02:
            return True
        offset += 5 + length
    return False


def test_a_killed_sandbox_drops_its_streams(deployment: Deployment) -> None:
    """E2B's edge resets the stream of a sandbox that is gone: no end-of-stream message ends it, and
    the SDKs (e2b 2.45 needs a read error, not a body cut short) then ask /health and say it was killed."""
    sandbox = Sandbox.create(timeout=120)
    ending, received = _raw_stream_of_a_running_command(deployment, sandbox)
    assert ending == "reset" and not _end_of_stream_in(received), (ending, received[-300:])
    health = httpx.get(
        f"{deployment.url}/health", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "49983"}
    )
    assert health.status_code == 502 and "was not found" in health.json()["message"]


def test_the_sync_sdk_says_a_sandbox_killed_mid_command_was_killed() -> None:
    sandbox = Sandbox.create(timeout=120)
    background = sandbox.commands.run("sleep 60", background=True)
    sandbox.kill()
    with pytest.raises(TimeoutException, match=KILLED):
        background.wait()
    sandbox = Sandbox.create(timeout=120)
    lines: list[str] = []
    killer = threading.Timer(1.5, sandbox.kill)
    killer.start()
    try:
        with pytest.raises(TimeoutException, match=KILLED):
            sandbox.commands.run("while true; do echo tick; sleep 0.1; done", on_stdout=lines.append, timeout=60)
    finally:
        killer.join()
    assert lines  # it was streaming when the sandbox went


async def test_the_async_sdk_says_a_sandbox_killed_mid_command_was_killed() -> None:
    sandbox = await AsyncSandbox.create(timeout=120)
    background = await sandbox.commands.run("sleep 60", background=True)
    await sandbox.kill()
    with pytest.raises(TimeoutException, match=KILLED):
        await background.wait()
    sandbox = await AsyncSandbox.create(timeout=120)
    streaming = asyncio.Event()
    running = asyncio.ensure_future(
        sandbox.commands.run("while true; do echo tick; sleep 0.1; done", on_stdout=lambda _: streaming.set())
    )
    await asyncio.wait_for(streaming.wait(), 60)
    await sandbox.kill()
    with pytest.raises(TimeoutException, match=KILLED):
        await running


# -- template steps and users, as E2B's builder and envd word them ------------------------------------
@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        (
            lambda t: t.run_cmd("whoami", user="root123"),
            "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'",
        ),
        (
            lambda t: t.set_user("nobody2").run_cmd("id -u"),
            "failed to run command 'id -u': command failed: unauthenticated: invalid username: 'nobody2'",
        ),
        (lambda t: t.run_cmd("exit 9"), "failed to run command 'exit 9': exit status 9"),
    ],
    ids=["run-cmd-user", "set-user", "exit-status"],
)
def test_failed_template_steps_are_worded_as_e2b_does(steps: Callable[[Template], Template], expected: str) -> None:
    logs: list[tuple[str, str]] = []
    with pytest.raises(BuildException) as failed:
        Template.build(
            steps(Template().from_template("base").skip_cache()),
            f"failing-{uuid.uuid4().hex[:8]}",
            on_build_logs=lambda entry: logs.append((entry.level, entry.message)),
        )
    assert expected in str(failed.value)
    assert any(level == "error" and expected in message for level, message in logs), logs


def test_commands_as_an_unknown_user_are_refused_as_envd_does(sbx: Sandbox) -> None:
    with pytest.raises(AuthenticationException, match="invalid username: 'root123'"):
        sbx.commands.run("whoami", user="root123")
    with pytest.raises(AuthenticationException, match="invalid username: 'root123'"):
        sbx.files.list("/", user="root123")
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"


# -- the base template ------------------------------------------------------------------------------------
def test_base_has_python_as_e2bs_does(sbx: Sandbox) -> None:
    for command in ("python", "python3"):
        version = sbx.commands.run(f"{command} --version").stdout
        assert version.startswith("Python 3."), (command, version)
    assert sbx.commands.run("python -c 'import sys; print(sys.version_info[0])'", user="root").stdout == "3\n"


@pytest.mark.parametrize(
    ("guest", "description", "recommitted"),
    [
        ("current", builder.BASE_DESCRIPTION, False),
        ("current", "", True),  # committed by a node whose setup steps were others (an older one)
        ("current", "Debian with aenv's setup 000000000000", True),
        ("older", builder.BASE_DESCRIPTION, True),
    ],
)
async def test_base_is_recommitted_when_its_setup_changes(
    guest: str, description: str, recommitted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data dir's `base` gets a changed setup (such as `python`) at the next start, on its own
    Debian layer: without this, only a new guest agent would ever bring it."""
    record = SimpleNamespace(guest=guest, description=description, layers=["debian", "setup"])
    node = SimpleNamespace(find_template=lambda name: record, driver=SimpleNamespace(guest_key=lambda: "current"))
    commits: list[str] = []

    async def commit(node: object, debian_layer: str, log: object) -> object:
        commits.append(debian_layer)
        return "new base"

    monkeypatch.setattr(builder, "_commit_base", commit)
    assert await builder.ensure_base(node) == ("new base" if recommitted else record)  # type: ignore[arg-type]
    assert commits == (["debian"] if recommitted else [])
