"""Cluster benchmarks: `python -m bench.cluster [--nodes 2] [--gateways 2] [--burst 50] [--clients 10]
[--entries 30000] [--rounds 20]` (root, runsc, etcd).

Starts a real cluster on loopback with `scripts/cluster`'s code (aenv/cluster/local.py) and measures,
each against a baseline taken in the same run:
- exec round trip (`true`) through a gateway against the same sandbox straight at its node;
- create (then kill) through a gateway against straight at one node;
- a burst of creates from concurrent clients through the gateways against one node alone;
- a gateway's directory mirror holding N entries the bench writes straight to etcd: load time of
  a fresh gateway process, its memory against an empty directory's, lookup p99 in the mirror;
- seconds from a node's `kill -9` until every gateway has dropped it (its lease's TTL);
- durable pause (`--only durable` runs this alone; 3 nodes then): the pause call against the time
  until `GET` shows it durable, bytes uploaded per pause (the node's
  `aenv_repo_commit_bytes_total{what="uploaded"}`) of an idle sandbox and of one that wrote
  20 MiB; a resume on the origin node against one on another node (artifacts fetched); a drain
  with move of a node holding N running sandboxes: its seconds and the longest pause a client
  polling each sandbox saw.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from aenv.cluster import local, local_up
from aenv.cluster.entries import SandboxEntry
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore
from aenv.sdk import AsyncClient
from bench.__main__ import pct, summary

console = Console()
GHOST_NODE = "bench-ghost"  # the node the bench's directory entries name: no such node runs


def say(line: str) -> None:
    console.print(line)


async def exec_rounds(client: AsyncClient, sandbox_id: str, rounds: int) -> list[float]:
    sbx = await client.connect(sandbox_id)
    for _ in range(3):
        await sbx.exec("true")  # warm-up: connections, the agent's first process
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        await sbx.exec("true")
        out.append(time.perf_counter() - start)
    return out


async def create_rounds(client: AsyncClient, rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        start = time.perf_counter()
        sbx = await client.create(timeout=300)
        out.append(time.perf_counter() - start)
        await sbx.kill()
    return out


async def burst(urls: list[str], key: str, total: int, clients: int) -> tuple[float, int]:
    """(creates per second, failures): ``total`` creates from ``clients`` concurrent clients, each
    on one of ``urls`` in turn; every sandbox is killed afterwards (not timed)."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    made: list[Any] = []
    failures = 0

    async def worker(n: int) -> None:
        nonlocal failures
        async with AsyncClient(urls[n % len(urls)], key) as client:
            while not queue.empty():
                queue.get_nowait()
                try:
                    made.append((urls[n % len(urls)], (await client.create(timeout=300)).sandbox_id))
                except Exception as exc:  # noqa: BLE001 - a failed create is counted, not fatal
                    failures += 1
                    console.print(f"  create failed: {exc}")

    start = time.perf_counter()
    await asyncio.gather(*(worker(n) for n in range(clients)))
    elapsed = time.perf_counter() - start
    async with httpx.AsyncClient(headers={"X-API-Key": key}, timeout=120) as http:
        sem = asyncio.Semaphore(8)

        async def kill(url: str, sid: str) -> None:
            async with sem:
                await http.delete(f"{url}/sandboxes/{sid}")

        await asyncio.gather(*(kill(u, s) for u, s in made))
    return len(made) / elapsed, failures


async def write_entries(store: ClusterStore, count: int) -> list[str]:
    ids = [f"bench{i:07d}" for i in range(count)]
    sem = asyncio.Semaphore(64)
    now = time.time()

    async def put(sid: str) -> None:
        async with sem:
            entry = SandboxEntry(sid, GHOST_NODE, "running", template_id="base", started_at=now, end_at=now + 3600)
            await store.create_sandbox(entry)

    await asyncio.gather(*(put(s) for s in ids))
    return ids


async def delete_entries(store: ClusterStore, ids: list[str]) -> None:
    sem = asyncio.Semaphore(64)

    async def drop(sid: str) -> None:
        async with sem:
            found = await store.get_sandbox(sid)
            if found is not None:
                await store.delete_sandbox(sid, found.mod_revision)

    await asyncio.gather(*(drop(s) for s in ids))


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def fresh_gateway(layout: local.Layout, key: str, port: int, want: int) -> tuple[float, float]:
    """(seconds until a new gateway process serves a directory of ``want`` sandboxes, its RSS MiB)."""
    log = layout.logs / f"bench-gateway-{port}.log"
    argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", layout.etcd_url(), "--port", str(port)]
    start = time.perf_counter()
    with open(log, "ab") as out:
        env = {**os.environ, **layout.tls_env("gateway"), "AENV_API_KEY": key}  # etcd: TLS, by certificate
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        while True:
            health = local.get_json(f"http://{local.HOST}:{port}/health") or {}
            if health.get("status") == "ok" and health.get("sandboxes", 0) >= want:
                return time.perf_counter() - start, rss_mib(proc.pid)
            if proc.poll() is not None or time.perf_counter() - start > 300:
                raise RuntimeError(f"the bench gateway did not load:\n{local.tail(log)}")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(15)


async def mirror_bench(layout: local.Layout, key: str, entries: int) -> dict[str, Any]:
    # the bench's own bulk writes: 64 at a time, on a machine the cluster shares
    store = ClusterStore.from_url(layout.etcd_url(), tls=layout.client_tls("node"), timeout=10)
    port = layout.gateway_port(99)  # past the cluster's own gateways
    try:
        empty_s, empty_rss = fresh_gateway(layout, key, port, 0)
        say(f"[bold]directory[/bold]: writing {entries} entries straight to etcd")
        start = time.perf_counter()
        ids = await write_entries(store, entries)
        write_s = time.perf_counter() - start
        load_s, rss = fresh_gateway(layout, key, port, entries)
        mirror = Mirror(ClusterStore.from_url(layout.etcd_url(), tls=layout.client_tls("gateway")))
        start = time.perf_counter()
        await mirror.start(wait=120)
        mirror_load = time.perf_counter() - start
        probes = [random.choice(ids) for _ in range(100_000)]
        lookups = []
        for sid in probes:
            t = time.perf_counter_ns()
            entry, _ = mirror.owner(sid)
            lookups.append(time.perf_counter_ns() - t)
            assert entry is not None
        await mirror.stop()
        await delete_entries(store, ids)
    finally:
        await store.close()
    return {
        "entries": entries,
        "write_s": write_s,
        "fresh_gateway_load_s": load_s,
        "fresh_gateway_load_empty_s": empty_s,
        "gateway_rss_mib": rss,
        "gateway_rss_empty_mib": empty_rss,
        "gateway_kib_per_entry": (rss - empty_rss) * 1024 / entries,
        "in_process_mirror_load_s": mirror_load,
        "lookup_p50_us": pct([x / 1000 for x in lookups], 0.5),
        "lookup_p99_us": pct([x / 1000 for x in lookups], 0.99),
    }


def failover(state: dict[str, Any], key: str) -> dict[str, Any]:
    """Kill -9 the last node; seconds until no gateway lists it (creates then go elsewhere)."""
    victim = state["nodes"][-1]
    os.kill(victim["pid"], signal.SIGKILL)
    start = time.perf_counter()
    per_gateway: dict[str, float] = {}
    while len(per_gateway) < len(state["gateways"]) and time.perf_counter() - start < 120:
        for url in state["gateways"]:
            if url in per_gateway:
                continue
            listed = httpx.get(f"{url}/nodes", headers={"X-API-Key": key}, timeout=5).json()
            if victim["nodeID"] not in {n["nodeID"] for n in listed}:
                per_gateway[url] = time.perf_counter() - start
        time.sleep(0.05)
    return {"node": victim["nodeID"], "all_gateways_s": max(per_gateway.values()), "per_gateway_s": per_gateway}


async def bench(state: dict[str, Any], layout: local.Layout, args: argparse.Namespace) -> dict[str, Any]:
    key, gw, node = state["apiKey"], state["gateways"][0], state["nodes"][0]["url"]
    results: dict[str, Any] = {}
    async with AsyncClient(node, key) as direct, AsyncClient(gw, key) as via:
        say(f"[bold]exec round trip[/bold] (`true`) x{args.rounds}, through {gw} and straight at {node}")
        sbx = await direct.create(timeout=600)
        ours, base = [], []
        for _ in range(4):  # alternating blocks: both see the same moments of a shared machine
            ours += await exec_rounds(via, sbx.sandbox_id, args.rounds // 4)
            base += await exec_rounds(direct, sbx.sandbox_id, args.rounds // 4)
        await sbx.kill()
        results["exec_true"] = {**summary(ours), "p99_ms": pct(ours, 0.99) * 1000, **_against(ours, base)}
        say(f"[bold]create[/bold] x{args.creates} through a gateway and straight at a node")
        c_via, c_direct = [], []
        for _ in range(2):
            c_via += await create_rounds(via, args.creates // 2)
            c_direct += await create_rounds(direct, args.creates // 2)
        results["create"] = {**summary(c_via), "p99_ms": pct(c_via, 0.99) * 1000, **_against(c_via, c_direct)}
    say(f"[bold]burst[/bold]: {args.burst} creates from {args.clients} clients, gateways vs one node")
    rate_gw, fail_gw = await burst(state["gateways"], key, args.burst, args.clients)
    rate_node, fail_node = await burst([node], key, args.burst, args.clients)
    results["burst"] = {
        "creates": args.burst,
        "clients": args.clients,
        "gateways_per_s": rate_gw,
        "one_node_per_s": rate_node,
        "ratio": rate_gw / rate_node,
        "failures": fail_gw + fail_node,
    }
    results["directory"] = await mirror_bench(layout, key, args.entries)
    if len(state["nodes"]) >= 3:  # it leaves its first two nodes draining: after the rest, before the failover
        results["durable"] = await durable_bench(state, args)
    else:
        say("durable pause: skipped (it needs --nodes 3 or more)")
    say("[bold]failover[/bold]: kill -9 of a node")
    results["failover"] = {**failover(state, key), "lease_ttl_s": int(os.environ.get("AENV_CLUSTER_LEASE_TTL", 10))}
    return results


def uploaded_bytes(node: str) -> float:
    """The node's counter of bytes its repository commits uploaded."""
    for line in httpx.get(f"{node}/metrics", timeout=10).text.splitlines():
        if line.startswith('aenv_repo_commit_bytes_total{what="uploaded"}'):
            return float(line.split()[-1])
    return 0.0


async def durable_pause(http: httpx.AsyncClient, node: str, sandbox_id: str) -> dict[str, float]:
    """Pause ``sandbox_id`` (on ``node``): the call's seconds, until GET says durable, bytes uploaded."""
    before = uploaded_bytes(node)
    start = time.perf_counter()
    (await http.post(f"{node}/sandboxes/{sandbox_id}/pause")).raise_for_status()
    call = time.perf_counter() - start
    while not (await http.get(f"{node}/sandboxes/{sandbox_id}")).json().get("durable"):
        if time.perf_counter() - start > 300:
            raise RuntimeError(f"the pause of {sandbox_id} was not durable within 300 s")
        await asyncio.sleep(0.02)
    durable = time.perf_counter() - start
    await asyncio.sleep(0.5)  # the counter is bumped as the commit ends; the GET may see durable first
    return {"pause_s": call, "durable_s": durable, "uploaded_bytes": uploaded_bytes(node) - before}


async def wait_durable_entry(store: ClusterStore, sandbox_id: str) -> None:
    """Until the directory says the pause is durable (a tick after the node's GET does)."""
    for _ in range(3000):
        found = await store.get_sandbox(sandbox_id)
        if found is not None and found.entry.durable:
            return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"{sandbox_id} is not durable in the directory")


async def timed_connect(http: httpx.AsyncClient, gateway: str, sandbox_id: str) -> tuple[float, str]:
    start = time.perf_counter()
    r = await http.post(f"{gateway}/sandboxes/{sandbox_id}/connect", json={"timeout": 600})
    r.raise_for_status()
    return time.perf_counter() - start, r.headers["x-aenv-node-id"]


async def drain_stream(http: httpx.AsyncClient, gateway: str, node_id: str, move: bool) -> dict[str, Any]:
    async with http.stream("POST", f"{gateway}/nodes/{node_id}/drain", json={"move": move}, timeout=900) as r:
        r.raise_for_status()
        lines = [json.loads(line) async for line in r.aiter_lines() if line.strip()]
    return dict(lines[-1])


async def poll_gaps(http: httpx.AsyncClient, gateway: str, sandbox_id: str, stop: asyncio.Event) -> float:
    """The longest time between two answers of the sandbox's envd `/health` through ``gateway``."""
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "49983"}
    last = time.perf_counter()
    longest = 0.0
    while not stop.is_set():
        try:
            ok = (await http.get(f"{gateway}/health", headers=headers, timeout=30)).status_code < 300
        except httpx.HTTPError:
            ok = False
        now = time.perf_counter()
        if ok:
            longest, last = max(longest, now - last), now
        await asyncio.sleep(0.1)
    return max(longest, time.perf_counter() - last)


async def durable_bench(state: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """Durable pauses, resumes on the origin and elsewhere, a drain with move (see the module doc)."""
    key, gw = state["apiKey"], state["gateways"][0]
    first, second = state["nodes"][0], state["nodes"][1]
    layout = local.Layout(args.dir, args.base_port)
    store = ClusterStore.from_url(layout.etcd_url(), tls=layout.client_tls("node"))
    out: dict[str, Any] = {}
    async with (
        AsyncClient(first["url"], key) as direct,
        httpx.AsyncClient(headers={"X-API-Key": key}, timeout=300) as http,
    ):
        say(f"[bold]durable pause[/bold] x{args.pauses}: idle, and after writing 20 MiB")
        idle, written, ids = [], [], []
        for _ in range(args.pauses):
            for kind, into in (("idle", idle), ("20MiB", written)):
                sbx = await direct.create(timeout=600)
                ids.append(sbx.sandbox_id)
                await sbx.exec("true")
                if kind == "20MiB":
                    await sbx.exec("head -c 20M /dev/urandom > /home/user/big")
                into.append(await durable_pause(http, first["url"], sbx.sandbox_id))
        out["pause_idle"], out["pause_20mib"] = idle, written
        say("[bold]resume[/bold] on the origin node (through a gateway), paused durably again")
        origin = []
        for sid in ids:
            origin.append((await timed_connect(http, gw, sid))[0])
            (await http.post(f"{first['url']}/sandboxes/{sid}/pause")).raise_for_status()
        for sid in ids:
            await wait_durable_entry(store, sid)
        say(f"[bold]resume elsewhere[/bold]: {first['nodeID']} drained without move, each connected through a gateway")
        await drain_stream(http, gw, first["nodeID"], move=False)
        elsewhere = [await timed_connect(http, gw, sid) for sid in ids]
        out["resume_origin_s"] = origin
        out["resume_elsewhere_s"] = [s for s, _ in elsewhere]
        out["resumed_on"] = sorted({n for _, n in elsewhere})
        for sid in ids:
            await http.delete(f"{gw}/sandboxes/{sid}")

    async with (
        AsyncClient(second["url"], key) as direct,
        httpx.AsyncClient(headers={"X-API-Key": key}, timeout=300) as http,
    ):
        say(f"[bold]drain with move[/bold] of {second['nodeID']} holding {args.drain} running sandboxes")
        made = [(await direct.create(timeout=600)).sandbox_id for _ in range(args.drain)]
        stop = asyncio.Event()
        pollers = [asyncio.ensure_future(poll_gaps(http, gw, sid, stop)) for sid in made]
        await asyncio.sleep(2)
        start = time.perf_counter()
        last = await drain_stream(http, gw, second["nodeID"], move=True)
        seconds = time.perf_counter() - start
        await asyncio.sleep(1)
        stop.set()
        gaps = await asyncio.gather(*pollers)
        out["drain"] = {
            "sandboxes": args.drain,
            "seconds": seconds,
            "longest_pause_s": max(gaps),
            "p50_pause_s": pct(gaps, 0.5),
            "last": last,
        }
        for sid in made:
            await http.delete(f"{gw}/sandboxes/{sid}")
    await store.close()
    return out


def _against(ours: list[float], base: list[float]) -> dict[str, float]:
    return {
        "baseline_p50_ms": pct(base, 0.5) * 1000,
        "baseline_p99_ms": pct(base, 0.99) * 1000,
        "ratio_p50": pct(ours, 0.5) / pct(base, 0.5),
        "delta_p50_ms": (pct(ours, 0.5) - pct(base, 0.5)) * 1000,
    }


def render(r: dict[str, Any]) -> None:
    table = Table(title="aenv cluster on this machine", header_style="bold")
    for col in ("measure", "gateway", "baseline", "ratio / delta"):
        table.add_column(col)
    for name, label in (("exec_true", "exec `true` (node direct)"), ("create", "create (node direct)")):
        m = r[name]
        table.add_row(
            f"{label} p50 / p99 ms",
            f"{m['p50_ms']:.1f} / {m['p99_ms']:.1f}",
            f"{m['baseline_p50_ms']:.1f} / {m['baseline_p99_ms']:.1f}",
            f"{m['ratio_p50']:.2f}x, +{m['delta_p50_ms']:.1f} ms",
        )
    b = r["burst"]
    table.add_row(
        f"burst creates/s ({b['creates']} from {b['clients']} clients; one node)",
        f"{b['gateways_per_s']:.2f}",
        f"{b['one_node_per_s']:.2f}",
        f"{b['ratio']:.2f}x",
    )
    d = r["directory"]
    table.add_row(
        f"fresh gateway load, {d['entries']} entries (empty) s",
        f"{d['fresh_gateway_load_s']:.2f}",
        f"{d['fresh_gateway_load_empty_s']:.2f}",
        "",
    )
    table.add_row(
        "gateway RSS MiB (empty directory)",
        f"{d['gateway_rss_mib']:.1f}",
        f"{d['gateway_rss_empty_mib']:.1f}",
        f"{d['gateway_kib_per_entry']:.2f} KiB/entry",
    )
    table.add_row("mirror lookup p50 / p99 us", f"{d['lookup_p50_us']:.2f} / {d['lookup_p99_us']:.2f}", "", "")
    f = r["failover"]
    table.add_row(
        "kill -9 to every gateway routing around s (lease TTL)", f"{f['all_gateways_s']:.2f}", str(f["lease_ttl_s"]), ""
    )
    console.print(table)


def render_durable(d: dict[str, Any]) -> None:
    table = Table(title="durable pause, resume anywhere, drain", header_style="bold")
    for col in ("measure", "p50", "max", "baseline (same run)"):
        table.add_column(col)
    for name, label in (("pause_idle", "idle sandbox"), ("pause_20mib", "after writing 20 MiB")):
        rows = d[name]
        calls, durables = [r["pause_s"] for r in rows], [r["durable_s"] for r in rows]
        mib = [r["uploaded_bytes"] / 2**20 for r in rows]
        table.add_row(
            f"pause until durable s, {label}",
            f"{pct(durables, 0.5):.2f}",
            f"{max(durables):.2f}",
            f"the pause call {pct(calls, 0.5):.2f} s p50",
        )
        table.add_row(f"MiB uploaded per pause, {label}", f"{pct(mib, 0.5):.1f}", f"{max(mib):.1f}", "")
    elsewhere, origin = d["resume_elsewhere_s"], d["resume_origin_s"]
    table.add_row(
        "resume on another node s (artifacts fetched)",
        f"{pct(elsewhere, 0.5):.2f}",
        f"{max(elsewhere):.2f}",
        f"on the origin node {pct(origin, 0.5):.2f} p50, {max(origin):.2f} max",
    )
    dr = d["drain"]
    table.add_row(
        f"drain with move of {dr['sandboxes']} running sandboxes s",
        f"{dr['seconds']:.1f}",
        "",
        f"longest pause a client saw {dr['longest_pause_s']:.1f} s (p50 of each one's longest {dr['p50_pause_s']:.1f})",
    )
    console.print(table)


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    layout = local.Layout(args.dir, args.base_port)
    up = partial(local_up.up, args.dir, say, nodes=args.nodes, gateways=args.gateways, base_port=args.base_port)
    state = await asyncio.to_thread(up)
    try:
        if args.only == "durable":
            results = {"durable": await durable_bench(state, args)}
        else:
            results = await bench(state, layout, args)
    finally:
        await asyncio.to_thread(local.down, layout, say)
    results["cluster"] = {"nodes": args.nodes, "gateways": args.gateways, "etcd": local.ETCD_MEMBERS}
    results["machine"] = {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()}
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__)
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--gateways", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=200, help="exec round trips each way")
    parser.add_argument("--creates", type=int, default=20, help="sequential creates each way")
    parser.add_argument("--burst", type=int, default=50, help="creates in the burst")
    parser.add_argument("--clients", type=int, default=10, help="concurrent clients of the burst")
    parser.add_argument("--entries", type=int, default=30000, help="directory entries the mirror holds")
    parser.add_argument("--only", choices=["durable"], help="run only this section (it needs 3 nodes)")
    parser.add_argument("--pauses", type=int, default=5, help="durable pauses of each kind (idle, 20 MiB written)")
    parser.add_argument("--drain", type=int, default=20, help="running sandboxes on the node drained with move")
    parser.add_argument("--dir", type=Path, default=Path("/var/tmp/aenv-bench-cluster"))
    parser.add_argument("--base-port", type=int, default=18080)
    parser.add_argument("--out", type=Path, default=Path("bench/results/cluster.json"))
    args = parser.parse_args()
    if shutil.which("etcd") is None:
        sys.exit("etcd is not installed (./scripts/cluster up installs etcd-server)")
    if args.only == "durable":
        args.nodes = max(args.nodes, 3)  # the drained origin, the node resumes go to, the drain's target
        args.out = args.out.with_name("cluster-durable.json")
    results = asyncio.run(amain(args))
    if args.only != "durable":
        render(results)
    if "durable" in results:
        render_durable(results["durable"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {args.out}")


if __name__ == "__main__":
    main()
