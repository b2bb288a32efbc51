"""What E2B's own SDK test suite found aenv answering differently from envd and E2B's API, checked
with the official `e2b` SDK: entries' modes and symlinks, file metadata, E2B's error wording, idle
keep-alive connections and the `base` template's `python`."""

from __future__ import annotations

import ast
import asyncio
import base64
import json
import os
import socket
import stat
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
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
from e2b.sandbox.filesystem.filesystem import WriteEntry

from aenv.guest import metadata
from aenv.templates import builder
from tests.compat.conftest import Deployment

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

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


# -- file metadata: envd's user.e2b.* xattrs ----------------------------------------------------------
META = {"author": "mish", "purpose": "upload"}


@pytest.mark.parametrize("octet_stream", [False, True], ids=["multipart", "octet-stream"])
def test_metadata_of_an_upload_is_kept_and_surfaced(sbx: Sandbox, octet_stream: bool) -> None:
    info = sbx.files.write("meta.txt", "content", metadata=META, use_octet_stream=octet_stream)
    assert info.metadata == META
    assert sbx.files.get_info("meta.txt").metadata == META
    assert {e.name: e.metadata for e in sbx.files.list(HOME)}["meta.txt"] == META
    assert sbx.files.write("plain.txt", "no metadata").metadata is None
    assert sbx.files.get_info("plain.txt").metadata is None
    # an overwrite replaces the whole set: keys it does not name are gone, none clears them all
    assert sbx.files.write("meta.txt", "again", metadata={"author": "other"}).metadata == {"author": "other"}
    assert sbx.files.get_info("meta.txt").metadata == {"author": "other"}
    assert sbx.files.write("meta.txt", "bare").metadata is None
    assert sbx.files.get_info("meta.txt").metadata is None
    both = sbx.files.write_files(
        [WriteEntry(path="multi/one.txt", data="1"), WriteEntry(path="multi/two.txt", data="2")], metadata={"s": "t"}
    )
    assert [w.metadata for w in both] == [{"s": "t"}, {"s": "t"}]
    assert [e.metadata for e in sbx.files.list(f"{HOME}/multi")] == [{"s": "t"}, {"s": "t"}]
    # reading through a symlink reads what it leads to, as envd's path-based xattr calls do
    sbx.commands.run("ln -s multi/one.txt link && ln -s multi linkdir")
    assert sbx.files.get_info("link").metadata == {"s": "t"}
    assert [e.metadata for e in sbx.files.list(f"{HOME}/linkdir")] == [{"s": "t"}, {"s": "t"}]


def test_metadata_follows_moves_and_goes_with_removals(sbx: Sandbox) -> None:
    sbx.files.write("d/inner/file.txt", "x", metadata={"k": "v"})
    assert sbx.files.rename("d/inner/file.txt", "d/inner/renamed.txt").metadata == {"k": "v"}
    sbx.files.rename("d", "moved")  # a directory: what is inside keeps its metadata
    assert sbx.files.get_info("moved/inner/renamed.txt").metadata == {"k": "v"}
    assert sbx.files.rename("moved/inner/renamed.txt", "/tmp/across.txt").metadata == {"k": "v"}  # another fs
    assert sbx.files.rename("/tmp/across.txt", f"{HOME}/back.txt").metadata == {"k": "v"}
    sbx.commands.run("mv back.txt by-user.txt")  # a rename by a program: the inode, and its metadata, moves
    assert sbx.files.get_info("by-user.txt").metadata == {"k": "v"}
    sbx.commands.run("sed -i s/x/y/ by-user.txt")  # a new file renamed over it: ext4 would keep no xattr
    assert sbx.files.get_info("by-user.txt").metadata is None
    sbx.files.write("gone.txt", "x", metadata={"k": "v"})
    sbx.files.remove("gone.txt")
    sbx.commands.run("echo new > gone.txt")
    assert sbx.files.get_info("gone.txt").metadata is None
    sbx.files.make_dir("tree/sub")
    sbx.files.write("tree/sub/f.txt", "x", metadata={"k": "v"})
    sbx.files.remove("tree")
    sbx.files.make_dir("tree/sub")
    sbx.files.write("tree/sub/f.txt", "x")
    assert sbx.files.get_info("tree/sub/f.txt").metadata is None


@pytest.mark.runsc  # gVisor's tmpfs and the compat shim
def test_metadata_in_tmpfs_is_the_real_xattrs(sbx: Sandbox) -> None:
    """Where the sandbox's file system keeps xattrs (runsc's tmpfs), metadata is them, both ways."""
    sbx.files.write("/tmp/x.txt", "x", metadata={"k": "v"})
    listed = sbx.commands.run("python3 -c \"import os; print(os.getxattr('/tmp/x.txt', 'user.e2b.k'))\"")
    assert listed.stdout == "b'v'\n"
    sbx.commands.run("python3 -c \"import os; os.setxattr('/tmp/x.txt', 'user.e2b.author', b'mish')\"")
    sbx.commands.run("python3 -c \"import os; os.setxattr('/tmp/x.txt', 'user.other', b'not ours')\"")
    assert sbx.files.get_info("/tmp/x.txt").metadata == {"k": "v", "author": "mish"}


def test_metadata_survives_pause_resume_fork_and_snapshot(sbx: Sandbox, deployment: Deployment) -> None:
    sbx.files.write("kept.txt", "x", metadata={"k": "v"})
    sbx.files.write("/tmp/kept.txt", "x", metadata={"t": "mp"})
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.get_info("kept.txt").metadata == {"k": "v"}
    assert resumed.files.get_info("/tmp/kept.txt").metadata == {"t": "mp"}
    resumed.commands.run("mv kept.txt moved.txt")  # inode numbers changed at the restore: still followed
    assert resumed.files.get_info("moved.txt").metadata == {"k": "v"}
    r = httpx.post(
        f"{deployment.url}/sandboxes/{sbx.sandbox_id}/fork",
        json={"count": 1},
        headers={"X-API-Key": deployment.api_key},
        timeout=120,
    )
    assert r.status_code == 201, r.text
    child = Sandbox.connect(r.json()[0]["sandbox"]["sandboxID"])
    try:
        assert child.files.get_info("moved.txt").metadata == {"k": "v"}
        child.files.write("moved.txt", "child's", metadata={"child": "1"})
        assert resumed.files.get_info("moved.txt").metadata == {"k": "v"}  # each has its own
    finally:
        child.kill()
    snapshot = resumed.create_snapshot()
    try:
        fresh = Sandbox.create(template=snapshot.snapshot_id, timeout=60)
        try:
            assert fresh.files.get_info("moved.txt").metadata == {"k": "v"}
        finally:
            fresh.kill()
    finally:
        Sandbox.delete_snapshot(snapshot.snapshot_id)


def _raw_upload(deployment: Deployment, sandbox: Sandbox, headers: list[tuple[str, str | bytes]]) -> httpx.Response:
    routed = [
        ("E2b-Sandbox-Id", sandbox.sandbox_id),
        ("E2b-Sandbox-Port", "49983"),
        ("X-Access-Token", sandbox._envd_access_token or ""),
        ("Content-Type", "application/octet-stream"),
    ]
    return httpx.post(
        f"{deployment.url}/files", params={"path": f"{HOME}/raw.txt"}, headers=routed + headers, content=b"raw"
    )


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Metadata-" + "k" * 247, "v")],  # past the kernel's xattr name limit, with user.e2b.
        [(f"X-Metadata-k{i}", "v" * 200) for i in range(20)],  # past the 4 KiB an inode's xattrs get
        [("X-Metadata-k", "caf\u00e9")],  # not printable ASCII
        [("X-Metadata-k", "tab\tinside")],
    ],
    ids=["long-key", "too-much", "non-ascii", "control"],
)
def test_invalid_metadata_is_refused_as_envd_does(sbx: Sandbox, deployment: Deployment, headers: list) -> None:
    r = _raw_upload(deployment, sbx, [(k, v.encode()) for k, v in headers])
    assert r.status_code == 400 and r.json()["message"].startswith("invalid metadata: "), r.text
    assert not sbx.files.exists("raw.txt")


def test_metadata_headers_are_read_as_envd_reads_them(sbx: Sandbox, deployment: Deployment) -> None:
    headers = [("X-Metadata-Author", "first"), ("x-metadata-author", "second"), ("X-Metadata-", "no key")]
    r = _raw_upload(deployment, sbx, headers)
    assert r.status_code == 200 and r.json()[0]["metadata"] == {"author": "first"}, r.text


XATTR_CALLS = r"""
import errno, os, sys
def attempt(call, *args, **kwargs):
    try:
        result = call(*args, **kwargs)
        return sorted(result) if isinstance(result, list) else result
    except OSError as exc:
        return errno.errorcode[exc.errno]
p = sys.argv[1]
q = p + ".sizes"
open(q, "w").close()
print(repr([
    attempt(os.setxattr, p, "user.e2b.author", b"mish"),
    attempt(os.getxattr, p, "user.e2b.author"),
    attempt(os.setxattr, p, "user.other", b"1"),
    attempt(os.listxattr, p),
    attempt(os.setxattr, p, "user.e2b.author", b"again", os.XATTR_CREATE),
    attempt(os.setxattr, p, "user.none", b"x", os.XATTR_REPLACE),
    attempt(os.removexattr, p, "user.other"),
    attempt(os.removexattr, p, "user.other"),
    attempt(os.getxattr, p, "user.missing"),
    attempt(os.setxattr, q, "user.big", b"x" * 70000),
    attempt(os.setxattr, q, "user.full", b"x" * 4090),
    attempt(os.setxattr, "/etc/passwd", "user.k", b"v"),
    attempt(os.getxattr, os.open(p, os.O_RDONLY), "user.e2b.author"),
    attempt(os.setxattr, "/home/user/link", "user.k", b"v", follow_symlinks=False),
    attempt(os.getxattr, "/home/user/link", "user.e2b.author"),
]))
"""


@pytest.mark.runsc  # gVisor's xattrs through the compat shim
@pytest.mark.parametrize("place", ["/home/user/x.txt", "/tmp/x.txt"], ids=["root-fs", "tmpfs"])
def test_programs_user_xattrs_work_as_the_kernel_does(sbx: Sandbox, place: str) -> None:
    """On the root file system runsc refuses every xattr call; the preloaded shim has the agent
    keep user.* ones, with the kernel's rules, and what a program sets is the file's metadata."""
    sbx.files.write(place, "x")
    sbx.files.write(f"{HOME}/xattrs.py", XATTR_CALLS)
    sbx.commands.run(f"ln -s {place} {HOME}/link")
    got = ast.literal_eval(sbx.commands.run(f"python3 {HOME}/xattrs.py {place}").stdout)
    four_kib = "ENOSPC" if place.startswith(HOME) else None  # ext4's bound, kept; gVisor's tmpfs has none
    expected = [None, b"mish", None, ["user.e2b.author", "user.other"], "EEXIST", "ENODATA", None, "ENODATA"]
    expected += ["ENODATA", "E2BIG", four_kib, "EACCES", b"mish", "EPERM", b"mish"]
    assert got == expected  # /etc/passwd is root's; a symlink itself takes no user xattrs
    assert sbx.files.get_info(place).metadata == {"author": "mish"}
    # an upload replaces the metadata (user.e2b.*) and leaves the file's other user xattrs alone
    sbx.commands.run(f"python3 -c \"import os; os.setxattr('{place}', 'user.other', b'kept')\"")
    sbx.files.write(place, "y", metadata={"new": "1"})
    names = sbx.commands.run(f"python3 -c \"import os; print(sorted(os.listxattr('{place}')))\"").stdout
    assert names == "['user.e2b.new', 'user.other']\n"
    # tools that carry xattrs carry these too
    sbx.commands.run(f"cp -a {place} {place}.copy")
    assert sbx.files.get_info(f"{place}.copy").metadata == {"new": "1"}


@pytest.mark.runsc  # gVisor's xattrs through the compat shim
def test_programs_user_xattrs_are_kept_through_pause_and_fork(sbx: Sandbox, deployment: Deployment) -> None:
    sbx.files.write("kept.txt", "x")
    sbx.commands.run("python3 -c \"import os; os.setxattr('kept.txt', 'user.e2b.by', b'program')\"")
    assert sbx.pause() is True
    resumed = Sandbox.connect(sbx.sandbox_id)
    assert resumed.files.get_info("kept.txt").metadata == {"by": "program"}
    got = resumed.commands.run("python3 -c \"import os; print(os.getxattr('kept.txt', 'user.e2b.by'))\"").stdout
    assert got == "b'program'\n"


HOSTILE_CALLERS = r"""
import os, socket, struct, time
name = b"\0aenv-xattr"
held = []
for payload in (b"", b"x", b"\xff" * 70000, struct.pack("<c3xIIH2x", b"s", 0, 0, 65535)):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.connect(name)
    if payload:
        try:
            s.send(payload)
        except OSError:
            pass
    held.append(s)  # some never send at all, and none is closed
for _ in range(200):  # more connections than the agent has workers, all silent
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        s.connect(name)
        held.append(s)
    except OSError:
        break
time.sleep(3)
print("done", len(held))
"""


@pytest.mark.runsc  # the compat shim's xattr server
def test_hostile_xattr_callers_do_not_harm_the_agent(sbx: Sandbox) -> None:
    sbx.files.write(f"{HOME}/hostile.py", HOSTILE_CALLERS)
    assert sbx.commands.run(f"python3 {HOME}/hostile.py", timeout=60).stdout.startswith("done")
    sbx.files.write("after.txt", "x", metadata={"still": "works"})
    assert sbx.files.get_info("after.txt").metadata == {"still": "works"}
    got = sbx.commands.run("python3 -c \"import os; print(os.getxattr('after.txt', 'user.e2b.still'))\"").stdout
    assert got == "b'works'\n"


def test_the_metadata_store_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """What a client (or the sandbox) can make the agent hold is bounded; files that are gone give
    their room back first."""
    monkeypatch.setattr(metadata, "MAX_ENTRIES", 3)
    store = metadata.Store()
    paths = [tmp_path / f"f{i}" for i in range(4)]
    for path in paths:
        path.write_text("x")
    attrs = {"user.e2b.k": b"v"}
    for path in paths[:3]:
        store.put(str(path), path.stat(), attrs)
    with pytest.raises(metadata.Full):
        store.room_for(str(paths[3]), attrs)
    with pytest.raises(metadata.Full):
        store.put(str(paths[3]), paths[3].stat(), attrs)
    store.put(str(paths[0]), paths[0].stat(), {"user.e2b.k": b"replaced"})  # replacing takes no new room
    paths[1].unlink()
    store.put(str(paths[3]), paths[3].stat(), attrs)  # the removed file's entry made way
    assert len(store) == 3 and store.get(str(paths[3]), paths[3].stat()) == attrs
    monkeypatch.setattr(metadata, "MAX_STORED", 64)
    with pytest.raises(metadata.Full):
        store.put(str(paths[2]), paths[2].stat(), {"user." + "k" * 40: b"v" * 40})


@pytest.mark.parametrize(
    "saved",
    [
        b"[" * 100_000 + b"]" * 100_000,  # nested past the recursion limit
        b"{not json",
        b'["a list"]',
        json.dumps({"relative": {"user.k": "v"}, "/nul\u0000": {"user.k": "v"}, "/bad": {"trusted.k": "v"}}).encode(),
        json.dumps({"/x": {"user.k": 1}, "/y": "not a map", "/z": {}, "/w": {"user.k": "\u0100"}}).encode(),
        json.dumps({"/big": {"user.k": "v" * 5000}, "/long": {"user." + "k" * 300: "v"}}).encode(),
    ],
    ids=["deep", "broken", "list", "bad-entries", "bad-values", "too-large"],
)
def test_a_hostile_saved_store_loads_nothing_and_breaks_nothing(tmp_path: Path, saved: bytes) -> None:
    """The file is in the sandbox's file system: its root may have written anything there."""
    path = tmp_path / "file-metadata.json"
    path.write_bytes(saved)
    store = metadata.Store()
    store.load(str(path))
    assert len(store) == 0


def test_the_store_is_saved_and_loaded_safely(tmp_path: Path) -> None:
    kept = tmp_path / "kept.txt"
    kept.write_text("x")
    store = metadata.Store()
    store.put(str(kept), kept.stat(), {"user.e2b.k": b"v", "user.bytes": bytes(range(256))})
    target = tmp_path / "lib" / "file-metadata.json"
    store.save(str(target))
    assert stat.S_IMODE(target.stat().st_mode) == 0o600 and stat.S_IMODE(target.parent.stat().st_mode) == 0o700
    again = metadata.Store()
    again.load(str(target))
    assert again.get(str(kept), kept.stat()) == {"user.e2b.k": b"v", "user.bytes": bytes(range(256))}
    # whatever the sandbox left at the name is replaced, never opened or followed
    os.unlink(target)
    os.mkfifo(target)
    again.load(str(target))  # a FIFO: not waited on
    elsewhere = tmp_path / "elsewhere"
    elsewhere.write_text("untouched")
    os.unlink(target)
    os.symlink(elsewhere, target)
    store.put(str(kept), kept.stat(), {"user.e2b.k": b"changed"})
    store.save(str(target))
    assert elsewhere.read_text() == "untouched" and not target.is_symlink()


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


@pytest.mark.root  # commands as root
def test_commands_as_an_unknown_user_are_refused_as_envd_does(sbx: Sandbox) -> None:
    with pytest.raises(AuthenticationException, match="invalid username: 'root123'"):
        sbx.commands.run("whoami", user="root123")
    with pytest.raises(AuthenticationException, match="invalid username: 'root123'"):
        sbx.files.list("/", user="root123")
    assert sbx.commands.run("whoami", user="root").stdout == "root\n"


# -- the base template ------------------------------------------------------------------------------------
@pytest.mark.runsc  # Debian's `base`
def test_base_has_python_as_e2bs_does(sbx: Sandbox) -> None:
    for command in ("python", "python3"):
        version = sbx.commands.run(f"{command} --version").stdout
        assert version.startswith("Python 3."), (command, version)
    assert sbx.commands.run("python -c 'import sys; print(sys.version_info[0])'", user="root").stdout == "3\n"


@pytest.mark.runsc  # Debian's `base` and its setup
@pytest.mark.parametrize(
    ("guest", "description", "runs_here", "recommitted"),
    [
        ("current", builder.BASE_DESCRIPTION, True, False),
        ("current", "", True, True),  # committed by a node whose setup steps were others (an older one)
        ("current", "Debian with aenv's setup 000000000000", True, True),
        ("older", builder.BASE_DESCRIPTION, True, True),
        ("current", builder.BASE_DESCRIPTION, False, True),  # its image was written by another runsc
    ],
)
async def test_base_is_recommitted_when_its_setup_changes(
    guest: str, description: str, runs_here: bool, recommitted: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data dir's `base` gets a changed setup (such as `python`) at the next start, on its own
    Debian layer: without this, only a new guest agent would ever bring it. So does a `base`
    whose memory image this node's runsc cannot restore."""
    record = SimpleNamespace(guest=guest, description=description, layers=["debian", "setup"])
    node = SimpleNamespace(
        find_template=lambda name: record, driver=SimpleNamespace(name="runsc", guest_key=lambda: "current")
    )
    commits: list[str] = []

    async def commit(node: object, debian_layer: str, log: object) -> object:
        commits.append(debian_layer)
        return "new base"

    async def image_runs_here(node: object, rec: object) -> bool:
        return runs_here

    monkeypatch.setattr(builder, "_commit_base", commit)
    monkeypatch.setattr(builder, "image_runs_here", image_runs_here)
    assert await builder.ensure_base(node) == ("new base" if recommitted else record)  # type: ignore[arg-type]
    assert commits == (["debian"] if recommitted else [])
