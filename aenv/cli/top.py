"""``aenv top``: the dashboard's numbers in a terminal, for one node or a cluster (through a gateway).

Rates and latency percentiles come from two readings of the cumulative counters (``Reading``):
what happened between them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

OPS = ("create", "pause", "resume", "fork", "snapshot", "kill")
OUTCOMES = ("ok", "nonzero", "timeout", "error", "detached")  # of commands (aenv_commands_total)


@dataclass(frozen=True)
class Reading:
    at: float
    nodes: list[dict[str, Any]]
    stats: dict[str, Any]

    @classmethod
    def of(cls, overview: dict[str, Any]) -> Reading:
        return cls(time.monotonic(), overview["nodes"], overview["stats"])


def quantile(q: float, buckets: list[tuple[str, float]]) -> float | None:
    """As Prometheus' histogram_quantile: linear within the bucket the rank falls in."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        bound = float(le)
        if count >= rank:
            if math.isinf(bound):
                return lower
            return lower + (bound - lower) * (rank - below) / max(count - below, 1e-9)
        lower, below = bound, count
    return lower


def operation_rows(now: Reading, then: Reading | None) -> list[dict[str, Any]]:
    """Per operation: totals since start, and the rate and percentiles between the two readings."""
    span = now.at - then.at if then is not None else 0.0
    rows = []
    for op in OPS:
        outcomes = now.stats["operations"].get(op, {})
        total = sum(outcomes.values())
        before = sum(then.stats["operations"].get(op, {}).values()) if then is not None else total
        hist = now.stats["latency"].get(op, {"buckets": []})
        old = dict(then.stats["latency"].get(op, {"buckets": []})["buckets"]) if then is not None else {}
        window = [(le, count - old.get(le, 0.0)) for le, count in hist["buckets"]]
        rows.append(
            {
                "op": op,
                "perSecond": (total - before) / span if span > 0 else None,
                "ok": int(outcomes.get("ok", 0)),
                "failed": int(outcomes.get("error", 0)),
                **{name: quantile(q, window) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
            }
        )
    return rows


def command_row(now: Reading, then: Reading | None) -> dict[str, Any]:
    """Commands run in sandboxes: totals by outcome since start, and between the two readings the
    rate and the percentiles of their start latency (request to running in the sandbox)."""
    span = now.at - then.at if then is not None else 0.0
    outcomes = now.stats.get("commands") or {}
    total = sum(outcomes.values())
    before = sum((then.stats.get("commands") or {}).values()) if then is not None else total
    hist = now.stats.get("commandStart") or {"buckets": []}
    old = dict((then.stats.get("commandStart") or {"buckets": []})["buckets"]) if then is not None else {}
    window = [(le, count - old.get(le, 0.0)) for le, count in hist["buckets"]]
    return {
        "perSecond": (total - before) / span if span > 0 else None,
        **{outcome: int(outcomes.get(outcome, 0)) for outcome in OUTCOMES},
        **{name: quantile(q, window) for name, q in (("p50", 0.5), ("p90", 0.9), ("p99", 0.99))},
    }


def failure_rows(stats: dict[str, Any]) -> list[tuple[str, str, int]]:
    rows = [(op, reason, int(n)) for op, reasons in stats["failures"].items() for reason, n in reasons.items()]
    return sorted(rows, key=lambda r: -r[2])


def frame(url: str, now: Reading, then: Reading | None) -> Group:
    nodes = Table(title="nodes", title_justify="left", show_edge=False, header_style="bold")
    for column in ("node", "state", "running", "paused", "busy", "capacity", "load1", "cache", "uncommitted"):
        # a node's id whole (it is what `aenv nodes drain` takes); the numbers give way on a narrow terminal
        nodes.add_column(column, justify="left" if column in ("node", "state") else "right", no_wrap=column == "node")
    for n in now.nodes:
        budget = n.get("cacheBudgetBytes") or 0
        cache = f"{_mib(n.get('cacheBytes'))} / {_mib(budget)} MiB" if budget else "-"
        nodes.add_row(
            str(n.get("nodeID")),
            _state(str(n.get("status"))),
            str(n.get("running")),
            str(n.get("paused")),
            str(n.get("starting")),
            f"{n.get('running', 0) + n.get('starting', 0)}/{n.get('maxSandboxes')}",
            f"{n.get('load1')}/{n.get('cpuCount')}",
            cache,
            str(n.get("repoPending", "-")),
        )
    ops = Table(title="operations", title_justify="left", show_edge=False, header_style="bold")
    for column in ("op", "per s", "ok", "failed", "p50 s", "p90 s", "p99 s"):
        ops.add_column(column, justify="left" if column == "op" else "right")
    for row in operation_rows(now, then):
        ops.add_row(
            row["op"],
            _number(row["perSecond"]),
            str(row["ok"]),
            str(row["failed"]),
            *(_number(row[p], 3) for p in ("p50", "p90", "p99")),
        )
    commands = Table(title="commands", title_justify="left", show_edge=False, header_style="bold")
    for column in ("per s", "exit 0", "exit != 0", "timeout", "error", "detached", "start p50 s", "p90 s", "p99 s"):
        commands.add_column(column, justify="right")
    row = command_row(now, then)
    commands.add_row(
        _number(row["perSecond"]),
        *(str(row[outcome]) for outcome in OUTCOMES),
        *(_number(row[p], 3) for p in ("p50", "p90", "p99")),
    )
    parts: list[Any] = [
        Text(f"aenv top  {url}  {time.strftime('%H:%M:%S')}  ({len(now.nodes)} node(s))", style="bold"),
        nodes,
        ops,
        commands,
    ]
    failures = failure_rows(now.stats)
    if failures:
        table = Table(title="failures by reason (since start)", title_justify="left", show_edge=False)
        for column in ("op", "reason", "count"):
            table.add_column(column, justify="right" if column == "count" else "left")
        for op, reason, count in failures:
            table.add_row(op, reason, str(count))
        parts.append(table)
    return Group(*parts)


def _state(state: str) -> Text:
    return Text(state, style={"ready": "green", "draining": "yellow"}.get(state, "red"))


def _mib(value: Any) -> str:
    return f"{(value or 0) / 2**20:.0f}"


def _number(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"
