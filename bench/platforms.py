"""runsc platforms on agent work: `python -m bench.platforms [--platforms ptrace,systrap] [--rounds N]
[--data-dir DIR] [--out FILE]` (root, runsc).

For each platform, a node on it (`AENV_RUNSC_PLATFORM`) and real agent work in one of its sandboxes:
create from `base`, the exec round trip of `true`, Python's start with `import json, asyncio`, a
process spawned by a shell, a system-call bound loop (stat), a small pytest run and a `pip install`
of a local wheel (when the image has pip), then snapshot and fork of 4. Times inside the sandbox are
measured inside it. `base` has no pytest: its wheels (and its dependencies') are downloaded once on
the host (`--wheels DIR`, kept between runs) and installed into the sandbox offline before the
work. Prints one column per platform and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.templates.builder import ensure_base, run_in
from bench.__main__ import exec_round_trips, summary, timed

console = Console()

# Each prints a JSON list of seconds, timed inside the sandbox (the first runs warm caches up).
INSIDE = {
    "python3 -c 'import json, asyncio'": """
import subprocess, sys, time, json
ts = []
for _ in range(ROUNDS + 1):
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import json, asyncio"])
    ts.append(time.perf_counter() - t)
print(json.dumps(ts[1:]))
""",
    "sh -c 'for 20 x /bin/true' (spawn)": """
import subprocess, time, json
ts = []
for _ in range(ROUNDS + 1):
    t = time.perf_counter(); subprocess.run(["/bin/sh", "-c", "for i in $(seq 20); do /bin/true; done"])
    ts.append(time.perf_counter() - t)
print(json.dumps(ts[1:]))
""",
    "20000 x stat (system calls)": """
import os, time, json
ts = []
for _ in range(ROUNDS + 1):
    t = time.perf_counter()
    for _ in range(20000): os.stat("/")
    ts.append(time.perf_counter() - t)
print(json.dumps(ts[1:]))
""",
    "pytest, 20 small tests": """
import os, subprocess, sys, time, json
os.makedirs("/tmp/proj", exist_ok=True)
with open("/tmp/proj/test_small.py", "w") as f:
    f.write("import pytest\\n@pytest.mark.parametrize('n', range(20))\\n")
    f.write("def test_n(n):\\n    assert sum(range(n)) == n * (n - 1) // 2\\n")
if subprocess.run([sys.executable, "-m", "pytest", "--version"], capture_output=True).returncode != 0:
    print("null"); raise SystemExit
ts = []
for _ in range(ROUNDS // 2 + 1):
    t = time.perf_counter()
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "/tmp/proj"]
    subprocess.run(argv, capture_output=True, check=True)
    ts.append(time.perf_counter() - t)
print(json.dumps(ts[1:]))
""",
    "pip install of a local wheel": """
import os, subprocess, sys, time, json, zipfile
if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
    print("null"); raise SystemExit
wheel = "/tmp/aenvbench-1.0-py3-none-any.whl"
with zipfile.ZipFile(wheel, "w") as z:
    z.writestr("aenvbench/__init__.py", "X = 1\\n")
    z.writestr("aenvbench-1.0.dist-info/METADATA", "Metadata-Version: 2.1\\nName: aenvbench\\nVersion: 1.0\\n")
    z.writestr("aenvbench-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\\nRoot-Is-Purelib: true\\nTag: py3-none-any\\n")
    z.writestr("aenvbench-1.0.dist-info/RECORD", "")
ts = []
for _ in range(ROUNDS // 2 + 1):
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--force-reinstall",
                    "--break-system-packages", "--target", "/tmp/site", wheel], capture_output=True, check=True)
    ts.append(time.perf_counter() - t)
print(json.dumps(ts[1:]))
""",
}


PYTEST_WHEELS = ["pytest"]  # with their dependencies (pluggy, iniconfig, packaging)


def pytest_wheels(cache: Path) -> list[Path]:
    """pytest's wheels for the sandbox's Python, downloaded once into ``cache`` by the host's pip."""
    if not list(cache.glob("pytest-*.whl")):
        cache.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:", "-d", str(cache)]
        subprocess.run([*argv, *PYTEST_WHEELS], check=True)
    return sorted(cache.glob("*.whl"))


async def put_file(link: Any, path: str, data: bytes) -> None:
    """Write ``data`` at ``path`` inside the sandbox, as the files API does (the agent's fs.write)."""
    stream = await link.open("fs.write", {"path": path, "user": "user", "metadata": {}})
    for i in range(0, len(data), 1 << 20):
        await stream.send_data(data[i : i + (1 << 20)])
    await stream.send_eof()
    await stream.result()


async def install_pytest(link: Any, wheels: list[Path]) -> bool:
    for wheel in wheels:
        await put_file(link, f"/tmp/wheels/{wheel.name}", wheel.read_bytes())
    argv = "python3 -m pip install -q --no-index --find-links /tmp/wheels --break-system-packages --user pytest"
    ran = await run_in(link, argv, user="user")
    if ran.code != 0:
        console.print(f"  [yellow]pytest not installed ({ran.code}): {ran.output.strip()[-300:]}[/yellow]")
    return ran.code == 0


async def inside(link: Any, script: str, rounds: int) -> list[float] | None:
    ran = await run_in(link, f"python3 - <<'EOF'\n{script.replace('ROUNDS', str(rounds))}\nEOF", user="user")
    if ran.code != 0:
        console.print(f"  [yellow]failed ({ran.code}): {ran.output.strip()[-300:]}[/yellow]")
        return None
    return json.loads(ran.output.strip().splitlines()[-1])


async def on_platform(args: argparse.Namespace, name: str) -> dict[str, Any]:
    settings = Settings(data_dir=args.data_dir, runsc_platform=name, max_sandboxes=100, max_fork=16)
    node = Node(settings)
    await node.start()
    results: dict[str, Any] = {"runtime": node.runtime_info()}
    try:
        await ensure_base(node, on_log=lambda line: console.print(f"  {line}"))
        console.print(f"[bold]{name}[/bold]: create x{args.rounds}")
        creates, ids = [], []
        for _ in range(args.rounds):
            await node.settle()
            dt, rec = await timed(lambda: node.create("base", SandboxSpec(timeout=3600)))
            creates.append(dt)
            ids.append(rec.id)
        results["create"] = summary(creates)
        sb = node.get(ids[0])
        await install_pytest(sb.link, pytest_wheels(args.wheels))
        ours, bare = await exec_round_trips(sb.link, blocks=3)
        results["exec round trip (true)"] = summary(ours)
        results["bare spawn inside"] = summary(bare)
        for label, script in INSIDE.items():
            console.print(f"  {label}")
            times = await inside(sb.link, script, args.rounds)
            if times:
                results[label] = summary(times)
        for label, op in (
            ("snapshot", lambda: node.snapshot(ids[0])),
            ("fork of 4", lambda: node.fork(ids[0], count=4)),
        ):
            times = []
            for _ in range(max(3, args.rounds // 3)):
                await node.settle()
                dt, res = await timed(op)
                times.append(dt)
                for child in res if isinstance(res, list) else []:
                    if child.sandbox is not None:
                        await node.kill(child.sandbox.id)
            results[label] = summary(times)
        for sid in ids:
            await node.kill(sid)
    finally:
        await node.stop(pause_running=False)
    return results


def render(per_platform: dict[str, dict[str, Any]]) -> None:
    table = Table(title="runsc platforms on this machine (p50 ms)", header_style="bold")
    table.add_column("work")
    for name in per_platform:
        table.add_column(name)
    rows = [k for k in next(iter(per_platform.values())) if k != "runtime"]
    for row in rows:
        cells = [per_platform[p].get(row, {}).get("p50_ms") for p in per_platform]
        table.add_row(row, *(f"{c:.1f}" if c is not None else "-" for c in cells))
    console.print(table)


async def amain(args: argparse.Namespace) -> None:
    per_platform = {}
    for name in args.platforms.split(","):
        per_platform[name] = await on_platform(args, name)
    render(per_platform)
    out = {
        "platforms": per_platform,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    console.print(f"JSON: {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.platforms", description=__doc__)
    parser.add_argument("--platforms", default="ptrace,systrap")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench"))
    parser.add_argument("--wheels", type=Path, default=Path("/var/tmp/aenv-bench-wheels"), help="pytest's wheels")
    parser.add_argument("--out", type=Path, default=Path("bench/results/platforms.json"))
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
