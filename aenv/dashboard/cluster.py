"""The dashboard at a gateway: the same page, its JSON gathered from every node of the cluster.

Each node is asked with the client's own API key (the node checks it again); a node that does not
answer within ``NODE_TIMEOUT`` is shown from the directory's entry, as unhealthy, and left out
of the sums.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.cluster.entries import NodeEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.nodes import node_status
from aenv.dashboard import pages
from aenv.errors import NotFound


class Gateway(Protocol):
    """What the dashboard's cluster view uses of a gateway (aenv/cluster/gateway/app.py)."""

    mirror: Mirror
    client: httpx.AsyncClient

    async def check_key(self, headers: dict[str, str]) -> Any: ...


NODE_TIMEOUT = 5.0
MAX_ANSWER = 8 * 1024 * 1024  # bytes of one node's answer


def is_dashboard(path: str) -> bool:
    return path == pages.PREFIX or path.startswith(pages.PREFIX + "/")


async def route(gateway: Gateway, request: Request) -> Response:
    path = request.url.path
    response = pages.page(path) if pages.is_page(request.method, path) else None
    if response is not None:
        return response
    await gateway.check_key({k.lower(): v for k, v in request.headers.items()})
    if request.method != "GET":
        raise _not_found(path)
    nodes = sorted(gateway.mirror.nodes.values(), key=lambda n: n.node_id)
    key = request.headers.get("x-api-key", "")
    if path == "/dashboard/api/nodes":
        answers = await _ask_all(gateway, nodes, "/dashboard/api/nodes", key)
        return JSONResponse([_node_row(entry, answer) for entry, answer in zip(nodes, answers, strict=True)])
    if path == "/dashboard/api/stats":
        return JSONResponse(merge_stats([a for a in await _ask_all(gateway, nodes, path, key) if a is not None]))
    if path == "/dashboard/api/artifacts":
        return JSONResponse(merge_artifacts([a for a in await _ask_all(gateway, nodes, path, key) if a is not None]))
    raise _not_found(path)


def _not_found(path: str) -> NotFound:
    return NotFound(f"no dashboard route {path[:120]!r}")


async def _ask_all(gateway: Gateway, nodes: list[NodeEntry], path: str, key: str) -> list[Any]:
    return list(await asyncio.gather(*(_ask(gateway.client, node, path, key) for node in nodes)))


async def _ask(client: httpx.AsyncClient, node: NodeEntry, path: str, key: str) -> Any:
    """The node's JSON answer, or None when it has none to give in time."""
    try:
        async with asyncio.timeout(NODE_TIMEOUT):
            r = await client.get(node.address + path, headers={"x-api-key": key})
    except (httpx.HTTPError, TimeoutError):
        return None
    if r.status_code != 200 or len(r.content) > MAX_ANSWER:
        return None
    try:
        return r.json()
    except ValueError:
        return None


def _node_row(entry: NodeEntry, answer: Any) -> dict[str, Any]:
    """The node's own summary where it gave one, with the directory's word on its state."""
    row: dict[str, Any] = {
        "running": entry.running,
        "paused": entry.paused,
        "starting": entry.starting,
        "maxSandboxes": entry.max_sandboxes,
        "load1": entry.load1,
        "cpuCount": entry.cpu_count,
        "version": entry.version,
        "driver": entry.driver,
        "startedAt": entry.started_at,
    }
    if isinstance(answer, list) and answer and isinstance(answer[0], dict):
        row.update(answer[0])
    row["nodeID"] = entry.node_id
    row["address"] = entry.address
    row["status"] = "unhealthy" if answer is None else node_status(entry)  # E2B's words, as GET /nodes
    return row


def merge_stats(answers: list[Any]) -> dict[str, Any]:
    """The nodes' counters added up (their histograms have the same buckets: the same code)."""
    total: dict[str, Any] = {
        "at": 0.0,
        "nodes": 0,
        "operations": {},
        "failures": {},
        "latency": {},
        "sandboxes": {},
        "commands": {},
        "commandStart": {"buckets": {}, "count": 0.0, "sum": 0.0},
    }
    for answer in answers:
        if not isinstance(answer, dict):
            continue
        total["nodes"] += 1
        total["at"] = max(total["at"], _number(answer.get("at")))
        for part in ("operations", "failures"):
            for op, values in _mapping(answer.get(part)).items():
                into = total[part].setdefault(op, {})
                for label, value in _mapping(values).items():
                    into[label] = into.get(label, 0.0) + _number(value)
        for part in ("sandboxes", "commands"):
            for label, value in _mapping(answer.get(part)).items():
                total[part][label] = total[part].get(label, 0.0) + _number(value)
        _add_histogram(total["commandStart"], _mapping(answer.get("commandStart")))
        for op, hist in _mapping(answer.get("latency")).items():
            _add_histogram(total["latency"].setdefault(op, {"buckets": {}, "count": 0.0, "sum": 0.0}), _mapping(hist))
    for hist in [*total["latency"].values(), total["commandStart"]]:
        hist["buckets"] = sorted(hist["buckets"].items(), key=lambda b: float(b[0]))
    return total


def _add_histogram(into: dict[str, Any], hist: dict[str, Any]) -> None:
    into["count"] += _number(hist.get("count"))
    into["sum"] += _number(hist.get("sum"))
    buckets = hist.get("buckets")
    for bucket in buckets if isinstance(buckets, list) else []:
        if isinstance(bucket, list) and len(bucket) == 2 and isinstance(bucket[0], str) and _is_bound(bucket[0]):
            into["buckets"][bucket[0]] = into["buckets"].get(bucket[0], 0.0) + _number(bucket[1])


def merge_artifacts(answers: list[Any]) -> list[dict[str, Any]]:
    """One row per template or snapshot, with every node that has it cached."""
    rows: dict[str, dict[str, Any]] = {}
    for answer in answers:
        for item in answer if isinstance(answer, list) else []:
            if not isinstance(item, dict) or not isinstance(item.get("id"), str):
                continue
            row = rows.setdefault(item["id"], {**item, "cachedOn": []})
            row["committed"] = bool(row.get("committed")) or bool(item.get("committed"))
            row["sizeBytes"] = row.get("sizeBytes") or item.get("sizeBytes")
            cached = item.get("cachedOn")
            row["cachedOn"] += [n for n in cached if isinstance(n, str)] if isinstance(cached, list) else []
    return sorted(rows.values(), key=lambda r: (str(r.get("kind")), str(r.get("name"))))


def _mapping(value: Any) -> dict[str, Any]:
    return {str(k): v for k, v in value.items()} if isinstance(value, dict) else {}


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else 0.0


def _is_bound(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True
