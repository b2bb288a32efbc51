"""Image and build benchmarks: `python -m bench.images [--layer-mib N]` (root, runsc, docker-registry);
`python -m bench.images --tasks 50` measures a task image per rollout instead (bench/image_tasks.py).

Pull throughput of a made-up image from a registry on loopback (baseline in the same run: the
same blobs downloaded with plain HTTP, nothing unpacked), a pull of the same image once its layers
are cached, and a Dockerfile build cold, rebuilt unchanged, and rebuilt after one COPY input changed.
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.images.pull import pull, release
from aenv.node.orchestrator import Node
from aenv.templates import build
from bench import image_tasks
from bench.__main__ import write_results
from tests.images.oci import LayerTar, busybox_layer, start_registry

console = Console()

DOCKERFILE = """FROM {image}
RUN dd if=/dev/urandom of=/data.bin bs=1M count=16 2>/dev/null
COPY ctx/ /app/
RUN ls -R /app > /app.list
CMD ["/bin/sh", "-c", "sleep 100000"]
"""


async def timed(fn: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    result = await fn()
    return time.perf_counter() - start, result


def raw_download(url: str, repo: str) -> float:
    """Seconds to fetch every layer blob of ``repo:1`` over plain HTTP, unpacking nothing."""
    with httpx.Client(timeout=300) as client:
        accept = {"Accept": "application/vnd.oci.image.manifest.v1+json"}
        manifest = client.get(f"{url}/v2/{repo}/manifests/1", headers=accept).json()
        start = time.perf_counter()
        for digest in [layer["digest"] for layer in manifest["layers"]]:
            with client.stream("GET", f"{url}/v2/{repo}/blobs/{digest}") as r:
                for _ in r.iter_bytes(1 << 20):
                    pass
    return time.perf_counter() - start


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    shutil.rmtree(args.data_dir, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-images-"))
    (work / "registry").mkdir()
    registry_gen = start_registry(work / "registry")
    registry = next(registry_gen)
    node = Node(Settings(data_dir=args.data_dir, build_base=False))
    await node.start()
    try:
        console.print(f"[bold]pull[/bold]: 2 layers of {args.layer_mib} MiB random data (gzip)")
        big = [LayerTar().file(f"blob{i}", os.urandom(args.layer_mib * 2**20)).bytes() for i in range(2)]
        registry.push_image("bench/big", "1", [(busybox_layer().bytes(), "gzip"), *[(b, "gzip") for b in big]])
        baseline = await asyncio.to_thread(raw_download, registry.url, "bench/big")
        dt, pulled = await timed(lambda: pull(node, f"{registry.host}/bench/big:1"))
        release(node, pulled)
        mib = pulled.fetched_bytes / 2**20
        results["pull_cold"] = {
            "seconds": dt,
            "mib": mib,
            "mib_per_s": mib / dt,
            "baseline": "plain HTTP download of the same blobs",
            "baseline_seconds": baseline,
            "ratio": dt / baseline,
        }
        dt, pulled = await timed(lambda: pull(node, f"{registry.host}/bench/big:1"))
        release(node, pulled)
        results["pull_cached"] = {"seconds": dt, "cached_layers": pulled.cached_layers}

        console.print("[bold]build[/bold]: FROM + RUN + COPY + RUN + CMD")
        registry.push_image("bench/base", "1", [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")])
        ctx = work / "context"
        (ctx / "ctx").mkdir(parents=True)
        for i in range(50):
            (ctx / "ctx" / f"f{i}.txt").write_text(f"file {i}\n" * 100)
        text = DOCKERFILE.format(image=f"{registry.host}/bench/base:1")

        async def one() -> Any:
            return await build.build(node, name="bench", dockerfile=text, context=ctx)

        results["build_cold"] = {"seconds": (await timed(one))[0]}
        results["build_cached"] = {"seconds": (await timed(one))[0]}
        (ctx / "ctx" / "f0.txt").write_text("changed\n")
        results["build_after_copy_change"] = {"seconds": (await timed(one))[0]}
    finally:
        await node.stop(pause_running=False)
        next(registry_gen, None)
        shutil.rmtree(work, ignore_errors=True)
    return results


def render(results: dict[str, Any]) -> None:
    table = Table(title="images and builds on this machine", header_style="bold")
    for col in ("what", "seconds", "detail"):
        table.add_column(col)
    cold = results["pull_cold"]
    table.add_row(
        "pull, cold",
        f"{cold['seconds']:.2f}",
        f"{cold['mib']:.0f} MiB at {cold['mib_per_s']:.0f} MiB/s; plain download {cold['baseline_seconds']:.2f} s "
        f"({cold['ratio']:.1f}x)",
    )
    table.add_row("pull, layers cached", f"{results['pull_cached']['seconds']:.2f}", "")
    table.add_row("Dockerfile build, cold", f"{results['build_cold']['seconds']:.2f}", "2 RUN, 1 COPY, start command")
    table.add_row("rebuild, unchanged", f"{results['build_cached']['seconds']:.2f}", "every step from the cache")
    table.add_row("rebuild, one COPY input changed", f"{results['build_after_copy_change']['seconds']:.2f}", "")
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.images", description=__doc__)
    parser.add_argument("--layer-mib", type=int, default=64)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench-images"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/images.json"))
    image_tasks.add_arguments(parser)
    args = parser.parse_args()
    if args.tasks:  # a task image per rollout (bench/image_tasks.py)
        image_tasks.main(args)
        return
    results = asyncio.run(run(args))
    render(results)
    write_results(args.out, results)


if __name__ == "__main__":
    main()
