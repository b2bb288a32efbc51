"""The execution tax: a SWE-style step mix natively and inside sandboxes, phase by phase.

`python -m bench workload [--configs ptrace,systrap,...] [--rounds N] [--scale F] [--out FILE]`
(root, runsc). The mix (bench/mix.py: spawns, Python starts, 3,000 files written, find/grep/du,
tar, compileall, git, a CPU loop, 150k stats, pip install from a local wheel directory, a pytest
run of a few hundred tests) runs:

- natively: chrooted (as the sandbox's user) into an overlay of the `base` template's own layers
  on the host, so the binaries and files are the same ones;
- inside one sandbox per configuration (a node per configuration: platform and runsc flags).

Rounds are interleaved (native, then each configuration, then again) and medians reported, since
the same workload moves by tens of percent from one minute to the next on these VMs. Prints seconds
and ratios to native per phase and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.runtime.gvisor import PATH
from aenv.templates.builder import ensure_base, run_in
from bench.platforms import put_file, pytest_wheels

console = Console()
# The mix works in the user's home, on the sandbox's disk: runsc mounts a tmpfs (the sandbox's
# memory) at an image's empty /tmp, which native has no counterpart of.
HOME = "/home/user"
WORK = f"{HOME}/w"
MIX = Path(__file__).with_name("mix.py")
Seconds = dict[str, float]  # phase -> seconds (or a ratio)


@dataclass(frozen=True)
class Config:
    """One way of running sandboxes: a runsc platform and extra runsc flags."""

    label: str
    platform: str
    flags: str = ""
    settings: tuple[tuple[str, str], ...] = ()  # node settings (cpu_count=2): the sandboxes' defaults


QEMU_SIZE = (("cpu_count", "2"), ("memory_mb", "2048"))  # room for the mix's pip and pytest
# The options measured (--configs takes these labels, or `platform[+flag+flag]`).
KNOWN = {
    "ptrace": Config("ptrace", "ptrace"),
    "systrap": Config("systrap", "systrap"),
    "ptrace-cap": Config("ptrace-cap", "ptrace", "", (("cpu_limit", "cap"),)),
    "systrap-cap": Config("systrap-cap", "systrap", "", (("cpu_limit", "cap"),)),
    "systrap-nodirectfs": Config("systrap-nodirectfs", "systrap", "--directfs=false"),
    "systrap-shared": Config("systrap-shared", "systrap", "--file-access=shared"),
    "systrap-overlay-mem": Config("systrap-overlay-mem", "systrap", "--overlay2=root:memory"),
    "systrap-overlay-self": Config("systrap-overlay-self", "systrap", "--overlay2=root:self"),
    "ptrace-overlay-mem": Config("ptrace-overlay-mem", "ptrace", "--overlay2=root:memory"),
    # The microVM driver (a QEMU microvm per sandbox): TCG here, where no guest boots on /dev/kvm;
    # `qemu-kvm` on a host where one does. Its sandboxes are the template's size: 2 vCPUs, 2 GiB.
    "qemu-tcg": Config("qemu-tcg", "qemu", "", (("driver", "qemu"), ("qemu_accel", "tcg"), *QEMU_SIZE)),
    "qemu-kvm": Config("qemu-kvm", "qemu", "", (("driver", "qemu"), ("qemu_accel", "kvm"), *QEMU_SIZE)),
}


def parse_config(text: str) -> Config:
    if text in KNOWN:
        return KNOWN[text]
    name, *rest = text.split("+")
    flags = [x for x in rest if x.startswith("-")]
    settings = tuple(tuple(x.split("=", 1)) for x in rest if not x.startswith("-") and "=" in x)
    return Config(text, name, " ".join(flags), settings)  # type: ignore[arg-type]


def wheels(cache: Path) -> Path:
    """pytest's wheels (and its dependencies'), downloaded once by the host's pip."""
    pytest_wheels(cache)
    return cache


class Native:
    """The mix chrooted into an overlay of the template's layers: same files, no sandbox."""

    def __init__(self, layers: list[Path], wheel_dir: Path) -> None:
        # Writes land on the host's own disk, as a program run natively writes. (On a node's upper,
        # a fresh ext4 disk image, native rounds after the first ran 2.5x slower: background
        # inode-table initialisation and loop writeback; the sandboxes' rounds did not.)
        self.top = Path(tempfile.mkdtemp(prefix="aenv-native-", dir="/var/tmp"))
        self.root = self.top / "root"
        for d in ("upper", "work", "root"):
            (self.top / d).mkdir()
        lower = ":".join(str(p) for p in reversed(layers))
        opts = f"lowerdir={lower},upperdir={self.top / 'upper'},workdir={self.top / 'work'}"
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o", opts, str(self.root)], check=True)
        for point, how in (("proc", ["-t", "proc", "proc"]), ("dev", ["--rbind", "/dev"])):
            subprocess.run(["mount", *how, str(self.root / point)], check=True)
        shutil.copy(MIX, self.root / "tmp" / "mix.py")
        shutil.copytree(wheel_dir, self.root / "tmp" / "wheels")
        subprocess.run(["chmod", "-R", "a+rX", str(self.root / "tmp" / "wheels")], check=True)

    def run(self, scale: float) -> dict[str, float]:
        argv = ["chroot", "--userspec=1000:1000", str(self.root), "env", "-i", f"PATH={PATH}",
                f"HOME={HOME}", "python3", "/tmp/mix.py", WORK, "--wheels", "/tmp/wheels",
                "--scale", str(scale)]  # fmt: skip
        out = subprocess.run(argv, check=True, capture_output=True, text=True).stdout
        return dict(json.loads(out.strip().splitlines()[-1]))

    def close(self) -> None:
        for point in ("dev", "proc", ""):
            subprocess.run(["umount", "-R", "-l", str(self.root / point)], check=False)
        shutil.rmtree(self.top, ignore_errors=True)


class Inside:
    """The mix inside a sandbox of a node running one configuration."""

    def __init__(self, config: Config, data_dir: Path) -> None:
        self.config = config
        runsc = {"runsc_platform": config.platform, "runsc_flags": config.flags} if config.platform != "qemu" else {}
        self.settings = Settings(
            data_dir=data_dir,
            max_sandboxes=20,
            **runsc,  # type: ignore[arg-type]
            **dict(config.settings),  # type: ignore[arg-type]
        )
        self.node = Node(self.settings)
        self.sandbox = ""

    async def start(self, wheel_dir: Path) -> list[Path]:
        await self.node.start()
        rec = await ensure_base(self.node, on_log=lambda line: console.print(f"  {line}"))
        created = await self.node.create("base", SandboxSpec(timeout=24 * 3600))
        self.sandbox = created.id
        link = self.node.get(self.sandbox).link
        await put_file(link, "/tmp/mix.py", MIX.read_bytes())
        for wheel in sorted(wheel_dir.glob("*.whl")):
            await put_file(link, f"/tmp/wheels/{wheel.name}", wheel.read_bytes())
        return [self.node.instances.files.layer(x) for x in rec.layers]

    async def run(self, scale: float) -> dict[str, float] | None:
        link = self.node.get(self.sandbox).link
        assert link is not None
        ran = await run_in(link, f"cd {HOME} && python3 /tmp/mix.py {WORK} --wheels /tmp/wheels --scale {scale}",
                           user="user")  # fmt: skip
        if ran.code != 0:
            console.print(f"  [red]{self.config.label} failed ({ran.code}): {ran.output.strip()[-400:]}[/red]")
            return None
        return dict(json.loads(ran.output.strip().splitlines()[-1]))

    async def close(self) -> None:
        try:
            if self.sandbox:
                await self.node.kill(self.sandbox)
        finally:
            await self.node.stop(pause_running=False)


async def seed_data_dirs(top: Path, count: int) -> None:
    """`base` built once (in c0) and copied to every other configuration's node, which recommits
    it on its own runsc in seconds: debootstrap once, not once per configuration."""
    first = top / "c0"
    if not (first / "aenv.db").exists():
        node = Node(Settings(data_dir=first))
        await node.start()
        try:
            await ensure_base(node, on_log=lambda line: console.print(f"  {line}"))
        finally:
            await node.stop(pause_running=False)
    for i in range(1, count):
        other = top / f"c{i}"
        if not (other / "aenv.db").exists():
            copy = ["cp", "-a", "--sparse=always", str(first), str(other)]
            await asyncio.to_thread(subprocess.run, copy, check=True)


def medians(rounds: list[dict[str, float]]) -> dict[str, float]:
    phases = list(rounds[0]) if rounds else []
    out = {p: statistics.median(r[p] for r in rounds if p in r) for p in phases}
    out["total"] = statistics.median(sum(r.values()) for r in rounds)
    return out


def round_ratios(rounds: list[dict[str, float]], native: list[dict[str, float]]) -> dict[str, float]:
    """Per phase, the median over rounds of (this round's time / native's in the same round): what
    the machine did meanwhile weighs on both sides of each ratio (native's own total moved from
    11 to 17 s between rounds of one run here)."""
    pairs = [(r, n) for r, n in zip(rounds, native, strict=False) if r and n]
    out = {p: statistics.median(r[p] / n[p] for r, n in pairs if p in r and n.get(p)) for p in pairs[0][0]}
    out["total"] = statistics.median(sum(r.values()) / sum(n.values()) for r, n in pairs)
    return out


def render(native: Seconds, per_config: dict[str, Seconds], ratios: dict[str, Seconds]) -> None:
    table = Table(title="the mix: median seconds (median per-round ratio to native)", header_style="bold")
    table.add_column("phase")
    table.add_column("native", justify="right")
    for label in per_config:
        table.add_column(label, justify="right")
    for phase in native:
        cells = [f"{native[phase]:.2f}"]
        for label, times in per_config.items():
            t = times.get(phase)
            cells.append(f"{t:.2f} ({ratios[label][phase]:.1f}x)" if t is not None else "-")
        table.add_row(phase, *cells, style="bold" if phase == "total" else None)
    Console(width=max(100, 24 * (len(per_config) + 2))).print(table)


def markdown(native: Seconds, per_config: dict[str, Seconds], ratios: dict[str, Seconds]) -> str:
    """The table as docs/performance.md shows it."""
    lines = ["| phase | native s | " + " | ".join(per_config) + " |", "|---" * (len(per_config) + 2) + "|"]
    for phase in native:
        cells = [f"{per_config[c][phase]:.2f} ({ratios[c][phase]:.1f}x)" for c in per_config if phase in per_config[c]]
        bold = "**" if phase == "total" else ""
        lines.append(f"| {bold}{phase}{bold} | {native[phase]:.2f} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


async def amain(args: argparse.Namespace) -> None:
    configs = [parse_config(c) for c in args.configs.split(",")]
    wheel_dir = wheels(args.wheels)
    insides: list[Inside] = []
    native: Native | None = None
    rounds: dict[str, list[dict[str, float]]] = {"native": [], **{c.label: [] for c in configs}}
    try:
        await seed_data_dirs(args.data_dir, len(configs))
        for i, config in enumerate(configs):
            console.print(f"[bold]{config.label}[/bold]: node and sandbox")
            inside = Inside(config, args.data_dir / f"c{i}")
            insides.append(inside)
            layers = await inside.start(wheel_dir)
            if native is None:
                native = Native(layers, wheel_dir)
        assert native is not None
        for r in range(args.rounds):
            console.print(f"round {r + 1}/{args.rounds}")
            started = time.perf_counter()
            rounds["native"].append(await asyncio.to_thread(native.run, args.scale))
            console.print(f"  native {time.perf_counter() - started:.1f} s")
            for inside in insides:
                started = time.perf_counter()
                got = await inside.run(args.scale)
                if got is not None:
                    rounds[inside.config.label].append(got)
                console.print(f"  {inside.config.label} {time.perf_counter() - started:.1f} s")
    finally:
        if native is not None:
            native.close()
        for inside in insides:
            await inside.close()
    summary = {label: medians(rs) for label, rs in rounds.items() if rs}
    ratios = {label: round_ratios(rs, rounds["native"]) for label, rs in rounds.items() if rs and label != "native"}
    render(summary["native"], {k: v for k, v in summary.items() if k != "native"}, ratios)
    out = {
        "medians_s": summary,
        "ratios": ratios,  # median per-round ratios to native
        "rounds": rounds,
        "configs": {c.label: {"platform": c.platform, "flags": c.flags, **dict(c.settings)} for c in configs},
        "scale": args.scale,
        "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "load": os.getloadavg()},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    others = {k: v for k, v in summary.items() if k != "native"}
    args.out.with_suffix(".md").write_text(markdown(summary["native"], others, ratios))
    console.print(f"JSON: {args.out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench workload", description=__doc__)
    parser.add_argument("--configs", default="ptrace,systrap", help=f"labels ({', '.join(KNOWN)}) or platform+flag")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--scale", type=float, default=1.0, help="every phase's size times this")
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench-workload"))
    parser.add_argument("--wheels", type=Path, default=Path("/var/tmp/aenv-bench-wheels"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/workload.json"))
    asyncio.run(amain(parser.parse_args(argv)))


if __name__ == "__main__":
    main()
