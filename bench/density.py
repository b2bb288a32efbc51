"""Density: `python -m bench.density [--sandboxes 400] [--data-dir DIR] [--out FILE]` (root, runsc).

N sandboxes of `base` on one node, left idle, as an RL fleet leaves them while its model thinks.
Measures, against the same node with 1 sandbox in the same run: host memory (PSS) per idle
sandbox, the CPU the node and its sandboxes' host processes take while all are idle (other work
on the machine not counted), awake and then dozing (aenv/node/doze.py: frozen on the host once
quiet), the first exec on a dozing sandbox against one on an awake one, the exec round trip on one
sandbox at N against at 1, and the time to pause all N and to resume them. Creates stop at the
first failure, which is reported (what broke first: descriptors, tasks, loop devices, mounts...).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import resource
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.runtime import hostexec
from aenv.templates.builder import ensure_base
from bench.__main__ import exec_true, pct, pss_of, timed

console = Console()
IDLE_SETTLE = 8.0  # the agent hands restore garbage back after 2 s of quiet (aenv/guest/sentry.py)
CPU_WINDOW = 10.0


def cpu_seconds(marker: bytes) -> tuple[float, float]:
    """CPU seconds used so far by this process (the node) and every host process serving its
    sandboxes: runsc's (their command lines name the node's data dir) and their descendants
    (the ptrace platform's stubs). Other work on the machine is not counted."""
    parents: dict[int, list[int]] = {}
    todo = [os.getpid()]
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if marker in (entry / "cmdline").read_bytes():
                todo.append(int(entry.name))
        except OSError:
            continue
        stats[int(entry.name)] = fields
        parents.setdefault(int(fields[1]), []).append(int(entry.name))
    seen: set[int] = set()
    ticks = 0
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        ticks += int(stats[pid][11]) + int(stats[pid][12])  # utime + stime
        todo.extend(parents.get(pid, []))
    mine = stats.get(os.getpid())
    node = int(mine[11]) + int(mine[12]) if mine else 0
    hz = os.sysconf("SC_CLK_TCK")
    return node / hz, (ticks - node) / hz


async def idle_cpu_share(node: Node, window: float = CPU_WINDOW) -> dict[str, float]:
    """Cores the node process and its sandboxes' host processes keep busy over ``window``
    seconds while nothing is asked of them."""
    marker = str(node.settings.data_dir).encode()
    node_before, sandboxes_before = cpu_seconds(marker)
    await asyncio.sleep(window)
    node_after, sandboxes_after = cpu_seconds(marker)
    return {
        "node": (node_after - node_before) / window,
        "sandboxes": (sandboxes_after - sandboxes_before) / window,
        "total": (node_after + sandboxes_after - node_before - sandboxes_before) / window,
    }


async def quiet(node: Node, below: float = 0.05, within: float = 90.0) -> None:
    """Until the node and its sandboxes' processes keep less than ``below`` cores busy over 2 s
    (a mass pause's teardowns go on after its calls return), at most ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and (await idle_cpu_share(node, 2.0))["total"] >= below:
        pass


async def exec_p50(node: Node, sandbox_id: str, rounds: int = 200) -> float:
    link = node.get(sandbox_id).link
    for _ in range(3):
        await exec_true(link)
    times = []
    for _ in range(rounds):
        dt, _ = await timed(lambda: exec_true(link))
        times.append(dt)
    return pct(times, 0.5) * 1000


def host_counts() -> dict[str, int]:
    """What a node at scale runs short of first."""
    mounts = Path("/proc/self/mounts").read_text().count("\n")
    loops = sum(1 for d in Path("/sys/block").iterdir() if d.name.startswith("loop") and (d / "loop").exists())
    tasks = sum(1 for d in Path("/proc").iterdir() if d.name.isdigit())
    fds = len(os.listdir("/proc/self/fd"))
    return {"mounts": mounts, "loop_devices": loops, "host_processes": tasks, "node_fds": fds}


async def concurrently(ids: list[str], op: Any, label: str, limit: int) -> tuple[float, list[str]]:
    """Run ``op`` on every id, ``limit`` at a time, with a progress bar; seconds and failures."""
    gate = asyncio.Semaphore(limit)
    failures: list[str] = []
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(label, total=len(ids))

        async def one(sandbox_id: str) -> None:
            async with gate:
                try:
                    await op(sandbox_id)
                except Exception as exc:  # reported, not raised: the bench says what broke
                    failures.append(f"{sandbox_id}: {exc!r}"[:300])
                progress.advance(task)

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in ids))
    return time.perf_counter() - started, failures


async def doze_all(node: Node, ids: list[str], after: float, within: float = 120.0) -> float:
    """Turn dozing on and wait until every sandbox dozes; seconds that took."""
    node.settings.doze_after = after
    started = time.perf_counter()
    while time.perf_counter() - started < within:
        if all(node.is_dozing(node.get(i)) for i in ids):
            break
        await asyncio.sleep(0.5)
    return time.perf_counter() - started


async def first_exec_ms(node: Node, ids: list[str]) -> list[float]:
    """The round trip of one exec on each sandbox, one after the other."""
    times = []
    for sandbox_id in ids:
        link = node.get(sandbox_id).link
        dt, _ = await timed(lambda link=link: exec_true(link))
        times.append(dt * 1000)
    return times


async def bench(node: Node, count: int, parallel: int, doze_after: float = 10.0) -> dict[str, Any]:
    node.settings.doze_after = 0  # awake first: what an idle sentry costs, then what dozing saves
    results: dict[str, Any] = {"sandboxes_asked": count}
    first = await node.create("base", SandboxSpec(timeout=7200))
    await asyncio.sleep(IDLE_SETTLE)
    results["one"] = {
        "exec_p50_ms": await exec_p50(node, first.id),
        "idle_cpu_cores": await idle_cpu_share(node),
        "pss_mib": pss_of(node.get(first.id).instance.id)[0] / 2**20,  # type: ignore[union-attr]
    }
    ids = [first.id]
    created_at = time.perf_counter()
    failure = ""
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task(f"creating {count} sandboxes", total=count, completed=1)
        while len(ids) < count:
            try:
                batch = await asyncio.gather(
                    *(node.create("base", SandboxSpec(timeout=7200)) for _ in range(min(parallel, count - len(ids))))
                )
            except Exception as exc:
                failure = repr(exc)[:500]
                console.print(f"[red]create failed at {len(ids)} sandboxes:[/red] {failure}")
                break
            ids += [rec.id for rec in batch]
            progress.update(task, completed=len(ids))
    results["created"] = len(ids)
    results["create_seconds"] = time.perf_counter() - created_at
    results["first_failure"] = failure
    results["host_at_n"] = host_counts()
    await asyncio.sleep(IDLE_SETTLE)
    pss = [pss_of(node.get(i).instance.id)[0] for i in ids]  # type: ignore[union-attr]
    results["at_n"] = {
        "exec_p50_ms": await exec_p50(node, first.id),
        "idle_cpu_cores": await idle_cpu_share(node),
        "pss_p50_mib": pct(pss, 0.5) / 2**20,
        "pss_total_gib": sum(pss) / 2**30,
        "node_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    results["exec_ratio_n_to_1"] = results["at_n"]["exec_p50_ms"] / results["one"]["exec_p50_ms"]
    sample = ids[1 : 1 + min(50, len(ids) - 1)] or ids
    awake_first = await first_exec_ms(node, sample)
    seconds = await doze_all(node, ids, doze_after)
    dozing = sum(1 for i in ids if node.is_dozing(node.get(i)))
    cpu = await idle_cpu_share(node)
    woken = await first_exec_ms(node, sample)
    results["dozing"] = {
        "doze_after_s": doze_after,
        "dozing": dozing,
        "all_dozing_after_s": seconds,
        "idle_cpu_cores": cpu,
        "exec_awake_p50_ms": pct(awake_first, 0.5),
        "exec_woken_p50_ms": pct(woken, 0.5),
        "exec_woken_p99_ms": pct(woken, 0.99),
        "woken_sampled": len(woken),
    }
    pause_s, pause_failures = await concurrently(ids, node.pause, f"pausing {len(ids)}", parallel)
    results["pause_all"] = {"seconds": pause_s, "failures": pause_failures[:10], "failed": len(pause_failures)}
    await node.settle()
    await node.artifacts.wait_all()  # the pauses' repository commits: not what an idle node costs
    await quiet(node)  # and the teardown of their instances
    results["paused_idle_cpu_cores"] = await idle_cpu_share(node)
    resume_s, resume_failures = await concurrently(ids, node.resume, f"resuming {len(ids)}", parallel)
    results["resume_all"] = {"seconds": resume_s, "failures": resume_failures[:10], "failed": len(resume_failures)}
    await concurrently(ids, node.kill, f"removing {len(ids)}", parallel)
    return results


def render(r: dict[str, Any]) -> None:
    table = Table(title=f"{r['created']} idle sandboxes on one node", header_style="bold")
    for col in ("measure", "at 1", f"at {r['created']}", "ratio / note"):
        table.add_column(col)
    one, many = r["one"], r["at_n"]
    ratio = f"{r['exec_ratio_n_to_1']:.2f}x"
    table.add_row("exec `true` p50 ms", f"{one['exec_p50_ms']:.1f}", f"{many['exec_p50_ms']:.1f}", ratio)
    table.add_row("idle PSS per sandbox MiB", f"{one['pss_mib']:.1f}", f"{many['pss_p50_mib']:.1f}", "p50")
    for part in ("total", "node", "sandboxes"):
        table.add_row(
            f"CPU while idle: {part} (cores)",
            f"{one['idle_cpu_cores'][part]:.3f}",
            f"{many['idle_cpu_cores'][part]:.3f}",
            "the node process" if part == "node" else "",
        )
    dz = r.get("dozing")
    if dz:
        cpu = dz["idle_cpu_cores"]
        note = f"{dz['dozing']} of {r['created']} dozing {dz['all_dozing_after_s']:.0f} s after AENV_DOZE_AFTER"
        table.add_row("CPU while idle, dozing: total (cores)", "", f"{cpu['total']:.3f}", note)
        table.add_row("  node / sandboxes (cores)", "", f"{cpu['node']:.3f} / {cpu['sandboxes']:.3f}", "")
        table.add_row(
            "first exec: awake / dozing, p50 ms",
            "",
            f"{dz['exec_awake_p50_ms']:.1f} / {dz['exec_woken_p50_ms']:.1f}",
            f"woken p99 {dz['exec_woken_p99_ms']:.1f} ms",
        )
    table.add_row("PSS of all sandboxes GiB", "", f"{many['pss_total_gib']:.2f}", "")
    table.add_row("pause all, s", "", f"{r['pause_all']['seconds']:.1f}", f"{r['pause_all']['failed']} failed")
    table.add_row("CPU, all paused: total (cores)", "", f"{r['paused_idle_cpu_cores']['total']:.3f}", "")
    table.add_row("resume all, s", "", f"{r['resume_all']['seconds']:.1f}", f"{r['resume_all']['failed']} failed")
    table.add_row("create all, s", "", f"{r['create_seconds']:.1f}", r["first_failure"][:60] or "no failure")
    console.print(table)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    node = Node(Settings(data_dir=args.data_dir, max_sandboxes=args.sandboxes + 10, memory_mb=args.memory_mb))
    await node.start()
    try:
        await ensure_base(node, on_log=lambda line: console.print(f"  {line}"))
        results = await bench(node, args.sandboxes, args.parallel, args.doze_after)
    finally:
        await node.stop(pause_running=False)
    results["machine"] = {
        "cpus": os.cpu_count(),
        "memory_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
        "kernel": platform.release(),
        "python": platform.python_version(),
    }
    results["runsc_version"] = (await hostexec.run([node.settings.runsc, "--version"], check=False)).splitlines()[0]
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {args.out}")
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.density", description=__doc__)
    parser.add_argument("--sandboxes", type=int, default=400)
    parser.add_argument("--parallel", type=int, default=8, help="creates, pauses and resumes at once")
    parser.add_argument("--memory-mb", type=int, default=512, help="memory limit of each sandbox")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--doze-after", type=float, default=10.0, help="AENV_DOZE_AFTER for the dozing part")
    parser.add_argument("--out", type=Path, default=Path("bench/results/density.json"))
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
