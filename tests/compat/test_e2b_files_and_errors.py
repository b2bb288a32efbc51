"""What E2B's own SDK test suite found aenv answering differently from envd and E2B's API, checked
with the official `e2b` SDK: entries' modes and symlinks, file metadata, E2B's error wording, idle
keep-alive connections and the `base` template's `python`."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import FileType, Sandbox

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
