"""Commands run in sandboxes, counted by how they ended and timed to their start, on the session's
small busybox node (its counters move only with what the test does): /metrics, the dashboard's
stats, ``aenv top``'s table and a gateway's sum of its nodes. Seen failing before the counters
existed (no aenv_commands_total, no ``commands`` in the stats)."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from aenv.cli.top import Reading, command_row
from aenv.dashboard.cluster import merge_stats
from aenv.sdk import AenvError, Client, OperationTimeout
from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime
SH = ["/bin/sh", "-c"]
OUTCOMES = ("ok", "nonzero", "timeout", "error", "detached")


@pytest.fixture()
def node(small_node: Server) -> Server:
    return small_node


def scrape(node: Server) -> dict[str, float]:
    """The command series of the node's /metrics: outcome counts and the start histogram's count."""
    text = httpx.get(f"{node.url}/metrics", timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "aenv_commands_total":
                values[sample.labels["outcome"]] = sample.value
            elif sample.name == "aenv_command_start_seconds_count":
                values["started"] = sample.value
            elif sample.name == "aenv_command_start_seconds_bucket" and sample.labels["le"] == "30.0":
                values["within 30 s"] = sample.value
    return values


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def detach(node: Server, sandbox_id: str, token: str) -> None:
    """Start ``sleep 30`` and leave after its first message (the start event), as a client that
    stops following a command does."""
    body = b'{"process": {"cmd": "/bin/sleep", "args": ["30"]}}'
    frame = bytes([0]) + len(body).to_bytes(4, "big") + body
    headers = {
        "E2b-Sandbox-Id": sandbox_id,
        "E2b-Sandbox-Port": "49983",
        "X-Access-Token": token,
        "Content-Type": "application/connect+json",
        "Connect-Protocol-Version": "1",
    }
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{node.url}/process.Process/Start", content=frame, headers=headers) as r,
    ):
        assert r.status_code == 200
        next(r.iter_bytes())


def test_commands_are_counted_by_outcome_and_timed(node: Server) -> None:
    before = scrape(node)
    assert set(OUTCOMES) <= set(before), before  # every outcome is exported from the start
    with node.client() as api, Client(node.url, API_KEY) as client:
        created = api.post("/v2/sandboxes", json={"templateID": "bb", "timeout": 300}).json()
        sbx = client.connect(created["sandboxID"])
        try:
            then = Reading.of(client.overview())
            codes = [sbx.exec([*SH, f"exit {code}"]).exit_code for code in (0, 0, 3, 0, 1)]
            assert codes == [0, 0, 3, 0, 1]
            with pytest.raises(OperationTimeout):
                sbx.exec([*SH, "sleep 30"], timeout=1)
            with pytest.raises(AenvError):  # it never starts: no such directory
                sbx.exec(["/bin/true"], cwd="/no/such/dir")
            detach(node, sbx.sandbox_id, created["envdAccessToken"])
            expected = {"ok": 3, "nonzero": 2, "timeout": 1, "error": 1, "detached": 1, "started": 7}
            deadline = time.monotonic() + 10  # the node sees the client leave on its next write
            while delta(scrape(node), before)["detached"] < 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            moved = delta(scrape(node), before)
            assert moved == {**expected, "within 30 s": 7}, moved
            now = Reading.of(client.overview())
        finally:
            sbx.kill()
    # the dashboard's stats say the same, and so does aenv top's table between two readings
    stats = now.stats
    assert {o: stats["commands"][o] - then.stats["commands"][o] for o in OUTCOMES} == {
        o: float(expected[o]) for o in OUTCOMES
    }
    assert stats["commandStart"]["count"] - then.stats["commandStart"]["count"] == 7
    assert dict(stats["commandStart"]["buckets"])["+Inf"] == stats["commandStart"]["count"]
    row = command_row(now, then)
    assert {o: row[o] for o in OUTCOMES} == {o: int(stats["commands"][o]) for o in OUTCOMES}
    assert row["perSecond"] is not None and row["perSecond"] > 0
    assert row["p50"] is not None and 0 < row["p50"] <= row["p99"] <= 30
    # a gateway adds its nodes' up (a node that gave junk is left out of the sums)
    total = merge_stats([stats, stats, {"commands": "junk", "commandStart": {"buckets": [[1, 2]]}}])
    assert total["commands"] == {o: 2 * stats["commands"][o] for o in OUTCOMES}
    assert total["commandStart"]["count"] == 2 * stats["commandStart"]["count"]
    assert total["commandStart"]["buckets"] == [(le, 2 * n) for le, n in stats["commandStart"]["buckets"]]


def _counts() -> dict[str, float]:
    from prometheus_client import REGISTRY

    return {
        s.labels["outcome"]: s.value
        for family in REGISTRY.collect()
        for s in family.samples
        if s.name == "aenv_commands_total"
    }


def test_what_a_sandbox_says_moves_only_its_own_outcome() -> None:
    """The exit code and the end's error come from the sandbox's agent (root in a sandbox can speak
    for it): whatever they say, each command is counted once under one of the five outcomes, and no
    other series appears. Seen failing before the counters existed."""
    from aenv.channel import StreamError
    from aenv.node.commands import CommandHistory

    history = CommandHistory()
    before = _counts()
    hostile_ends = [
        b'{"event":{"end":{"exitCode":"0"}}}',  # a string
        b'{"event":{"end":{"exitCode":true}}}',  # a boolean
        b'{"event":{"end":{"exitCode":1e400}}}',  # not an integer
        b'{"event":{"end":[1,2]}}',
        b'{"event":{"end":{"exitCode":0,"status":"' + b"x" * 5000 + b'"}}}',  # past what is read
        b'not json at all, but with "end" in it',
    ]
    for end in hostile_ends:
        record = history.start({"cmd": "/bin/true"}, user=None, tag=None)
        record.started({"event": {"start": {"pid": "1; rm -rf /"}}})
        record.message(end)
        record.ended(None)
        record.ended(None)  # an END twice, and a client that leaves after: still counted once
        record.detached()
        assert record.outcome == "error" and record.exit_code is None and record.pid is None
    lying = history.start({"cmd": "/bin/false"}, user=None, tag=None)
    lying.message(b'{"event":{"end":{"exitCode":0}}}')
    lying.ended(StreamError('no-such-code\n{outcome="x"}', "x" * 100_000))
    assert lying.outcome == "error" and lying.error is not None and len(lying.error) <= 512
    after = _counts()
    assert set(after) == set(OUTCOMES)
    assert {o: after[o] - before.get(o, 0.0) for o in OUTCOMES} == {
        "ok": 0,
        "nonzero": 0,
        "timeout": 0,
        "error": len(hostile_ends) + 1,
        "detached": 0,
    }
