"""A snapshot of a running sandbox against a pause of the same sandbox, and where each one's time
goes: `python -m bench snapshot [--rounds N] [--data-dir DIR] [--out FILE]` (root, runsc).

Each round, on one sandbox that has written a few MiB: a snapshot (the source keeps running), then
a pause and a resume; the two are timed in the same round, so the ratio sees the same machine.
Each part is timed where it runs: every runsc command by its subcommand, the agent's freeze and
thaw, the upper's copy and its mount. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.templates.builder import ensure_base, run_in
from bench.__main__ import RUNSC_TIMES, _install_timer, pct

console = Console()
PARTS: dict[str, list[float]] = defaultdict(list)


def _timed(name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    async def wrapper(*args: Any, **kw: Any) -> Any:
        start = time.perf_counter()
        try:
            return await fn(*args, **kw)
        finally:
            PARTS[name].append(time.perf_counter() - start)

    return wrapper


def instrument(node: Node) -> None:
    """Time every part of a snapshot and a pause where it runs (runsc's commands: bench.__main__)."""
    _install_timer()
    files = node.instances.files
    real_copy = files.copy_upper

    def copy_upper(upper_id: str) -> str:
        start = time.perf_counter()
        try:
            return real_copy(upper_id)
        finally:
            PARTS["copy of the upper"].append(time.perf_counter() - start)

    files.copy_upper = copy_upper  # type: ignore[method-assign]
    files.mount = _timed("mount of a layer", files.mount)  # type: ignore[method-assign,assignment]


def parts() -> dict[str, list[float]]:
    return {**PARTS, **{f"runsc {k}": v for k, v in RUNSC_TIMES.items()}}


def mark() -> dict[str, int]:
    return {k: len(v) for k, v in parts().items()}


def since(m: dict[str, int]) -> dict[str, float]:
    return {k: sum(v[m.get(k, 0) :]) for k, v in parts().items() if len(v) > m.get(k, 0)}


async def timed_parts(rows: dict[str, list[float]], label: str, op: Awaitable[Any]) -> None:
    """Run ``op``; its time and its parts' go into ``rows`` under ``label``."""
    m = mark()
    start = time.perf_counter()
    await op
    rows[label].append(time.perf_counter() - start)
    for part, t in since(m).items():
        rows[f"{label}: {part}"].append(t)


async def amain(args: argparse.Namespace) -> None:
    node = Node(Settings(data_dir=args.data_dir, max_sandboxes=50))
    await node.start()
    instrument(node)
    rows: dict[str, list[float]] = defaultdict(list)
    try:
        await ensure_base(node, on_log=lambda line: console.print(f"  {line}"))
        rec = await node.create("base", SandboxSpec(timeout=3600))
        link = node.get(rec.id).link
        assert link is not None
        await run_in(link, "head -c 4M /dev/urandom > /home/user/data && python3 -c 'print(1)'", user="user")
        for r in range(args.rounds):
            await node.settle()
            await timed_parts(rows, "snapshot", node.snapshot(rec.id))
            await node.settle()
            await timed_parts(rows, "pause", node.pause(rec.id))
            await node.resume(rec.id)
            took = f"snapshot {rows['snapshot'][-1] * 1000:.0f} ms, pause {rows['pause'][-1] * 1000:.0f} ms"
            console.print(f"round {r + 1}: {took}")
        await node.kill(rec.id)
    finally:
        await node.stop(pause_running=False)
    ratios = [s / p for s, p in zip(rows["snapshot"], rows["pause"], strict=True)]
    p50 = {k: pct(v, 0.5) * 1000 for k, v in rows.items()}
    ratio = pct(ratios, 0.5)
    out = {
        "p50_ms": p50,
        "snapshot_over_pause_p50": ratio,
        "rounds": rows,
        "runtime": node.runtime_info(),
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "load": os.getloadavg()},
    }
    table = Table(title=f"snapshot against pause, {args.rounds} rounds (p50 ms)", header_style="bold")
    table.add_column("what")
    table.add_column("p50 ms", justify="right")
    for k in sorted(rows, key=lambda k: (k.split(":")[0], ":" in k, k)):
        table.add_row(k, f"{p50[k]:.1f}")
    table.add_row("snapshot / pause (median of per-round ratios)", f"{ratio:.2f}x")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    console.print(f"JSON: {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench snapshot", description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/snapshot.json"))
    asyncio.run(amain(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
