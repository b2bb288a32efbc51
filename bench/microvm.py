"""The lifecycle per driver: `python -m bench microvm [--rounds N] [--data-dir DIR] [--out FILE]` (root).

Runs two `aenv server`s on `base` (debootstrapped once per data dir): the default driver (gVisor)
and the qemu driver (a microVM per sandbox; TCG on a host without a usable KVM, as here), and
drives both with aenv's SDK in interleaved rounds (a round on one, then on the other), so each
sees the same moments of this machine:

- create from the template's image and run a first command;
- pause, and resume (the first command after it included);
- snapshot of a running sandbox (it stays running);
- fork of a running sandbox into 4 (per child, amortised);
- host memory (PSS of the driver's processes, the sandboxes alone on their node): one idle
  sandbox, each of 4 forked children once idle, a paused sandbox.

The qemu driver's own part of a restore (QEMU started until the VM runs: ``qemu_restore``) is
timed inside it, the raw baseline of a create. Medians; prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from bench.__main__ import machine, pss_where, write_results
from bench.desktop import API_KEY, Server

console = Console()
IDLE_SETTLE = 10.0  # seconds sandboxes are left alone before their memory is read
DRIVERS: dict[str, dict[str, str]] = {
    "gvisor": {},
    "qemu": {"AENV_DRIVER": "qemu"},
}
MATCH: dict[str, Callable[[bytes], bool]] = {
    "gvisor": lambda cmdline: os.path.basename(cmdline.split(b"\0", 1)[0]).startswith(b"runsc"),
    "qemu": lambda cmdline: os.path.basename(cmdline.split(b"\0", 1)[0]).startswith(b"qemu-system"),
}


def one_round(driver: str, server: Server, out: dict[str, list[float]]) -> None:
    from aenv.sdk import Client

    pss = MATCH[driver]
    with Client(url=server.url, api_key=API_KEY) as client:
        started = time.perf_counter()
        sbx = client.create("base")
        sbx.exec("true")
        out[f"{driver}_create"].append(time.perf_counter() - started)
        t = time.perf_counter()
        sbx.exec("true")
        out[f"{driver}_command"].append(time.perf_counter() - t)
        sbx.exec("head -c 200000000 /dev/urandom > /dev/shm/touched")  # 190 MiB of guest memory in use
        time.sleep(IDLE_SETTLE)
        out[f"{driver}_idle_pss"].append(pss_where(pss)[0])
        t = time.perf_counter()
        snap = sbx.snapshot()
        out[f"{driver}_snapshot"].append(time.perf_counter() - t)
        t = time.perf_counter()
        children = sbx.fork(4)
        out[f"{driver}_fork4_per_child"].append((time.perf_counter() - t) / 4)
        sbx.kill()
        time.sleep(IDLE_SETTLE)
        out[f"{driver}_forked_child_pss"].append(pss_where(pss)[0] / 4)
        for child in children:
            child.kill()
        other = client.create("base")
        other.exec("true")
        t = time.perf_counter()
        other.pause()
        out[f"{driver}_pause"].append(time.perf_counter() - t)
        time.sleep(2)
        out[f"{driver}_paused_pss"].append(pss_where(pss)[0])
        t = time.perf_counter()
        again = client.connect(other.sandbox_id)
        again.exec("true")
        out[f"{driver}_resume"].append(time.perf_counter() - t)
        again.kill()
        server.api.delete(f"/snapshots/{snap}")


def render(r: dict[str, Any]) -> None:
    m = r["medians"]
    table = Table(title=f"lifecycle per driver ({r['rounds']} rounds, medians; qemu: {r['qemu_platform']})")
    for col in ("", "gvisor", "qemu", "qemu / gvisor", "target (qemu, TCG)"):
        table.add_column(col)
    rows = [
        ("create + first command, ms", "create", 1000, "<= 300 (restore)"),
        ("command, ms", "command", 1000, ""),
        ("pause, ms", "pause", 1000, "<= 300"),
        ("resume + command, ms", "resume", 1000, "<= 300"),
        ("snapshot (source runs on), ms", "snapshot", 1000, ""),
        ("fork x4, per child, ms", "fork4_per_child", 1000, "<= 300"),
        ("idle sandbox (190 MiB touched), PSS MiB", "idle_pss", 2**-20, ""),
        ("forked child, PSS MiB", "forked_child_pss", 2**-20, "<= 64"),
        ("paused sandbox, PSS MiB", "paused_pss", 2**-20, "0"),
    ]
    for label, key, scale, target in rows:
        g, q = m[f"gvisor_{key}"] * scale, m[f"qemu_{key}"] * scale
        table.add_row(label, f"{g:.0f}", f"{q:.0f}", f"{q / g:.2f}x" if g else "", target)
    console.print(table)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench microvm", description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench-microvm"))
    parser.add_argument("--port", type=int, default=3970)
    parser.add_argument("--out", type=Path, default=Path("bench/results/microvm.json"))
    args = parser.parse_args(argv)
    servers = {}
    for i, (name, env) in enumerate(DRIVERS.items()):
        servers[name] = Server(args.data_dir / name, args.port + i, env, name=name)
    samples: dict[str, list[float]] = {}
    try:
        for server in servers.values():
            server.wait_for_base()
            server.empty()
        platform = servers["qemu"].api.get("/health").json()["runtime"]["platform"]
        for i in range(args.rounds):
            for name, server in servers.items():
                console.print(f"round {i + 1}/{args.rounds}: {name}")
                round_samples: dict[str, list[float]] = defaultdict(list)
                one_round(name, server, round_samples)
                for key, values in round_samples.items():
                    samples.setdefault(key, []).extend(values)
    finally:
        for server in servers.values():
            server.stop()
    results = {
        "rounds": args.rounds,
        "qemu_platform": platform,
        "medians": {k: statistics.median(v) for k, v in samples.items()},
        "samples": samples,
        "machine": machine(),
        "load_average": os.getloadavg(),
    }
    render(results)
    write_results(args.out, results)
