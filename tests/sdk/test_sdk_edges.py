"""The SDK's sharp edges, on real nodes: a resume keeps the sandbox's own timeout, fork groups in
both faces clean up whatever happens, and a command on a paused sandbox says it is paused.

Each was seen failing before its fix: the resume gave 300 s to a 600 s sandbox (every way back:
SDK resume or connect, E2B's connect, the API's connect, auto-resume); the sync fork group raised
TypeError and the async one, handed a sync sandbox, forked and left its children running; exec on a
paused sandbox said "not found" (a 502 from the node, which the SDK raised as UpstreamError)."""

from __future__ import annotations

import asyncio
import time
from datetime import datetime

import httpx
import pytest

from aenv.sdk import (
    AsyncClient,
    AsyncSandbox,
    Client,
    LimitExceeded,
    NotFound,
    OperationTimeout,
    PayloadTooLarge,
    Sandbox,
    SandboxInfo,
    WrongState,
    fork_group,
)
from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime
SH = ["/bin/sh", "-c"]


def left(info: SandboxInfo) -> float:
    """Seconds until the sandbox's timeout ends it."""
    return datetime.fromisoformat(info.end_at.replace("Z", "+00:00")).timestamp() - time.time()


def assert_lease(info: SandboxInfo, seconds: int) -> None:
    assert seconds - 30 < left(info) <= seconds + 1, (seconds, info.end_at, info.state)


# -- the timeout across a pause ---------------------------------------------------------------------
async def test_a_resume_keeps_the_sandbox_timeout(server: Server) -> None:
    async with AsyncClient(server.url, API_KEY) as client:
        sbx = await client.create(timeout=600)
        try:
            await sbx.pause()
            await sbx.resume()
            assert_lease(await sbx.info(), 600)
            await sbx.pause()
            await sbx.resume(timeout=120)  # a resume that names one sets it
            assert_lease(await sbx.info(), 120)
            await sbx.pause()
            await client.connect(sbx.sandbox_id)  # a handle by id resumes it too
            assert_lease(await sbx.info(), 120)
            await sbx.set_timeout(900)
            await sbx.pause()
            await sbx.resume()
            assert_lease(await sbx.info(), 900)
            await sbx.set_timeout(1200)
            await sbx.resume()  # running: only ever extended
            assert_lease(await sbx.info(), 1200)
            (child,) = await sbx.fork(1)  # a child runs what its source has left, and keeps its timeout
            try:
                await child.pause()
                await child.resume()
                assert_lease(await child.info(), 1200)
            finally:
                await child.kill()
        finally:
            await sbx.kill()


def test_every_way_back_keeps_it(server: Server, e2b_env: Server, api: httpx.Client) -> None:
    from e2b import Sandbox as E2BSandbox

    with Client(server.url, API_KEY) as client, client.create(timeout=700, auto_resume=True) as sbx:
        sbx.pause()
        client.connect(sbx.sandbox_id)
        assert_lease(sbx.info(), 700)
        sbx.pause()
        E2BSandbox.connect(sbx.sandbox_id)  # E2B's SDK sends no timeout when given none
        assert_lease(sbx.info(), 700)
        sbx.pause()
        r = api.post(f"/v2/sandboxes/{sbx.sandbox_id}/connect", json={})
        assert r.status_code == 201, r.text
        assert_lease(sbx.info(), 700)
        sbx.pause()
        assert sbx.exec("echo woken").stdout == "woken\n"  # auto-resume: its use brings it back
        info = sbx.info()
        assert info.state == "running"
        assert_lease(info, 700)


# -- a paused sandbox -------------------------------------------------------------------------------
def test_exec_errors_say_what_happened(server: Server) -> None:
    """Past its limit a command is killed (OperationTimeout); on a paused sandbox every data-plane
    call says it is paused and how to resume it (WrongState), and nothing wakes it."""
    with Client(server.url, API_KEY) as client, client.create(timeout=300) as sbx:
        started = time.monotonic()
        with pytest.raises(OperationTimeout):
            sbx.exec("sleep 30", timeout=1)
        assert time.monotonic() - started < 20  # a liveness bound: the limit ended it, not the command
        sbx.write("/home/user/kept", "still here")
        sbx.pause()
        attempts = [
            lambda: sbx.exec("true"),
            lambda: sbx.exec(["/bin/true"], timeout=None),
            lambda: sbx.read("/home/user/kept"),
            lambda: sbx.read_to("/home/user/kept", lambda chunk: None),
            lambda: sbx.write("/home/user/other", "x"),
            lambda: sbx.ls("/home/user"),
            lambda: sbx.pty(),
        ]
        for attempt in attempts:
            with pytest.raises(WrongState) as caught:
                attempt()
            message = str(caught.value)
            assert "paused" in message and "resume" in message and "not found" not in message, message
            assert caught.value.sandbox_id == sbx.sandbox_id
        assert sbx.info().state == "paused"  # nothing woke it
        sbx.resume()
        assert sbx.read("/home/user/kept") == b"still here"
        with client.create(timeout=300, auto_resume=True) as woken:
            woken.pause(keep_memory=False)  # auto-resume restores a memory, never reboots
            with pytest.raises(WrongState, match="without its memory"):
                woken.exec("true")
            assert woken.info().state == "paused"


def test_the_api_says_paused_in_e2b_words(server: Server, e2b_env: Server, api: httpx.Client) -> None:
    from e2b import Sandbox as E2BSandbox
    from e2b.exceptions import SandboxNotRunningException

    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        routed = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": token}
        for method, path, body in [
            ("POST", "/filesystem.Filesystem/Stat", b'{"path": "/"}'),
            ("POST", "/process.Process/List", b"{}"),
            ("GET", "/files?path=/etc/hostname", b""),
        ]:
            headers = {**routed, "Content-Type": "application/json"}
            r = httpx.request(method, server.url + path, headers=headers, content=body)
            answer = r.json()
            assert r.status_code == 502 and "was not found" in answer["message"], (path, r.text)  # the E2B SDKs' cue
            assert "it is paused" in answer["message"] and "connect" in answer["message"], (path, r.text)
            assert answer["state"] == "paused" and answer["sandboxId"] == sid
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        sbx = E2BSandbox.connect(sid)
        sbx.pause()
        # the E2B SDKs' own reading of it (not running), with the node's words on why
        with pytest.raises(SandboxNotRunningException, match="it is paused"):
            sbx.commands.run("true", request_timeout=10)
        with pytest.raises(SandboxNotRunningException, match="it is paused"):
            sbx.files.read("/etc/hostname", request_timeout=10)
        assert not sbx.is_running()
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_a_sync_terminal(server: Server) -> None:
    """The sync face's pty is a sync terminal (it handed back the async session, unusable there)."""
    with Client(server.url, API_KEY) as client, client.create(timeout=120) as sbx:
        terminal = sbx.pty(cols=100, rows=30)
        terminal.send(b"stty size; echo pty-$((40+2)); exit 3\n")
        seen = b"".join(terminal.output())
        assert b"30 100" in seen and b"pty-42" in seen and terminal.exit_code == 3
        terminal.close()


# -- fork groups, on a node with room for three (small_node) ---------------------------------------
def _ids(client: Client) -> set[str]:
    return {s.sandbox_id for s in client.list()}


def test_a_sync_fork_group_cleans_up_whatever_happens(small_node: Server) -> None:
    with Client(small_node.url, API_KEY) as client, client.create("bb", timeout=300) as sbx:
        with fork_group(sbx, 2) as rollouts:
            assert all(isinstance(r, Sandbox) for r in rollouts)
            assert [r.exec([*SH, "echo $((1+1))"]).stdout for r in rollouts] == ["2\n", "2\n"]
        assert _ids(client) == {sbx.sandbox_id}
        with pytest.raises(RuntimeError, match="the rollout failed"), fork_group(sbx, 2) as rollouts:
            assert len(_ids(client)) == 3
            raise RuntimeError("the rollout failed")
        assert _ids(client) == {sbx.sandbox_id}
        with pytest.raises(LimitExceeded), fork_group(sbx, 4):  # room for 2: the 2 made are killed
            pytest.fail("not reached")
        assert _ids(client) == {sbx.sandbox_id}

        async def misuse() -> None:
            async with fork_group(sbx, 2):  # type: ignore[arg-type]
                pass

        with pytest.raises(TypeError, match="with fork_group"):
            asyncio.run(misuse())
        assert _ids(client) == {sbx.sandbox_id}  # refused before forking: nothing left behind


async def test_an_async_fork_group_refuses_a_sync_with(small_node: Server) -> None:
    async with AsyncClient(small_node.url, API_KEY) as client:
        sbx = await client.create("bb", timeout=300)
        try:
            with pytest.raises(TypeError, match="async with"), fork_group(sbx, 2):  # type: ignore[arg-type]
                pytest.fail("not reached")
            async with fork_group(sbx, 2) as rollouts:
                assert all(isinstance(r, AsyncSandbox) for r in rollouts)
            with pytest.raises(LimitExceeded):
                async with fork_group(sbx, 4):
                    pytest.fail("not reached")
            assert {s.sandbox_id for s in await client.list()} == {sbx.sandbox_id}
        finally:
            await sbx.kill()


def test_an_auto_resume_that_fails_says_why(small_node: Server) -> None:
    """Traffic to a paused sandbox with auto-resume on a full node: the answer is the resume's
    refusal (429, saying the sandbox is paused), not "not found" (a 502 before)."""
    with Client(small_node.url, API_KEY) as client:
        sleepy = client.create("bb", timeout=300, auto_resume=True)
        sleepy.pause()
        others = [client.create("bb", timeout=300) for _ in range(3)]  # the node is full
        try:
            with pytest.raises(LimitExceeded, match="paused and its auto-resume failed"):
                sleepy.exec([*SH, "true"])
            assert sleepy.info().state == "paused"
            others.pop().kill()
            assert sleepy.exec([*SH, "echo back"]).stdout == "back\n"  # room again: its use resumes it
        finally:
            for sandbox in [sleepy, *others]:
                sandbox.kill()


async def test_a_fork_cancelled_midway_leaves_no_child(small_node: Server) -> None:
    """A rollout's deadline cancels a fork the node is carrying out: the node finishes it, and the
    SDK kills the children its answer names (they were left running, unknown to anyone)."""
    async with AsyncClient(small_node.url, API_KEY) as client:
        sbx = await client.create("bb", timeout=300)
        try:
            for _ in range(3):  # the children must be made, the answer not yet back
                forking = asyncio.ensure_future(sbx.fork(2))
                deadline = time.monotonic() + 30
                while len(await client.list()) < 3 and not forking.done() and time.monotonic() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.005)
                if not forking.done():
                    break
                await kill_all_but(client, sbx)
            assert not forking.done(), "the fork answered before its children were seen: no cancel midway"
            forking.cancel()
            with pytest.raises(asyncio.CancelledError):
                await forking
            deadline = time.monotonic() + 30
            while {s.sandbox_id for s in await client.list()} != {sbx.sandbox_id} and time.monotonic() < deadline:  # noqa: ASYNC110
                await asyncio.sleep(0.2)
            assert {s.sandbox_id for s in await client.list()} == {sbx.sandbox_id}
        finally:
            await sbx.kill()


async def kill_all_but(client: AsyncClient, keep: AsyncSandbox) -> None:
    for info in await client.list():
        if info.sandbox_id != keep.sandbox_id:
            await AsyncSandbox(client, {"sandboxID": info.sandbox_id}).kill()


# -- bounded output and reads ------------------------------------------------------------------------
async def test_exec_max_output_kills_a_runaway_command_and_keeps_the_bound(server: Server) -> None:
    """`yes` would run to its timeout with every byte held; with max_output it is killed at the
    bound (its whole session: a child in the background goes too) and exactly that much is kept."""
    async with AsyncClient(server.url, API_KEY) as client:
        sbx = await client.create(timeout=120)
        try:
            started = time.monotonic()
            seen: list[str] = []
            r = await sbx.exec("(sleep 300; echo late) & yes", timeout=60, max_output=100_000, on_stdout=seen.append)
            assert time.monotonic() - started < 20
            assert r.truncated and r.stdout == "y\n" * 50_000 and "".join(seen) == r.stdout
            assert r.exit_code != 0 and r.stderr == ""
            assert "sleep 300" not in (await sbx.exec("ps -eo args")).stdout  # the session is gone
            err = await sbx.exec("yes no >&2", max_output=10)
            assert err.truncated and err.stderr == "no\nno\nno\nn" and err.stdout == ""
            whole = await sbx.exec("printf '%s' ééé; echo done >&2", max_output=6)  # a bound met exactly is no cut
            assert not whole.truncated and whole.exit_code == 0 and whole.stdout == "ééé" and whole.stderr == "done\n"
        finally:
            await sbx.kill()


async def test_read_max_bytes_refuses_a_larger_file_without_reading_it(server: Server) -> None:
    async with AsyncClient(server.url, API_KEY) as client:
        sbx = await client.create(timeout=120)
        try:
            await sbx.write("/tmp/small", b"x" * 1000)
            assert await sbx.read("/tmp/small", max_bytes=1000) == b"x" * 1000
            with pytest.raises(PayloadTooLarge, match="larger than 999 bytes"):
                await sbx.read("/tmp/small", max_bytes=999)
            await sbx.exec("truncate -s 2G /tmp/big")
            started = time.monotonic()
            with pytest.raises(PayloadTooLarge):
                await sbx.read("/tmp/big", max_bytes=1 << 20)
            assert time.monotonic() - started < 5  # refused by its size, not read to the bound
            with pytest.raises(NotFound):
                await sbx.read("/tmp/missing", max_bytes=10)  # what is not there says so, as without a bound
        finally:
            await sbx.kill()
