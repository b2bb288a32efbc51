"""aenv benchmarks: `python -m bench [--rounds N] [--data-dir DIR] [--out FILE]` (root, runsc).

Measures, on this machine, the node's lifecycle operations against baselines taken in the same
run: the raw `runsc restore` / `runsc checkpoint` commands inside those very operations, and a
bare process spawn measured inside a sandbox. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aenv.channel import END
from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.runtime import hostexec
from aenv.templates.builder import ensure_base, run_in

console = Console()
RUNSC_TIMES: dict[str, list[float]] = defaultdict(list)
RUNSC_SUBCOMMANDS = ("restore", "checkpoint", "run", "delete", "pause", "resume")
_real_run = hostexec.run


async def _timed_run(argv: Any, **kw: Any) -> str:
    """Record how long each runsc subcommand takes: the raw baseline inside every operation."""
    start = time.perf_counter()
    try:
        return await _real_run(argv, **kw)
    finally:
        if Path(argv[0]).name == "runsc":
            sub = next((a for a in argv[1:] if a in RUNSC_SUBCOMMANDS), "other")
            RUNSC_TIMES[sub].append(time.perf_counter() - start)


def _install_timer() -> None:
    import aenv.runtime.gvisor as gvisor

    gvisor.hostexec.run = _timed_run  # type: ignore[assignment]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def summary(values: list[float]) -> dict[str, float]:
    return {
        "n": len(values),
        "p50_ms": pct(values, 0.5) * 1000,
        "p95_ms": pct(values, 0.95) * 1000,
        "mean_ms": statistics.fmean(values) * 1000,
    }


def machine() -> dict[str, Any]:
    """What a result was measured on."""
    return {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}


def write_results(out: Path, results: dict[str, Any]) -> None:
    """A bench's results as JSON at ``out`` (its directory made), said on the console."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {out}")


async def timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await fn()
    return time.perf_counter() - start, result


def runsc_since(mark: dict[str, int], sub: str) -> list[float]:
    return RUNSC_TIMES[sub][mark.get(sub, 0) :]


def mark() -> dict[str, int]:
    return {k: len(v) for k, v in RUNSC_TIMES.items()}


def pss_of(instance_id: str) -> tuple[int, int]:
    """(PSS bytes, process count) of every host process serving one instance.

    That is runsc's sandbox and gofer processes (named by the instance id on their command
    line) and all their descendants: the ptrace platform's stub processes hold guest memory.
    """
    return pss_where(lambda cmdline: instance_id.encode() in cmdline)


def pss_where(match: Callable[[bytes], bool]) -> tuple[int, int]:
    """(PSS bytes, process count) of the host processes whose command line ``match`` takes, and
    all their descendants."""
    parents: dict[int, list[int]] = {}
    roots = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
            if match(Path(f"/proc/{entry}/cmdline").read_bytes()):
                roots.append(int(entry))
        except OSError:
            continue
    total, count, todo, seen = 0, 0, roots, set()
    while todo:
        pid = todo.pop()
        if pid in seen:  # a root that descends from another root
            continue
        seen.add(pid)
        todo.extend(parents.get(pid, []))
        try:
            for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    count += 1
        except OSError:
            continue
    return total, count


async def exec_true(link: Any) -> None:
    # What both SDKs send for a command: no stdin stream unless asked for.
    params = {"process": {"cmd": "/bin/true", "args": []}, "user": "user", "stdin": False}
    stream = await link.open("process.start", params)
    while (await stream.recv()).kind != END:
        pass


BARE_SPAWN = """
import subprocess, time, json
ts = []
for _ in range(15):
    t = time.perf_counter(); subprocess.run(["/bin/true"]); ts.append(time.perf_counter() - t)
print(json.dumps(ts[3:]))
"""


async def exec_round_trips(link: Any, blocks: int = 6) -> tuple[list[float], list[float]]:
    """Ours and the bare spawn, in alternating blocks so that both see the same moments of this
    machine (a lone block of either moves by several ms from one minute to the next)."""
    ours: list[float] = []
    bare: list[float] = []
    for _ in range(3):
        await exec_true(link)  # warm-up
    for _ in range(blocks):
        for _ in range(12):
            dt, _ = await timed(lambda: exec_true(link))
            ours.append(dt)
        ran = await run_in(link, f"python3 - <<'EOF'\n{BARE_SPAWN}\nEOF", user="user")
        if ran.code == 0:
            bare += json.loads(ran.output.strip().splitlines()[-1])
    return ours, bare


async def bench(node: Node, rounds: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    console.print(f"[bold]create from template[/bold] x{rounds}")
    creates, runsc_restore, sandboxes = [], [], []
    for _ in range(rounds):
        m = mark()
        await node.settle()
        dt, rec = await timed(lambda: node.create("base", SandboxSpec(timeout=3600)))
        creates.append(dt)
        runsc_restore += runsc_since(m, "restore")
        sandboxes.append(rec.id)
    results["create"] = {**summary(creates), "baseline": "runsc restore", **_ratio(creates, runsc_restore)}

    sb = node.get(sandboxes[0])
    console.print("[bold]exec round trip[/bold] (`true`)")
    rts, bare = await exec_round_trips(sb.link)
    results["exec_true"] = {
        **summary(rts),
        "baseline": "bare spawn in sandbox",
        "baseline_p50_ms": pct(bare, 0.5) * 1000,
    }
    results["exec_true"]["delta_p50_ms"] = results["exec_true"]["p50_ms"] - results["exec_true"]["baseline_p50_ms"]

    console.print("[bold]idle memory[/bold]")
    await asyncio.sleep(8)  # the agent releases the sentry's restore garbage after 2 s of quiet (aenv/guest/sentry.py)
    pss = []
    for sid in sandboxes:
        s = node.get(sid)
        assert s.instance is not None
        pss.append(pss_of(s.instance.id)[0])
    results["idle_pss_running"] = {"n": len(pss), "p50_mib": pct(pss, 0.5) / 2**20, "p95_mib": pct(pss, 0.95) / 2**20}

    console.print(f"[bold]pause / resume[/bold] x{rounds}")
    pauses, resumes, ck, rs = [], [], [], []
    paused_pss = []
    for sid in sandboxes:
        m = mark()
        instance_id = node.get(sid).instance.id  # type: ignore[union-attr]
        dt, _ = await timed(lambda sid=sid: node.pause(sid))
        pauses.append(dt)
        ck += runsc_since(m, "checkpoint")
        await node.settle()  # the instance is deleted in the background after the checkpoint
        paused_pss.append(pss_of(instance_id))
    for sid in sandboxes:
        m = mark()
        dt, _ = await timed(lambda sid=sid: node.resume(sid))
        resumes.append(dt)
        rs += runsc_since(m, "restore")
    results["pause"] = {**summary(pauses), "baseline": "runsc checkpoint", **_ratio(pauses, ck)}
    results["resume"] = {**summary(resumes), "baseline": "runsc restore", **_ratio(resumes, rs)}
    results["idle_pss_paused"] = {
        "n": len(paused_pss),
        "max_mib": max(p for p, _ in paused_pss) / 2**20,
        "host_processes": max(c for _, c in paused_pss),
    }

    console.print(f"[bold]snapshot[/bold] x{rounds}")
    snaps, raw_snaps = [], []
    for sid in sandboxes:
        m = mark()
        dt, _ = await timed(lambda sid=sid: node.snapshot(sid))
        snaps.append(dt)
        raw_snaps.append(sum(runsc_since(m, "checkpoint")) + sum(runsc_since(m, "restore")))
    # a snapshot keeps the source running: one checkpoint that leaves it running (runsc 20221219:
    # one that stops it, then one restore of the source)
    baseline = "runsc checkpoint" + ("" if node.driver.leaves_running else " + restore")
    results["snapshot"] = {**summary(snaps), "baseline": baseline, **_ratio(snaps, raw_snaps)}

    fork_rounds = max(3, rounds // 3)
    for n in (8, 16):
        console.print(f"[bold]fork of {n}[/bold] x{fork_rounds}")
        totals, raw = [], []
        for _ in range(fork_rounds):
            await quiesce(node)
            m = mark()
            dt, res = await timed(lambda n=n: node.fork(sandboxes[0], count=n))
            totals.append(dt)
            restores = runsc_since(m, "restore")
            raw.append(sum(runsc_since(m, "checkpoint")) + (max(restores) if restores else 0))
            assert all(r.sandbox for r in res), [r.error for r in res]
            for r in res:
                await node.kill(r.sandbox.id)  # type: ignore[union-attr]
        per_child = [t / n for t in totals]
        results[f"fork_{n}"] = {
            **summary(totals),
            "per_child_p50_ms": pct(per_child, 0.5) * 1000,
            "per_child_p95_ms": pct(per_child, 0.95) * 1000,
            "baseline": "1 runsc checkpoint + slowest of N+1 concurrent runsc restores",
            "baseline_p50_ms": pct(raw, 0.5) * 1000,
            "ratio_p50": pct(totals, 0.5) / pct(raw, 0.5),
        }
    for sid in sandboxes:
        await node.kill(sid)
    return results


async def quiesce(node: Node) -> None:
    """Keep measurements apart: old instances torn down, background repository commits done and
    the spare uppers refilled, as they are between forks that a rollout's work keeps seconds apart."""
    await node.settle()
    await node.artifacts.wait_all()
    await node.files.spares_ready()


def _ratio(ours: list[float], raw: list[float]) -> dict[str, float]:
    return {
        "baseline_p50_ms": pct(raw, 0.5) * 1000,
        "ratio_p50": pct(ours, 0.5) / pct(raw, 0.5) if raw else float("nan"),
    }


def render(results: dict[str, Any]) -> None:
    table = Table(title="aenv on this machine", header_style="bold")
    for col in ("operation", "p50 ms", "p95 ms", "baseline", "baseline p50 ms", "ratio / delta"):
        table.add_column(col)
    for name, r in results.items():
        if not isinstance(r, dict) or "p50_ms" not in r:
            continue
        if "ratio_p50" in r:
            rel = f"{r['ratio_p50']:.2f}x"
        elif "delta_p50_ms" in r:
            rel = f"+{r['delta_p50_ms']:.1f} ms"
        else:
            rel = ""
        table.add_row(
            name,
            f"{r['p50_ms']:.1f}",
            f"{r['p95_ms']:.1f}",
            r.get("baseline", ""),
            f"{r.get('baseline_p50_ms', float('nan')):.1f}",
            rel,
        )
        if "per_child_p50_ms" in r:
            table.add_row(
                f"  {name} per child", f"{r['per_child_p50_ms']:.1f}", f"{r['per_child_p95_ms']:.1f}", "", "", ""
            )
    idle = results["idle_pss_running"]
    table.add_row("idle PSS, running (MiB)", f"{idle['p50_mib']:.1f}", f"{idle['p95_mib']:.1f}", "", "", "")
    paused = results["idle_pss_paused"]
    table.add_row(
        "idle PSS, paused (MiB)", f"{paused['max_mib']:.1f}", "", f"{paused['host_processes']} host processes", "", ""
    )
    console.print(table)


async def amain(args: argparse.Namespace) -> None:
    _install_timer()
    node = Node(Settings(data_dir=args.data_dir, max_sandboxes=100, max_fork=16))
    await node.start()
    try:
        await ensure_base(node, on_log=lambda line: console.print(f"  {line}"))
        results = await bench(node, args.rounds)
    finally:
        await node.stop(pause_running=False)
    results["machine"] = machine()
    results["runtime"] = node.runtime_info()
    render(results)
    write_results(args.out, results)


def main() -> None:
    if sys.argv[1:2] == ["workload"]:  # the execution tax, phase by phase against native
        from bench.workload import main as workload

        return workload(sys.argv[2:])
    if sys.argv[1:2] == ["desktop"]:  # desktop sandboxes through E2B's Desktop SDK
        from bench.desktop import main as desktop

        return desktop(sys.argv[2:])
    if sys.argv[1:2] == ["microvm"]:  # the lifecycle on each driver, gVisor and QEMU microVMs
        from bench.microvm import main as microvm

        return microvm(sys.argv[2:])
    if sys.argv[1:2] == ["snapshot"]:  # a snapshot against a pause, part by part
        from bench.snapshot import main as snapshot

        return snapshot(sys.argv[2:])
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/latest.json"))
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
