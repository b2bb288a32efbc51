"""Rollout helpers and what they stand on, on real nodes: per-child metadata at fork, rollout logs,
grace periods for scoring, SandboxGone against CommandFailed, best_of_n and tree_search (sync and
async) and the examples.

Every helper failure point (an exception in run/step or in scoring, a fork that fails part way, a
cancellation, Ctrl-C in the sync face, a child that dies) asserts that no sandbox the helper made
is left on the node. Each was seen failing on a deliberately leaky variant of the helpers (no kill
of the children on the failure path, or the cancelled fork's children not waited for): the
children stayed listed."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from aenv.node.rollout import OutputTail, RolloutLogs
from aenv.sdk import (
    AsyncClient,
    AsyncSandbox,
    Client,
    CommandFailed,
    InvalidRequest,
    LimitExceeded,
    Sandbox,
    SandboxGone,
    SandboxNotFound,
    WrongState,
    best_of_n,
    tree_search,
)
from tests.conftest import API_KEY, DATA_DIR, Server, _have_runtime, start_busybox_node

pytestmark = pytest.mark.sandbox
SH = ["/bin/sh", "-c"]
ROOM = 5  # the node's AENV_MAX_SANDBOXES: a fork past it fails part way


@pytest.fixture(scope="module")
def node() -> Iterator[Server]:
    """A busybox node (template `bb`) with room for five sandboxes and a 64 KiB rollout log each."""
    if not _have_runtime():
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox tests: need root, runsc and debootstrap")
        pytest.skip("needs root, runsc and debootstrap (the CI machine has them)")
    extra = {"AENV_MAX_SANDBOXES": str(ROOM), "AENV_ROLLOUT_LOG_KB": "64", "AENV_ROLLOUT_OUTPUT_KB": "4"}
    srv = start_busybox_node(Path(f"{DATA_DIR}-rollout"), extra)
    with srv.client() as api:
        for item in api.get("/v2/sandboxes").json():  # what an earlier run left
            api.delete(f"/sandboxes/{item['sandboxID']}")
    yield srv
    srv.stop()


@pytest.fixture()
def tag(node: Server) -> Iterator[str]:
    """Metadata every sandbox of the test carries (children inherit it); none is left after."""
    value = uuid.uuid4().hex[:12]
    yield value
    with node.client() as api:
        for sandbox_id in alive(api, value):
            api.delete(f"/sandboxes/{sandbox_id}")


def alive(api: httpx.Client, tag: str) -> set[str]:
    """The ids of the node's sandboxes (running or paused) with this test's tag."""
    r = api.get("/v2/sandboxes", params={"metadata": f"t={tag}"})
    assert r.status_code == 200, r.text
    return {item["sandboxID"] for item in r.json()}


def wait_for(check: Any, what: str, limit: float = 30) -> None:
    deadline = time.monotonic() + limit
    while not check():
        assert time.monotonic() < deadline, f"not within {limit} s: {what}"
        time.sleep(0.1)


# -- per-child metadata at fork --------------------------------------------------------------------
def test_fork_gives_each_child_its_metadata(node: Server, tag: str) -> None:
    with Client(node.url, API_KEY) as client, node.client() as api:
        src = client.create("bb", metadata={"t": tag, "k": "source"})
        children = src.fork(2, metadata=[{"child": "0"}, {"child": "1", "k": "mine"}])
        assert [c.info().metadata for c in children] == [
            {"t": tag, "k": "source", "child": "0"},
            {"t": tag, "k": "mine", "child": "1"},
        ]
        (one,) = src.fork(1, metadata={"round": "3"})  # one map: for every child
        assert one.info().metadata == {"t": tag, "k": "source", "round": "3"}
        before = alive(api, tag)
        url = f"/sandboxes/{src.sandbox_id}/fork"
        big = {f"key{i}": "v" for i in range(128)}  # with the source's 2: past 128 entries
        for body in (
            {"count": 2, "metadata": [{"a": "b"}]},  # one map for two children
            {"count": 1, "metadata": {"a": 1}},
            {"count": 1, "metadata": "a=b"},
            {"count": 1, "metadata": [{"a": "b\x00"}]},
            {"count": 1, "metadata": big},
        ):
            r = api.post(url, json=body)
            assert r.status_code == 400 and r.json()["error_code"] == "invalid_request", (body, r.text)
        with pytest.raises(InvalidRequest, match="metadata"):
            src.fork(2, metadata=[{"a": "b"}] * 3)
        assert alive(api, tag) == before  # nothing made by a refused fork


# -- rollout logs ----------------------------------------------------------------------------------
def test_rollout_log_keeps_each_command_with_its_output_and_exit_code(node: Server, tag: str, tmp_path: Path) -> None:
    with Client(node.url, API_KEY) as client, node.client() as api:
        sbx = client.create("bb", metadata={"t": tag})
        sbx.exec(SH + ["echo out; echo err >&2; exit 3"])
        sbx.exec(SH + ["head -c 10000 /dev/zero | tr '\\0' a; echo END"])  # past the node's 4 KiB a stream
        sbx.exec(SH + ["printf '\\000\\377\\033[31m\\342\\202'"])  # bytes that are no text
        log = sbx.rollout_log()
        assert [e["seq"] for e in log] == [0, 1, 2] and {e["sandboxID"] for e in log} == {sbx.sandbox_id}
        first, long, junk = log
        assert (first["exitCode"], first["stdout"], first["stderr"], first["outcome"]) == (
            3,
            "out\n",
            "err\n",
            "nonzero",
        )
        assert first["cmd"] == "/bin/sh -c echo out; echo err >&2; exit 3"
        assert long["stdoutBytes"] == 10004 and long["stdout"] == "a" * 4092 + "END\n"  # the end of it
        assert junk["exitCode"] == 0 and junk["stdoutBytes"] == 9 and "\ufffd" in junk["stdout"]
        sbx.pause()
        assert len(client.rollout_log(sbx.sandbox_id)) == 3  # a paused sandbox's, without resuming it
        assert sbx.info().state == "paused"
        sbx.resume()
        sbx.exec(SH + ["echo back"])
        (child,) = sbx.fork(1)
        child.exec(SH + ["echo child"])
        sbx.exec(SH + ["echo parent"])
        mine = child.rollout_log()  # its source's commands are its past
        assert [(e["seq"], e["sandboxID"]) for e in mine] == [(i, sbx.sandbox_id) for i in range(4)] + [
            (4, child.sandbox_id)
        ]
        assert mine[-1]["stdout"] == "child\n"
        assert [e["stdout"] for e in sbx.rollout_log()[3:]] == ["back\n", "parent\n"]
        raw = api.get(f"/sandboxes/{sbx.sandbox_id}/rollout-log")
        assert raw.status_code == 200 and raw.headers["content-type"].startswith("application/jsonl")
        lines = raw.text.splitlines()
        assert [json.loads(line)["seq"] for line in lines] == [0, 1, 2, 3, 4]
        out = tmp_path / "log.jsonl"
        env = {**os.environ, "AENV_URL": node.url, "AENV_API_KEY": API_KEY}
        cli = [sys.executable, "-m", "aenv.cli.main", "logs", sbx.sandbox_id, "--output", str(out)]
        done = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert [json.loads(line) for line in out.read_text().splitlines()] == [json.loads(line) for line in lines]
        kept = node.data_dir / "rollout" / f"{sbx.sandbox_id}.jsonl"
        assert kept.is_file() and oct(kept.stat().st_mode & 0o777) == "0o600"
        sbx.kill()
        assert not kept.exists()  # gone with its sandbox
        with pytest.raises(SandboxGone):
            sbx.rollout_log()
        assert api.get(f"/sandboxes/{sbx.sandbox_id}/rollout-log").status_code == 404


def test_rollout_log_bounds(tmp_path: Path) -> None:
    """No node: a log keeps within its cap (oldest commands first out, ``seq`` going on), picks
    its numbering up again after a restart, and takes only keys that name no other file."""
    logs = RolloutLogs(tmp_path / "rollout", log_bytes=4096, output_bytes=64)
    for i in range(200):
        logs.append("sbx1", {"cmd": f"echo {i}", "stdout": "x" * 50})
    path = tmp_path / "rollout" / "sbx1.jsonl"
    assert path.stat().st_size <= 4096
    seqs = [json.loads(line)["seq"] for line in path.read_text().splitlines()]
    assert seqs == list(range(seqs[0], 200)) and seqs[0] > 0
    again = RolloutLogs(tmp_path / "rollout", log_bytes=4096, output_bytes=64)
    again.append("sbx1", {"cmd": "after a restart"})
    assert json.loads(again.read("sbx1").splitlines()[-1])["seq"] == 200
    again.copy("sbx1", "snapshot-s1")
    again.append("snapshot-s1", {"cmd": "x"})
    assert json.loads(again.read("snapshot-s1").splitlines()[-1])["seq"] == 201
    for bad in ("../aenv.db", "a/b", "", "x" * 200):
        with pytest.raises(ValueError):
            again.path(bad)
    again.sweep(["sbx1"])
    assert sorted(p.name for p in (tmp_path / "rollout").iterdir()) == ["sbx1.jsonl"]
    tail = OutputTail(8)
    for chunk in (b"0123456789", b"abc", b"defgh" * 5):
        tail.add("stdout", chunk)
    assert tail.json() == {"stdout": "fghdefgh", "stdoutBytes": 38}
    off = RolloutLogs(tmp_path / "off", log_bytes=0, output_bytes=64)
    off.append("sbx1", {"cmd": "x"})
    assert off.tail() is None and not (tmp_path / "off").exists()


# -- a grace period for scoring --------------------------------------------------------------------
def test_a_grace_period_lets_scoring_commands_run_past_the_timeout(node: Server, tag: str) -> None:
    with Client(node.url, API_KEY) as client, node.client() as api:
        sbx = client.create("bb", timeout=3, grace=6, metadata={"t": tag})
        info = sbx.info()
        assert info.raw["grace"] == 6 and info.raw["graceEndAt"] > info.end_at
        sbx.write("/tmp/state", "what the rollout left")
        outcome: dict[str, Any] = {}

        def run(name: str, cmd: str, scoring: bool) -> None:
            try:
                outcome[name] = sbx.exec(SH + [cmd], timeout=None, scoring=scoring)
            except Exception as exc:
                outcome[name] = exc

        agent = threading.Thread(target=run, args=("agent", "sleep 60; echo finished", False))
        verifier = threading.Thread(target=run, args=("verifier", "sleep 5; cat /tmp/state", True))
        agent.start()
        verifier.start()
        agent.join(20)
        verifier.join(20)
        # at the timeout the agent's command was stopped; the scoring one ran on past it
        assert outcome["agent"].stdout == "" and outcome["agent"].error == "signal: killed", outcome
        assert outcome["verifier"].stdout == "what the rollout left", outcome
        with pytest.raises(WrongState, match="grace period"):
            sbx.exec(SH + ["echo not a scoring command"])
        assert sbx.exec(SH + ["cat /tmp/state"], scoring=True).stdout == "what the rollout left"
        assert sbx.read("/tmp/state") == b"what the rollout left"  # files stay reachable
        log = sbx.rollout_log()
        assert [e.get("scoring", False) for e in log] == [False, True, True]
        wait_for(lambda: not alive(api, tag), "the grace period ends it", limit=20)
        with pytest.raises(SandboxGone):
            sbx.exec(SH + ["true"], scoring=True)
        for grace in (-1, 3601, True, "5"):
            r = api.post("/sandboxes", json={"templateID": "bb", "grace": grace, "metadata": {"t": tag}})
            assert r.status_code == 400, (grace, r.text)
        assert not alive(api, tag)


# -- gone is not failed ----------------------------------------------------------------------------
async def test_sandbox_gone_and_command_failed_are_told_apart(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        sbx = await client.create("bb", metadata={"t": tag})
        with pytest.raises(CommandFailed) as failed:
            await sbx.exec(SH + ["echo partial; echo broken >&2; exit 7"], check=True)
        assert (failed.value.exit_code, failed.value.stdout, failed.value.stderr) == (7, "partial\n", "broken\n")
        assert not isinstance(failed.value, SandboxNotFound) and "exited with 7: broken" in str(failed.value)
        assert (await sbx.exec(SH + ["exit 7"])).exit_code == 7  # unchecked: no error
        running = asyncio.ensure_future(sbx.exec(SH + ["sleep 60"], timeout=None))
        await asyncio.sleep(1)
        await sbx.kill()  # while the command runs
        with pytest.raises(SandboxGone) as gone:
            await asyncio.wait_for(running, 20)
        assert isinstance(gone.value, SandboxNotFound) and gone.value.sandbox_id == sbx.sandbox_id
        for call in (sbx.info(), sbx.pause(), sbx.exec("true"), sbx.fork(1), sbx.snapshot(), sbx.set_timeout(9)):
            with pytest.raises(SandboxGone):
                await call


# -- best_of_n -------------------------------------------------------------------------------------
async def test_best_of_n_keeps_the_best_and_kills_the_rest(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        await src.write("/tmp/base", "10")

        async def run(child: AsyncSandbox) -> str:
            index = (await child.info()).metadata["child"]
            await child.exec(SH + [f"echo $(( $(cat /tmp/base) + {index} * 7 % 3 )) > /tmp/score"])
            return index

        found = await best_of_n(src, 3, run, "cat /tmp/score", metadata={"run": "a"})
        assert [b.score for b in found.branches] == [10.0, 11.0, 12.0]
        assert [b.result for b in found.branches] == ["0", "1", "2"]
        assert found.best.index == 2 and found.score == 12.0
        assert (await found.sandbox.info()).metadata == {"t": tag, "run": "a", "child": "2"}
        with node.client() as api:
            assert alive(api, tag) == {src.sandbox_id, found.sandbox.sandbox_id}
        await found.sandbox.kill()


def test_best_of_n_sync_face(node: Server, tag: str) -> None:
    seen: list[str] = []

    def run(child: Sandbox) -> None:
        seen.append(threading.current_thread().name)
        child.exec(SH + ["sleep 1"])

    with Client(node.url, API_KEY) as client, node.client() as api:
        src = client.create("bb", metadata={"t": tag})
        found = best_of_n(src, 3, run, lambda child: -int(child.info().metadata["child"]))  # a callable score
        assert found.best.index == 0 and [b.score for b in found.branches] == [0.0, -1.0, -2.0]
        assert isinstance(found.sandbox, Sandbox) and len(set(seen)) == 3  # each run in its own thread
        assert alive(api, tag) == {src.sandbox_id, found.sandbox.sandbox_id}
        found.sandbox.kill()


def _failing_run(child_to_fail: str, exc: BaseException) -> Any:
    async def run(child: AsyncSandbox) -> None:
        if (await child.info()).metadata["child"] == child_to_fail:
            raise exc
        await child.exec(SH + ["sleep 120"], timeout=None)  # the others are cancelled, not waited for

    return run


async def _fails(child: AsyncSandbox) -> float:
    raise KeyError("it broke")


async def _dies(child: AsyncSandbox) -> None:
    """Child 1 is killed while it runs (as if its node lost it): its next command finds it gone."""
    if (await child.info()).metadata["child"] == "1":
        await AsyncSandbox(child.client, {"sandboxID": child.sandbox_id}).kill()
    await child.exec(SH + ["true"])


FAILURES = {
    "an exception in one run": (3, _failing_run("1", RuntimeError("run broke")), "true", RuntimeError),
    "a score command that fails": (2, lambda c: None, "cat /tmp/score; exit 2", CommandFailed),
    "a score command that prints no number": (2, lambda c: None, "echo high", ValueError),
    "an exception in a score function": (2, lambda c: None, _fails, KeyError),
    "a fork that fails part way": (ROOM, lambda c: None, "cat /tmp/score", LimitExceeded),  # room for 4 of 5
    "a child that dies": (2, _dies, "cat /tmp/score", SandboxGone),
    "every child dropped": (2, _fails, "true", KeyError),
}


@pytest.mark.parametrize("failure", FAILURES)
async def test_best_of_n_leaves_no_child_behind_whatever_fails(node: Server, tag: str, failure: str) -> None:
    n, run, score, error = FAILURES[failure]
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        await src.write("/tmp/score", "1")
        on_error = "drop" if failure == "every child dropped" else "raise"
        with pytest.raises(error):
            await asyncio.wait_for(best_of_n(src, n, run, score, on_error=on_error), 30)
        with node.client() as api:
            assert alive(api, tag) == {src.sandbox_id}


async def test_best_of_n_drops_a_child_that_dies(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        await src.write("/tmp/score", "1")
        found = await best_of_n(src, 3, _dies, "cat /tmp/score", on_error="drop")  # the others win
        assert found.best.index == 0 and isinstance(found.branches[1].error, SandboxGone)
        assert [b.score for b in found.branches] == [1.0, None, 1.0]
        with node.client() as api:
            assert alive(api, tag) == {src.sandbox_id, found.sandbox.sandbox_id}
        await found.sandbox.kill()


async def test_best_of_n_cancelled_leaves_no_child_behind(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        running: list[str] = []

        async def run(child: AsyncSandbox) -> None:
            running.append(child.sandbox_id)
            await child.exec(SH + ["sleep 120"], timeout=None)

        task = asyncio.ensure_future(best_of_n(src, 3, run, "true"))
        deadline = time.monotonic() + 30
        while len(running) < 3:
            assert time.monotonic() < deadline, "the runs never started"
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # their commands are in
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with node.client() as api:
            assert alive(api, tag) == {src.sandbox_id}


def test_best_of_n_cancelled_while_it_forks_leaves_no_child_behind(node: Server, tag: str) -> None:
    """Cancelled before the fork's answer is in, and the program's loop ends right after (a
    trainer's asyncio.run returning): the children the node still makes are killed all the same."""
    with Client(node.url, API_KEY) as client, node.client() as api:
        source = client.create("bb", metadata={"t": tag}).sandbox_id

        async def cancelled_at_once() -> None:
            async with AsyncClient(node.url, API_KEY) as aclient:
                src = AsyncSandbox(aclient, {"sandboxID": source})
                task = asyncio.ensure_future(best_of_n(src, 3, lambda child: None, "true"))
                await asyncio.sleep(0.05)  # the fork's request is out, its answer not in
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(cancelled_at_once())
        # once the source is back to running its fork is over: what it made is there to see
        wait_for(lambda: api.get(f"/sandboxes/{source}").json()["aenvState"] == "running", "the fork's end")
        assert alive(api, tag) == {source}


def test_best_of_n_interrupted_in_the_sync_face_leaves_no_child_behind(node: Server, tag: str) -> None:
    """Ctrl-C in the sync face: the helper is cancelled on its loop and its kills are done before
    the KeyboardInterrupt reaches the caller (the process may end right after)."""
    with Client(node.url, API_KEY) as client, node.client() as api:
        src = client.create("bb", metadata={"t": tag})
        main = threading.main_thread().ident
        assert main is not None and threading.current_thread().ident == main
        running: list[str] = []

        def run(child: Sandbox) -> None:
            running.append(child.sandbox_id)
            child.exec(SH + ["sleep 120"], timeout=None)

        def interrupt() -> None:
            wait_for(lambda: len(running) == 3, "the runs")
            time.sleep(0.5)  # their commands are in
            signal.pthread_kill(main, signal.SIGINT)

        interrupter = threading.Thread(target=interrupt)
        # Ctrl-C as Python handles it by default: a run started in the background (`cmd &`)
        # inherits SIGINT ignored, and the interrupt would never come (seen in a CI run).
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            interrupter.start()
            with pytest.raises(KeyboardInterrupt):
                best_of_n(src, 3, run, "true")
            interrupter.join()
        finally:
            signal.signal(signal.SIGINT, previous)
        assert alive(api, tag) == {src.sandbox_id}


# -- tree_search -----------------------------------------------------------------------------------
def _stepper(fail_at: str | None = None) -> Any:
    async def step(child: AsyncSandbox, round_: int) -> str:
        branch = (await child.info()).metadata["branch"]
        if branch == fail_at:
            raise RuntimeError(f"step broke at {branch}")
        digit = int(branch.split(".")[-1])
        await child.exec(SH + [f"echo {digit} >> /tmp/path; echo $(( {round_} * 10 + {digit} )) > /tmp/score"])
        return branch

    return step


async def test_tree_search_keeps_a_beam_and_snapshots_the_rest(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        found = await tree_search(src, _stepper(), "cat /tmp/score", rounds=2, branch=2, keep=1)
        try:
            assert [[b.path for b in r] for r in found.rounds] == [["0", "1"], ["1.0", "1.1"]]
            assert [b.score for b in found.rounds[1]] == [10.0, 11.0]
            assert found.best.path == "1.1" and found.best.score == 11.0 and len(found.frontier) == 1
            best = found.best.sandbox
            assert (await best.exec(SH + ["cat /tmp/path"])).stdout == "1\n1\n"
            assert (await best.info()).metadata == {"t": tag, "round": "1", "branch": "1.1"}
            assert [(b.path, b.score) for b in found.snapshots] == [("0", 0.0), ("1.0", 10.0)]
            with node.client() as api:
                # the source, and the beam's last sandbox: the others killed (their state in snapshots)
                assert alive(api, tag) == {src.sandbox_id, best.sandbox_id}
            again = await client.create(found.snapshots[1].snapshot_id or "", metadata={"t": tag})
            assert (await again.exec(SH + ["cat /tmp/path"])).stdout == "1\n0\n"  # go on from there
            # and its log with it: the steps and scores of "1" and "1.0", then its own command
            log = await again.rollout_log()
            assert [e["seq"] for e in log] == [0, 1, 2, 3, 4] and log[-1]["sandboxID"] == again.sandbox_id
            await again.kill()
        finally:
            await best.kill()
            for b in found.snapshots:
                await client.delete_snapshot(b.snapshot_id or "")


TREE_FAILURES = {
    # in the second round's step: the first round's snapshot is deleted too
    "an exception in a step": (dict(rounds=2, branch=2, keep=1), "cat /tmp/score", RuntimeError),
    "a score command that fails": (dict(rounds=1, branch=2), "exit 1", CommandFailed),
    # a beam of 2 forking 2 each: one fork fits the node (source, beam, 2 children), one does not
    "a fork that fails part way": (dict(rounds=2, branch=2, keep=2), "cat /tmp/score", LimitExceeded),
}


@pytest.mark.parametrize("failure", TREE_FAILURES)
async def test_tree_search_leaves_nothing_behind_whatever_fails(node: Server, tag: str, failure: str) -> None:
    options, score, error = TREE_FAILURES[failure]
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        snapshots = {s["snapshotID"] for s in await client.snapshots()}
        with pytest.raises(error):
            await tree_search(src, _stepper(fail_at="1.0"), score, **options)  # type: ignore[arg-type]
        with node.client() as api:
            assert alive(api, tag) == {src.sandbox_id}
        assert {s["snapshotID"] for s in await client.snapshots()} == snapshots


async def test_tree_search_cancelled_leaves_nothing_behind(node: Server, tag: str) -> None:
    async with AsyncClient(node.url, API_KEY) as client:
        src = await client.create("bb", metadata={"t": tag})
        task = asyncio.ensure_future(tree_search(src, _sleeps, "true", rounds=2, branch=2, snapshot_rest=False))
        with node.client() as api:
            deadline = time.monotonic() + 30
            while len(alive(api, tag)) < 3:
                assert time.monotonic() < deadline, "the children never came"
                await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert alive(api, tag) == {src.sandbox_id}
        with pytest.raises(ValueError, match="rounds"):
            await tree_search(src, _stepper(), "true", rounds=0, branch=2)


async def _sleeps(child: AsyncSandbox, round_: int) -> None:
    await child.exec(SH + ["sleep 120"], timeout=None)


def test_a_rollout_log_outlives_a_node_restart(node: Server, tag: str) -> None:
    """A paused sandbox survives its node's restart, and so does its log (its numbering goes on);
    a log whose sandbox is gone is removed at the start."""
    with Client(node.url, API_KEY) as client:
        sbx = client.create("bb", metadata={"t": tag})
        sbx.exec(SH + ["echo before"])
        sbx.pause()
        stray = node.data_dir / "rollout" / "gonesandbox000000000.jsonl"
        stray.write_text('{"seq": 0}\n')
    node.restart()
    with Client(node.url, API_KEY) as client:
        sbx = client.connect(sbx.sandbox_id)
        sbx.exec(SH + ["echo after"])
        assert [(e["seq"], e["stdout"]) for e in sbx.rollout_log()] == [(0, "before\n"), (1, "after\n")]
        assert not stray.exists()
        sbx.kill()


def test_e2b_commands_are_in_the_rollout_log(server: Server, e2b_env: Server) -> None:
    """What a harness runs through E2B's SDK (commands.run, as root, in the background) is logged too."""
    from e2b import Sandbox as E2BSandbox

    sbx = E2BSandbox.create(timeout=120)
    try:
        sbx.commands.run("echo from-e2b; exit 0")
        handle = sbx.commands.run("echo background >&2", background=True, user="root")
        handle.wait()
        with Client(server.url, API_KEY) as client:
            log = client.rollout_log(sbx.sandbox_id)
        assert [(e["stdout"], e["exitCode"]) for e in log[:1]] == [("from-e2b\n", 0)]
        assert log[1]["stderr"] == "background\n" and log[1]["user"] == "root"
    finally:
        sbx.kill()


# -- the examples ----------------------------------------------------------------------------------
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(server: Server, name: str, *args: str) -> str:
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": API_KEY, "PYTHONPATH": str(EXAMPLES.parent)}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_examples_run_against_a_node(server: Server, api: httpx.Client, tmp_path: Path) -> None:
    out = _example(server, "grpo_fork.py", "--group", "4")
    rewards = [line.split()[3] for line in out.splitlines() if line.startswith("sample ") and "reward" in line]
    assert rewards == ["1.0", "0.5", "0.0", "1.0"], out
    assert "group of 4: mean reward 0.625" in out and "sample 0's rollout log: 2 commands" in out
    log = tmp_path / "best.jsonl"
    out = _example(server, "best_of_n_swe.py", "--log", str(log))
    assert "before: 2 of 5 tests pass" in out and "best: attempt 2 with 5 of 5" in out, out
    assert [line for line in out.splitlines() if line.startswith("attempt ")] == [
        "attempt 0: 2 of 5 tests pass",
        "attempt 1: 4 of 5 tests pass",
        "attempt 2: 5 of 5 tests pass",
        "attempt 3: 0 of 5 tests pass",
    ]
    entries = [json.loads(line) for line in log.read_text().splitlines()]
    assert entries[-1]["scoring"] is True and entries[-1]["stdout"].strip() == "5"
    for example in ("grpo", "best-of-n"):  # every sandbox they made is gone
        assert api.get("/v2/sandboxes", params={"metadata": f"example={example}"}).json() == []
