"""Where a command's time goes: `python -m bench.exec [--rounds N] [--data-dir DIR] [--out FILE]`.

`commands.run("true")` through the E2B SDK runs `/bin/bash -l -c true`, as envd does. One node
serves the API in this process (its own thread and event loop), and the same sandbox is timed at
each layer, in alternating blocks so that every layer sees the same moments of this machine:

- the spawn alone, inside the sandbox (`subprocess.run`, of `/bin/true` and of `bash -l -c true`);
- the node's channel to the agent (what the API does for a command, without HTTP);
- HTTP + Connect framing: the native SDK's `exec` and a bare `GET /health` round trip;
- the E2B SDK's `commands.run`.

The differences between layers are what each adds. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from rich.console import Console
from rich.table import Table

from aenv.api.app import build
from aenv.channel import END
from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.templates.builder import ensure_base, run_in
from bench.__main__ import machine, pct, write_results

console = Console()
T = TypeVar("T")
KEY = "e2b_" + "0" * 40
BARE = """
import json, subprocess, time
out = {}
for name, argv in (("true", ["/bin/true"]), ("bash", ["/bin/bash", "-l", "-c", "true"])):
    ts = []
    for _ in range(ROUNDS + 3):
        t = time.perf_counter(); subprocess.run(argv); ts.append(time.perf_counter() - t)
    out[name] = ts[3:]
print(json.dumps(out))
"""


class NodeThread:
    """A node and its API on a loop of their own, as `aenv server` runs them."""

    def __init__(self, data_dir: Path) -> None:
        self.loop = asyncio.new_event_loop()
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.node = Node(Settings(data_dir=data_dir, api_key=KEY, port=self.port))
        self.server: uvicorn.Server | None = None
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def start(self) -> None:
        self.thread.start()
        self.call(self.node.start())
        self.call(ensure_base(self.node, on_log=lambda line: console.print(f"  {line}")))
        config = uvicorn.Config(build(self.node, KEY, start_node=False), port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        asyncio.run_coroutine_threadsafe(self.server.serve(), self.loop)
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline, "the API did not start"
            time.sleep(0.05)

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def stop(self) -> None:
        if self.server is not None:
            self.server.should_exit = True
        self.call(self.node.stop(pause_running=False))
        self.loop.call_soon_threadsafe(self.loop.stop)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def channel_exec(node: Node, sandbox_id: str, argv: list[str], rounds: int) -> list[float]:
    """A command through the node's channel, timed on the node's own loop (no thread hop counted)."""
    link = node.get(sandbox_id).link
    params = {"process": {"cmd": argv[0], "args": argv[1:]}, "user": "user", "stdin": False}
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        stream = await link.open("process.start", params)
        while (await stream.recv()).kind != END:
            pass
        times.append(time.perf_counter() - started)
    return times


def timed(fn: Callable[[], object], rounds: int) -> list[float]:
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return times


def bench(host: NodeThread, rounds: int, blocks: int) -> dict[str, list[float]]:
    from e2b import Sandbox as E2BSandbox

    from aenv.sdk import Client

    rec = host.call(host.node.create("base", SandboxSpec(timeout=3600)))
    bare_script = f"python3 - <<'EOF'\n{BARE.replace('ROUNDS', str(rounds))}\nEOF"
    samples: dict[str, list[float]] = {}
    try:
        native_client = Client(host.url, KEY)
        native = native_client.connect(rec.id)
        e2b = E2BSandbox.connect(rec.id, api_key=KEY, api_url=host.url, sandbox_url=host.url)
        health = httpx.Client(base_url=host.url)
        steps: dict[str, Callable[[int], list[float]]] = {
            "channel `true`": lambda n: host.call(channel_exec(host.node, rec.id, ["/bin/true"], n)),
            "channel `bash -l -c true`": lambda n: host.call(
                channel_exec(host.node, rec.id, ["/bin/bash", "-l", "-c", "true"], n)
            ),
            "HTTP GET /health": lambda n: timed(lambda: health.get("/health"), n),
            "native SDK exec(`true`)": lambda n: timed(lambda: native.exec("true"), n),
            "E2B SDK commands.run(`true`)": lambda n: timed(lambda: e2b.commands.run("true"), n),
        }
        for step in steps.values():
            step(3)  # warm-up: connections, the agent's and bash's first run
        for _ in range(blocks):
            for name, step in steps.items():
                samples.setdefault(name, []).extend(step(rounds))
            ran = host.call(run_in(host.node.get(rec.id).link, bare_script, user="user"))
            if ran.code == 0:
                bare = json.loads(ran.output.strip().splitlines()[-1])
                samples.setdefault("spawn `true` in the sandbox", []).extend(bare["true"])
                samples.setdefault("spawn `bash -l -c true` in the sandbox", []).extend(bare["bash"])
        health.close()
        native_client.close()
    finally:
        host.call(host.node.kill(rec.id))
    return samples


def layers(p50: dict[str, float]) -> dict[str, float]:
    """What each layer adds to a command's round trip (ms at p50)."""
    return {
        "spawn of bash -l -c true (inside the sandbox)": p50["spawn `bash -l -c true` in the sandbox"],
        "channel + agent (node to agent and back)": p50["channel `bash -l -c true`"]
        - p50["spawn `bash -l -c true` in the sandbox"],
        "HTTP + Connect framing + API (native SDK)": p50["native SDK exec(`true`)"] - p50["channel `bash -l -c true`"],
        "E2B SDK over the native one": p50["E2B SDK commands.run(`true`)"] - p50["native SDK exec(`true`)"],
    }


def render(result: dict[str, Any]) -> None:
    table = Table(title="a command's round trip, layer by layer", header_style="bold")
    for col in ("measured", "p50 ms", "p95 ms", "n"):
        table.add_column(col)
    for name, r in result["measured"].items():
        table.add_row(name, f"{r['p50_ms']:.2f}", f"{r['p95_ms']:.2f}", str(r["n"]))
    console.print(table)
    split = Table(title="what each layer adds (p50)", header_style="bold")
    split.add_column("layer")
    split.add_column("ms")
    for name, ms in result["layers_ms"].items():
        split.add_row(name, f"{ms:.2f}")
    console.print(split)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.exec", description=__doc__)
    parser.add_argument("--rounds", type=int, default=15, help="rounds per block and layer")
    parser.add_argument("--blocks", type=int, default=4)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/exec.json"))
    args = parser.parse_args()
    host = NodeThread(args.data_dir)
    host.start()
    try:
        samples = bench(host, args.rounds, args.blocks)
    finally:
        host.stop()
    measured = {
        name: {"n": len(v), "p50_ms": pct(v, 0.5) * 1000, "p95_ms": pct(v, 0.95) * 1000} for name, v in samples.items()
    }
    result = {
        "measured": measured,
        "layers_ms": layers({name: r["p50_ms"] for name, r in measured.items()}),
        "machine": machine(),
    }
    render(result)
    write_results(args.out, result)


if __name__ == "__main__":
    main()
