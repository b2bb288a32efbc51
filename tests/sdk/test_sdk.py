"""The native SDK against a real server: async and sync faces, fork groups, errors."""

from __future__ import annotations

import time

import pytest

import aenv.sdk
from aenv.sdk import AsyncClient, Client, SandboxNotFound, fork_group
from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


def test_exported_names_are_sorted_and_complete() -> None:
    assert aenv.sdk.__all__ == sorted(aenv.sdk.__all__)
    assert all(hasattr(aenv.sdk, name) for name in aenv.sdk.__all__)


async def test_async_lifecycle_and_fork_group(server: Server) -> None:
    async with AsyncClient(server.url, API_KEY) as client:
        sbx = await client.create(metadata={"sdk": "async"})
        try:
            result = await sbx.exec("echo $((6*7)); echo oops >&2; exit 3")
            assert (result.exit_code, result.stdout, result.stderr) == (3, "42\n", "oops\n")
            argv = await sbx.exec(["/usr/bin/printf", "%s-%s", "a b", "c"])
            assert argv.stdout == "a b-c"
            await sbx.write("/home/user/data.bin", bytes(range(256)) * 4096)
            assert await sbx.read("/home/user/data.bin") == bytes(range(256)) * 4096
            names = [e["name"] for e in await sbx.ls("/home/user")]
            assert "data.bin" in names
            async with fork_group(sbx, 2) as rollouts:
                outs = [await r.exec("cat /home/user/data.bin | wc -c") for r in rollouts]
                assert [o.stdout.strip() for o in outs] == ["1048576", "1048576"]
                ids = [r.sandbox_id for r in rollouts]
            listed = {s.sandbox_id for s in await client.list()}
            assert not set(ids) & listed  # the group was cleaned up
            await sbx.pause()
            assert (await sbx.info()).state == "paused"
            await sbx.resume()
            assert (await sbx.exec("echo back")).stdout == "back\n"
            snap = await sbx.snapshot()
            assert any(s["snapshotID"] == snap for s in await client.snapshots())
            await client.delete_snapshot(snap)
        finally:
            await sbx.kill()
        with pytest.raises(SandboxNotFound):
            await sbx.info()


@pytest.mark.root  # commands as root
def test_sync_face(server: Server) -> None:
    with Client(server.url, API_KEY) as client:
        with client.create() as sbx:
            assert sbx.exec("id -un", user="root").stdout == "root\n"
            children = sbx.fork(2)
            assert len(children) == 2 and all(c.exec("true").exit_code == 0 for c in children)
            for c in children:
                assert c.kill() is True
        assert any(t["name"] == "base" for t in client.templates())


async def test_pty_and_stdin(server: Server) -> None:
    async with AsyncClient(server.url, API_KEY) as client:
        sbx = await client.create()
        try:
            session = await sbx.pty(cols=100, rows=30)
            await session.send(b"stty size; echo pty-$((40+2)); exit 3\n")
            seen = b""
            async for chunk in session.output():
                seen += chunk
            assert b"30 100" in seen and b"pty-42" in seen
            assert session.exit_code == 3
            await session.close()
        finally:
            await sbx.kill()


def test_e2b_stdin_and_background_process(sandbox) -> None:  # type: ignore[no-untyped-def]
    handle = sandbox.commands.run("read line; echo got:$line", background=True, stdin=True)
    sandbox.commands.send_stdin(handle.pid, "hello\n")
    result = handle.wait()
    assert result.stdout == "got:hello\n"
    slow = sandbox.commands.run("sleep 30", background=True)
    assert slow.pid in [p.pid for p in sandbox.commands.list()]
    assert slow.kill() is True
    deadline = time.monotonic() + 5  # the exit is reaped asynchronously
    while slow.pid in [p.pid for p in sandbox.commands.list()] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert slow.pid not in [p.pid for p in sandbox.commands.list()]
    with pytest.raises(Exception) as exc:
        sandbox.commands.run("definitely-not-a-command")
    assert "127" in str(exc.value) or "not found" in str(exc.value)
