"""Warm pools and create bursts: `python -m bench.warm [--rounds 20] [--pool 4] [--burst 200]
[--clients 50] [--template base] [--data-dir /var/tmp/aenv-bench]` (root, runsc).

Starts a node (`aenv server`) on the data dir and measures, each against a baseline in the same run:
- a create from a warm pool against a cold one (the pool off): `POST /sandboxes` from a plain HTTP
  client (the node's own time plus one local HTTP round trip), and the E2B SDK's
  `Sandbox.create()` + first `commands.run("true")`, the pool refilled and the node quiet (2 s)
  before each round;
- a burst: `--burst` creates from `--clients` concurrent clients at once (pool off): creates/s,
  p50/p99 latency and the answers (201, or 429 with Retry-After when the node is full);
- then, with the node stopped, the same burst of the driver's bare restores of the template's image
  (`runsc restore` with its overlay mount and cgroups: no agent, no HTTP), as the raw baseline.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.runtime.base import Limits
from aenv.storage.layers import new_id
from bench.__main__ import pct, summary

console = Console()
API_KEY = "bench-" + "0" * 32
QUIET = 2.0  # seconds before each create round: a node between two rollouts' creates


def start_node(data_dir: Path, port: int, template: str) -> subprocess.Popen[bytes]:
    env = dict(os.environ, AENV_API_KEY=API_KEY, AENV_WARM_POOL_MIN_FREE_MB="0", AENV_MAX_SANDBOXES="1000")
    log = open(data_dir.parent / f"{data_dir.name}-bench-warm.log", "ab")
    argv = [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(port), "--data-dir", str(data_dir)]
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 900  # `base` is debootstrapped on a first run
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the node exited with {proc.returncode}; see {log.name}")
        try:
            if template in httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["templates"]:
                return proc
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the node did not become ready")


def pool(api: httpx.Client, template: str, size: int | None) -> None:
    r = api.put(f"/templates/{template}/warm-pool", json={"size": size})
    r.raise_for_status()


def wait_ready(api: httpx.Client, template: str, count: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while api.get(f"/templates/{template}/warm-pool").json()["ready"] < count:
        if time.monotonic() > deadline:
            raise SystemExit(f"the warm pool of {template} did not reach {count}")
        time.sleep(0.05)


def settle(api: httpx.Client) -> None:
    """Nothing left running, and a moment for background teardowns."""
    for sb in api.get("/sandboxes").json():
        api.delete(f"/sandboxes/{sb['sandboxID']}")
    time.sleep(1.5)


def creates(url: str, api: httpx.Client, template: str, rounds: int, warm: int) -> dict[str, Any]:
    """``rounds`` of a plain HTTP create and of the E2B SDK's create + first run, each killed after."""
    os.environ.update(E2B_API_KEY=API_KEY, E2B_API_URL=url, E2B_SANDBOX_URL=url)
    from e2b import Sandbox

    http, sdk, first_run = [], [], []
    for i in range(rounds * 2):
        if warm:
            wait_ready(api, template, warm)
        time.sleep(QUIET)  # the last round's teardown and the refill's restore are over, in both modes
        if i % 2 == 0:
            start = time.perf_counter()
            r = api.post("/sandboxes", json={"templateID": template, "timeout": 120})
            http.append(time.perf_counter() - start)
            r.raise_for_status()
            api.delete(f"/sandboxes/{r.json()['sandboxID']}")
        else:
            start = time.perf_counter()
            sbx = Sandbox.create(template=template, timeout=120)
            made = time.perf_counter()
            sbx.commands.run("true")
            sdk.append(time.perf_counter() - start)
            first_run.append(time.perf_counter() - made)
            sbx.kill()
    return {"http_create": stats(http), "sdk_create_and_run": stats(sdk), "sdk_first_run": stats(first_run)}


async def burst_http(url: str, template: str, total: int, clients: int) -> dict[str, Any]:
    latencies: list[float] = []
    answers: Counter[str] = Counter()
    made: list[str] = []
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(total):
        queue.put_nowait(i)
    go = asyncio.Event()

    async def client() -> None:
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=600) as http:
            await go.wait()
            while not queue.empty():
                queue.get_nowait()
                start = time.perf_counter()
                try:
                    r = await http.post("/sandboxes", json={"templateID": template, "timeout": 600})
                except httpx.HTTPError as exc:
                    answers[type(exc).__name__] += 1
                    continue
                latencies.append(time.perf_counter() - start)
                answers[str(r.status_code) + ("+Retry-After" if "retry-after" in r.headers else "")] += 1
                if r.status_code == 201:
                    made.append(r.json()["sandboxID"])

    tasks = [asyncio.ensure_future(client()) for _ in range(clients)]
    await asyncio.sleep(0.3)
    start = time.perf_counter()
    go.set()
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": API_KEY}, timeout=600) as http:
        await asyncio.gather(*(http.delete(f"/sandboxes/{sid}") for sid in made))
    return {"seconds": wall, "per_s": len(made) / wall, "latency": stats(latencies), "answers": dict(answers)}


async def burst_raw(data_dir: Path, template: str, total: int, clients: int) -> dict[str, Any]:
    """The same burst of the driver's bare restores (no agent, no HTTP), on the node's files."""
    settings = Settings(data_dir=data_dir, build_base=False, spare_uppers=0)
    node = Node(settings)
    await node.start()
    instances = []
    latencies: list[float] = []
    try:
        rec = node.find_template(template)
        limits = Limits(settings.cpu_count, settings.memory_mb, settings.nproc, settings.disk_mb)
        uppers = [await node.files.new_upper(settings.disk_mb) for _ in range(total)]  # not timed
        gate = asyncio.Semaphore(clients)

        async def one(upper: str) -> None:
            async with gate:
                start = time.perf_counter()
                instance = await node.driver.restore(
                    instance_id=new_id(),
                    rootfs=node.rootfs(list(rec.layers), upper, rec.guest),
                    limits=limits,
                    image_dir=node.files.image(rec.image),
                )
                latencies.append(time.perf_counter() - start)
                instances.append(instance)

        start = time.perf_counter()
        await asyncio.gather(*(one(u) for u in uppers))
        wall = time.perf_counter() - start
    finally:
        await asyncio.gather(*(node.driver.kill(i) for i in instances), return_exceptions=True)
        for upper in uppers:
            await node.files.remove(upper)
        await node.stop(pause_running=False)
    return {"seconds": wall, "per_s": total / wall, "latency": stats(latencies)}


def stats(values: list[float]) -> dict[str, float]:
    return {**summary(values), "p99_ms": pct(values, 0.99) * 1000}


def ms(s: dict[str, float], key: str) -> str:
    return f"{s[key + '_ms']:.0f}"


def render(results: dict[str, Any]) -> None:
    table = Table(title="warm pools and bursts on this machine", header_style="bold")
    for col in ("what", "p50 ms", "p99 ms", "baseline (same run)", "baseline p50 / p99 ms"):
        table.add_column(col)
    warm, cold = results["warm"], results["cold"]
    for key, what in (
        ("http_create", "POST /sandboxes, warm pool"),
        ("sdk_create_and_run", 'E2B Sandbox.create() + run("true"), warm pool'),
        ("sdk_first_run", '  of which the first run("true")'),
    ):
        w, c = warm[key], cold[key]
        table.add_row(what, ms(w, "p50"), ms(w, "p99"), "the same, pool off", f"{ms(c, 'p50')} / {ms(c, 'p99')}")
    burst, raw = results["burst"], results.get("burst_raw")
    what = f"burst: {results['burst_total']} creates from {results['burst_clients']} clients"
    base = f"{raw['per_s']:.1f}/s: {ms(raw['latency'], 'p50')} / {ms(raw['latency'], 'p99')}" if raw else "-"
    table.add_row(
        f"{what} ({burst['per_s']:.1f}/s)",
        ms(burst["latency"], "p50"),
        ms(burst["latency"], "p99"),
        "the driver's bare restores, same burst",
        base,
    )
    console.print(table)
    console.print(f"burst answers: {burst['answers']}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.warm", description=__doc__)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--pool", type=int, default=4)
    parser.add_argument("--burst", type=int, default=200)
    parser.add_argument("--clients", type=int, default=50)
    parser.add_argument("--template", default="base")
    parser.add_argument("--port", type=int, default=3990)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/warm.json"))
    args = parser.parse_args()
    url = f"http://127.0.0.1:{args.port}"
    proc = start_node(args.data_dir, args.port, args.template)
    results: dict[str, Any] = {"machine": platform.node(), "cpus": os.cpu_count(), "rounds": args.rounds}
    results.update(pool_size=args.pool, burst_total=args.burst, burst_clients=args.clients)
    try:
        with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=600) as api:
            pool(api, args.template, 0)
            settle(api)
            console.print("[bold]cold creates[/bold] (pool off)")
            results["cold"] = creates(url, api, args.template, args.rounds, 0)
            pool(api, args.template, args.pool)
            console.print(f"[bold]warm creates[/bold] (pool of {args.pool}, refilled between rounds)")
            results["warm"] = creates(url, api, args.template, args.rounds, args.pool)
            pool(api, args.template, 0)
            settle(api)
            console.print(f"[bold]burst[/bold]: {args.burst} creates from {args.clients} clients")
            results["burst"] = asyncio.run(burst_http(url, args.template, args.burst, args.clients))
            pool(api, args.template, None)  # back to the node's default
    finally:
        proc.terminate()
        proc.wait(120)
    console.print("[bold]raw burst[/bold]: the driver's restores")
    results["burst_raw"] = asyncio.run(burst_raw(args.data_dir, args.template, args.burst, args.clients))
    render(results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    console.print(f"written to {args.out}")


if __name__ == "__main__":
    main()
