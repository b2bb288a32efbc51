"""The dashboard's routes on a real node: pages open, data behind the key, strict headers; what a
sandbox's logs and family say; failures counted by reason; a gateway's merge of its nodes' answers."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from aenv.dashboard.cluster import merge_artifacts, merge_stats
from aenv.errors import SandboxNotFound
from aenv.node import commands, metrics
from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime
DATA_ROUTES = ["/dashboard/api/nodes", "/dashboard/api/stats", "/dashboard/api/artifacts"]


def test_pages_open_data_needs_the_key(server: Server, api: httpx.Client) -> None:
    for path in ["/dashboard", "/dashboard/", "/dashboard/static/app.js", "/dashboard/static/chart.umd.min.js"]:
        r = httpx.get(server.url + path)
        assert r.status_code == 200, path
        csp = r.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert r.headers["x-content-type-options"] == "nosniff"
    for path in [*DATA_ROUTES, "/dashboard/static/../../api/app.py", "/dashboard/static/nope.js"]:
        assert httpx.get(server.url + path).status_code == 401, path
        assert httpx.get(server.url + path, headers={"X-API-Key": "wrong"}).status_code == 401, path
    assert api.get("/dashboard/static/nope.js").status_code == 404
    assert httpx.post(server.url + "/dashboard").status_code == 401  # only GET/HEAD are open
    for path in DATA_ROUTES:
        assert api.get(path).status_code == 200, path
    node = api.get("/dashboard/api/nodes").json()[0]
    assert node["status"] == "ready" and node["cacheBudgetBytes"] > 0 and node["maxSandboxes"] > 0
    artifacts = api.get("/dashboard/api/artifacts").json()
    base = next(a for a in artifacts if a["name"] == "base")
    assert base["kind"] == "template" and base["cachedOn"] == [node["nodeID"]]


def test_logs_and_family_of_a_sandbox(api: httpx.Client, e2b_env: Server) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(timeout=120)
    try:
        sbx.commands.run("true")
        handle = sbx.commands.run("sleep 30", background=True)
        forked = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
        child = forked.json()[0]["sandbox"]["sandboxID"]
        logs = api.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()
        newest, first = logs["commands"][:2]
        assert newest["cmd"].endswith("sleep 30") and newest["pid"] == handle.pid and newest["exitCode"] is None
        assert first["cmd"].endswith("true") and first["exitCode"] == 0 and first["endedAt"] >= first["startedAt"]
        lines = [entry["line"] for entry in logs["logs"]]  # what the node did with it, oldest first
        assert lines[0] == "restoring from template base" and lines[1].startswith("created in "), lines
        assert any(line.startswith("forked in ") for line in lines), lines
        assert any(line.startswith(f"fork of 1: 1 children made ({child})") for line in lines), lines
        assert all(entry["timestamp"].endswith("Z") for entry in logs["logs"]), logs["logs"]
        assert [e["message"] for e in logs["logEntries"]] == lines
        sbx.pause()
        Sandbox.connect(sbx.sandbox_id)
        lines = [entry["line"] for entry in api.get(f"/sandboxes/{sbx.sandbox_id}/logs").json()["logs"]]
        paused = next(i for i, line in enumerate(lines) if line.startswith("paused in "))
        assert any(line.startswith("resumed in ") for line in lines[paused:]), lines
        child_lines = [e["line"] for e in api.get(f"/sandboxes/{child}/logs").json()["logs"]]
        assert child_lines[0] == f"forked from {sbx.sandbox_id}", child_lines
        family = api.get(f"/sandboxes/{child}/family").json()
        assert family["ancestors"] == [sbx.sandbox_id]
        assert [(m["sandboxID"], m["parentID"]) for m in family["members"]] == [
            (sbx.sandbox_id, None),
            (child, sbx.sandbox_id),
        ]
        assert api.get(f"/sandboxes/{child}/logs").json()["commands"] == []  # a fork's history is its own
        api.delete(f"/sandboxes/{child}")
    finally:
        sbx.kill()
    for path in ("logs", "family"):
        r = api.get(f"/sandboxes/{sbx.sandbox_id}/{path}")
        assert r.status_code == 404 and r.json()["error_code"] == "sandbox_not_found"
    assert api.get(f"/sandboxes/{sbx.sandbox_id}/logs?limit=0").status_code == 400


def test_history_is_bounded() -> None:
    history = commands.CommandHistory()
    for i in range(commands.MAX_COMMANDS + 10):
        history.start({"cmd": "x" * 10_000, "args": [str(i)]}, user="u" * 1000, tag=None)
    recent = history.recent()
    assert len(recent) == commands.MAX_COMMANDS
    assert all(len(r["cmd"]) <= commands.MAX_TEXT and len(r["user"]) <= commands.MAX_TEXT for r in recent)
    record = history.start({"cmd": "sh"}, user=None, tag=None)
    record.message(b'{"event":{"end":{"exitCode":true,"status":"x"}}}')  # not an integer: no exit code
    assert record.exit_code is None
    record.message(b'{"event":{"end":{"exitCode":2,"status":"exit status 2"}}}' + b" " * commands.MAX_EVENT)
    assert record.exit_code is None  # too large to be an end event: not read
    record.message(b'{"event":{"end":{"exitCode":2,"status":"exit status 2"}}}')
    assert (record.exit_code, record.status) == (2, "exit status 2")


def test_failures_are_counted_by_reason() -> None:
    def value(reason: str) -> float:
        sample = metrics.OPERATION_FAILURES.labels(op="resume", reason=reason)
        return sample._value.get()  # type: ignore[attr-defined,no-any-return]

    before = {r: value(r) for r in ("sandbox_not_found", "timeout", "cancelled", "internal")}
    metrics.operation_failed("resume", SandboxNotFound("gone"))
    metrics.operation_failed("resume", TimeoutError())
    metrics.operation_failed("resume", asyncio.CancelledError())
    metrics.operation_failed("resume", RuntimeError("x"))
    assert {r: value(r) - before[r] for r in before} == dict.fromkeys(before, 1.0)


def test_a_gateway_adds_up_its_nodes() -> None:
    hist = {"buckets": [["0.1", 1.0], ["1.0", 3.0], ["+Inf", 4.0]], "count": 4.0, "sum": 2.0}
    a = {"at": 1.0, "operations": {"create": {"ok": 3.0}}, "failures": {}, "latency": {"create": hist}, "sandboxes": {}}
    b = {
        "at": 2.0,
        "operations": {"create": {"ok": 1.0, "error": 2.0}},
        "failures": {"create": {"timeout": 2.0}},
        "latency": {"create": hist},
        "sandboxes": {"running": 5.0},
    }
    total = merge_stats([a, b, None, "junk", {"operations": "junk", "latency": {"create": {"buckets": [[1, 2]]}}}])
    assert total["operations"]["create"] == {"ok": 4.0, "error": 2.0}
    assert total["failures"] == {"create": {"timeout": 2.0}}
    assert total["latency"]["create"]["buckets"] == [("0.1", 2.0), ("1.0", 6.0), ("+Inf", 8.0)]
    assert total["nodes"] == 3 and total["sandboxes"] == {"running": 5.0}
    base = {"id": "t1", "kind": "template", "name": "base"}
    rows = merge_artifacts(
        [
            [{**base, "committed": True, "sizeBytes": 9, "cachedOn": ["a"]}],
            [{**base, "committed": False, "sizeBytes": None, "cachedOn": ["b"]}],
            None,
        ]
    )
    assert rows == [{**base, "committed": True, "sizeBytes": 9, "cachedOn": ["a", "b"]}]
