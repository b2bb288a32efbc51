"""The official Python `e2b` SDK (async face), unchanged, against aenv; and 50 sandboxes at once."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable

import pytest
from e2b import AsyncSandbox, CommandExitException, NotFoundException, PtySize, SandboxState
from e2b.sandbox.filesystem.watch_handle import FilesystemEvent, FilesystemEventType

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

CONCURRENT = 50


async def until(predicate: Callable[[], bool], timeout: float = 15) -> None:
    for _ in range(int(timeout / 0.05)):
        if predicate():
            return
        await asyncio.sleep(0.05)
    raise AssertionError("condition not reached in time")


async def test_async_commands_pty_files_watch_pause_and_kill() -> None:
    sbx = await AsyncSandbox.create(timeout=300, envs={"SUITE": "async"})
    try:
        lines: list[str] = []
        result = await sbx.commands.run("echo $SUITE; echo two", on_stdout=lines.append)
        assert result.stdout == "async\ntwo\n" == "".join(lines)  # callbacks get output as it comes
        with pytest.raises(CommandExitException) as info:
            await sbx.commands.run("exit 4")
        assert info.value.exit_code == 4

        handle = await sbx.commands.run("cat", background=True, stdin=True)
        await sbx.commands.send_stdin(handle.pid, "piped\n")
        await sbx.commands.close_stdin(handle.pid)
        assert (await handle.wait()).stdout == "piped\n"

        out = bytearray()
        term = await sbx.pty.create(PtySize(rows=30, cols=90), on_data=out.extend)
        await until(lambda: b"$ " in out)
        await sbx.pty.send_stdin(term.pid, b"stty size; exit\n")
        await term.wait()
        assert b"30 90" in out

        events: list[FilesystemEvent] = []
        await sbx.files.make_dir("/home/user/w")
        watch = await sbx.files.watch_dir("/home/user/w", on_event=events.append)
        blob = os.urandom(3 * 1024 * 1024)
        await sbx.files.write("/home/user/w/blob", blob)
        assert bytes(await sbx.files.read("/home/user/w/blob", format="bytes")) == blob
        await until(lambda: any(e.type == FilesystemEventType.CREATE for e in events))
        await watch.stop()
        assert any(e.name == "blob" and e.type == FilesystemEventType.CREATE for e in events)

        assert await sbx.pause() is True
        assert (await sbx.get_info()).state == SandboxState.PAUSED
        resumed = await AsyncSandbox.connect(sbx.sandbox_id)
        assert bytes(await resumed.files.read("/home/user/w/blob", format="bytes")) == blob
    finally:
        assert await AsyncSandbox.kill(sbx.sandbox_id) is True
    with pytest.raises(NotFoundException):
        await AsyncSandbox.connect(sbx.sandbox_id)


async def test_fifty_sandboxes_used_concurrently_by_one_client() -> None:
    async def one(i: int) -> tuple[str, str]:
        sbx = await AsyncSandbox.create(timeout=300, metadata={"n": str(i)})
        try:
            await sbx.files.write("/home/user/me", f"sandbox {i}")
            result = await sbx.commands.run("cat /home/user/me; ls /home/user")
            return sbx.sandbox_id, result.stdout
        finally:
            await sbx.kill()

    results = await asyncio.gather(*(one(i) for i in range(CONCURRENT)))
    assert len({sid for sid, _ in results}) == CONCURRENT
    for i, (_, out) in enumerate(results):
        assert out == f"sandbox {i}me\n"  # each saw its own file and nobody else's
