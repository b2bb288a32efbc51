"""Desktop sandboxes: `python -m bench desktop [--rounds N] [--data-dir DIR] [--out FILE]` (root, runsc).

Runs an `aenv server` on the data dir (building `base` and `desktop` there if missing; the build's
time is reported) and drives it with E2B's Desktop SDK, as a computer-use trainer would:

- create to first screenshot (``Sandbox.create()`` runs the SDK's own start-up: Xvfb, the session,
  their readiness checks) against a plain create from `base` and its first command, in the same
  rounds;
- an action and a screenshot (``move_mouse`` + ``screenshot``) against a bare command
  (``commands.run("true")``) on the same desktop;
- a fork of a running desktop into 4 against a fork of a running `base` sandbox into 4;
- host memory (PSS of runsc's processes, the sandbox alone on the node) of an idle desktop, and
  of a paused one.

Rounds are interleaved (desktop, then base); medians are reported. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.__main__ import machine, pss_where, write_results

console = Console()
API_KEY = "bench-desktop"
IDLE_SETTLE = 10.0  # seconds a desktop is left alone before its memory is read
ACTIONS = 20  # action + screenshot round trips per round
QUIET = ("Get:", "Selecting", "Preparing", "Unpacking", "Setting up", "Processing")  # apt's lines, not shown


def runsc_pss() -> tuple[int, int]:
    """(PSS bytes, processes) of every runsc process on the host (and their children)."""
    return pss_where(lambda cmdline: cmdline.startswith(b"runsc"))


class Server:
    """An `aenv server` of the bench's own (``env``: settings of its own, e.g. another driver)."""

    def __init__(self, data_dir: Path, port: int, env: dict[str, str] | None = None, name: str = "desktop") -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = data_dir.parent / f"{data_dir.name}-{name}-bench.log"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, AENV_API_KEY=API_KEY, AENV_DISK_HEADROOM_MB="512", AENV_WARM_POOL="0", **(env or {}))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "aenv.cli.main", "server", "--port", str(port), "--data-dir", str(data_dir)],
            stdout=open(self.log, "ab"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.api = httpx.Client(base_url=self.url, headers={"X-API-Key": API_KEY}, timeout=600)

    def wait_for_base(self, timeout: float = 3600) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"aenv server exited: see {self.log}")
            try:
                if "base" in self.api.get("/health").json()["templates"]:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"`base` not ready in {timeout:.0f}s: see {self.log}")

    def ensure_desktop(self) -> float | None:
        """Build `desktop` if missing: its build's seconds (None if it was there)."""
        if self.api.get("/templates/desktop").status_code == 200:
            return None
        started = time.monotonic()
        last: dict[str, Any] = {}
        with self.api.stream("POST", "/templates/builtin/desktop", timeout=None) as r:
            for line in r.iter_lines():
                if line.strip():
                    last = json.loads(line)
                    if "log" in last and not str(last["log"]).startswith(QUIET):
                        console.print(f"  {last['log']}", markup=False, highlight=False)
        if "template" not in last:
            raise RuntimeError(f"the desktop build failed: {last}")
        return time.monotonic() - started

    def empty(self) -> None:
        for item in self.api.get("/v2/sandboxes").json():
            self.api.delete(f"/sandboxes/{item['sandboxID']}")

    def fork(self, sandbox_id: str, count: int) -> tuple[float, list[str]]:
        started = time.perf_counter()
        r = self.api.post(f"/sandboxes/{sandbox_id}/fork", json={"count": count})
        took = time.perf_counter() - started
        r.raise_for_status()
        return took, [item["sandbox"]["sandboxID"] for item in r.json()]

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else float("nan")


def idle_then_fork(server: Server, sandbox_id: str, kind: str, out: dict[str, list[float]]) -> None:
    """The sandbox's host memory once left alone (it is alone on the node), then a fork x4 of it."""
    time.sleep(IDLE_SETTLE)
    out[f"{kind}_idle_pss"].append(runsc_pss()[0])
    took, children = server.fork(sandbox_id, 4)
    out[f"{kind}_fork4"].append(took)
    for child in children:
        server.api.delete(f"/sandboxes/{child}")


def one_round(server: Server, out: dict[str, list[float]]) -> None:
    from e2b import Sandbox as Plain
    from e2b_desktop import Sandbox

    # The desktop: create to first screenshot, actions, fork x4, memory idle and paused.
    started = time.perf_counter()
    desktop = Sandbox.create(timeout=600)
    desktop.screenshot()
    out["desktop_create_to_screenshot"].append(time.perf_counter() - started)
    for i in range(ACTIONS):
        t = time.perf_counter()
        desktop.move_mouse(100 + i * 10, 100 + i * 5)
        desktop.screenshot()
        out["action_and_screenshot"].append(time.perf_counter() - t)
        t = time.perf_counter()
        desktop.commands.run("true")
        out["bare_command"].append(time.perf_counter() - t)
    idle_then_fork(server, desktop.sandbox_id, "desktop", out)
    desktop.beta_pause()
    out["desktop_paused_pss"].append(runsc_pss()[0])
    server.api.delete(f"/sandboxes/{desktop.sandbox_id}")
    # The baseline: a plain `base` sandbox, created, one command, forked x4.
    started = time.perf_counter()
    plain = Plain.create("base", timeout=600)
    plain.commands.run("true")
    out["base_create_to_command"].append(time.perf_counter() - started)
    idle_then_fork(server, plain.sandbox_id, "base", out)
    plain.kill()


def render(r: dict[str, Any]) -> None:
    m = r["medians"]
    table = Table(title=f"desktop sandboxes ({r['rounds']} rounds, medians)")
    for col in ("", "desktop", "baseline", "ratio", "target"):
        table.add_column(col)
    rows = [
        ("create to first screenshot, ms", "desktop_create_to_screenshot", "base_create_to_command", "<= 2000"),
        ("action + screenshot, ms", "action_and_screenshot", "bare_command", "<= 150 p50"),
        ("fork x4, ms", "desktop_fork4", "base_fork4", "<= 2000"),
    ]
    for label, mine, base, target in rows:
        table.add_row(label, f"{m[mine]:.0f}", f"{m[base]:.0f}", f"{m[mine] / m[base]:.2f}x", target)
    table.add_row("idle PSS, MiB", f"{m['desktop_idle_pss']:.0f}", f"{m['base_idle_pss']:.0f}", "", "<= 150")
    table.add_row("paused PSS, MiB", f"{m['desktop_paused_pss']:.0f}", "", "", "0")
    console.print(table)
    if r.get("build_seconds"):
        console.print(f"desktop template built in {r['build_seconds']:.0f}s")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench desktop", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--port", type=int, default=3980)
    parser.add_argument("--out", type=Path, default=Path("bench/results/desktop.json"))
    args = parser.parse_args(argv)
    server = Server(args.data_dir, args.port)
    os.environ.update(E2B_API_URL=server.url, E2B_SANDBOX_URL=server.url, E2B_API_KEY=API_KEY)
    os.environ.pop("E2B_DEBUG", None)
    try:
        server.wait_for_base()
        build = server.ensure_desktop()
        server.empty()
        samples: dict[str, list[float]] = {
            key: []
            for key in (
                "desktop_create_to_screenshot",
                "base_create_to_command",
                "action_and_screenshot",
                "bare_command",
                "desktop_fork4",
                "base_fork4",
                "desktop_idle_pss",
                "base_idle_pss",
                "desktop_paused_pss",
            )
        }
        for i in range(args.rounds):
            console.print(f"round {i + 1}/{args.rounds}")
            one_round(server, samples)
    finally:
        server.stop()
    medians = {k: (statistics.median(v) / 2**20 if k.endswith("_pss") else median_ms(v)) for k, v in samples.items()}
    results = {
        "rounds": args.rounds,
        "build_seconds": build,
        "medians": medians,
        "samples": samples,
        "machine": machine(),
    }
    render(results)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
