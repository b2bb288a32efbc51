"""`python -m bench.images --tasks 50`: a task image per rollout, as SWE-bench gives them (root,
runsc, docker-registry).

A registry on loopback serves N synthetic task images sharing a base (``--base-mib``), one layer
per repository (``--repos``, ``--repo-mib``) and one per task (``--task-mib``), each layer a few
hundred files, half random and half text. A node (no repository) then:

1. creates a sandbox from each image for the first time (pull, convert, boot, snapshot), each
   against the bare pull + unpack in the same run (``curl | tar -xz``, layer after layer) of the
   layers that create had to fetch (the base is fetched once), and on a sample against that of
   the whole image (every layer, as a machine without the base pulls it);
2. creates from images again (a restore of the template by its reference) against a plain
   template restore (a create by the template's id), alternately;
3. reports the bytes the node stores for the images' layers against the sum of the images' sizes
   and their unique layer bytes;
4. runs rollouts (``--rollouts``, tasks drawn at random, seed fixed) with a cache budget that holds
   ``--hold`` images: hit rate, evictions, create p50 / p95.

Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import REGISTRY
from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.templates import image_sources
from tests.images.oci import GzipLayer, LayerTar, Registry, busybox_layer, start_registry

console = Console()
MiB = 2**20


PHASES: dict[str, list[float]] = {"pull": [], "boot_snapshot": []}
WHOLE_EVERY = 5  # images whose whole image is also pulled bare: the first three and every fifth


def _instrument() -> None:
    """Time the two parts of a first create's build: the pull (download and unpack, streamed) and
    the boot and checkpoint of the build sandbox."""
    from aenv.images.pull import ImagePull
    from aenv.templates import images as image_templates

    fetch, commit = ImagePull.fetch_layers, getattr(image_templates, "commit_template")  # noqa: B009

    async def timed_fetch(self: ImagePull) -> Any:
        started = time.perf_counter()
        try:
            return await fetch(self)
        finally:
            PHASES["pull"].append(time.perf_counter() - started)

    async def timed_commit(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return await commit(*args, **kwargs)
        finally:
            PHASES["boot_snapshot"].append(time.perf_counter() - started)

    ImagePull.fetch_layers = timed_fetch  # type: ignore[method-assign]
    setattr(image_templates, "commit_template", timed_commit)  # noqa: B010 - what commit_image calls


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def files_layer(
    prefix: str, mib: float, rng: random.Random, layer: LayerTar | None = None, file_kib: float = 100.0
) -> bytes:
    """``mib`` of files of ``file_kib`` under ``prefix`` (a directory per 1,000): half random
    bytes, half text (compressible)."""
    layer = layer or LayerTar()
    layer.dir(prefix)
    count = max(1, int(mib * 1024 / file_kib))
    size = int(mib * MiB / count)
    for i in range(count):
        if i % 1000 == 0:
            layer.dir(f"{prefix}/d{i // 1000:03d}")
        if i % 2:
            data = rng.randbytes(size)
        else:
            line = f"{prefix} line {i} " + "x" * rng.randrange(20, 60) + "\n"
            data = (line * (size // len(line) + 1)).encode()[:size]
        layer.file(f"{prefix}/d{i // 1000:03d}/f{i:06d}.{'bin' if i % 2 else 'py'}", data)
    return layer.bytes()


@dataclass
class TaskImage:
    ref: str
    repo: str
    layers: list[tuple[str, int, int]]  # (blob digest, compressed bytes, uncompressed bytes)
    digest: str = ""

    @property
    def size(self) -> int:
        return sum(c for _, c, _ in self.layers)


def make_images(registry: Registry, args: argparse.Namespace) -> list[TaskImage]:
    rng = random.Random(1)
    kib = args.file_kib
    base = GzipLayer(files_layer("opt/conda", args.base_mib, rng, busybox_layer().dir("tmp", 0o1777), kib))
    repos: dict[int, GzipLayer] = {}
    images = []
    for t in range(args.tasks):
        r = t % args.repos
        if r not in repos:
            repos[r] = GzipLayer(files_layer(f"repo/r{r}", args.repo_mib, rng, file_kib=kib))
        layers = [base, repos[r], GzipLayer(files_layer(f"testbed/t{t}", args.task_mib, rng, file_kib=kib))]
        name = f"swebench/sweb.eval.x86_64.repo{r}__task-{t}"
        digest = registry.push_gzip_image(name, "latest", layers, env=["PATH=/bin", f"TASK={t}"])
        blobs = [(x.digest, len(x.blob), x.size) for x in layers]
        images.append(TaskImage(f"{registry.host}/{name}:latest", f"r{r}", blobs, digest))
    return images


def bare_pull(registry: Registry, image: TaskImage, blobs: list[str], into: Path) -> float:
    """Seconds for ``curl | tar -xz`` of ``blobs`` of the image, one after the other."""
    repo = image.ref.split("/", 1)[1].rsplit(":", 1)[0]
    into.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for i, digest in enumerate(blobs):
        target = into / str(i)
        target.mkdir()
        url = f"{registry.url}/v2/{repo}/blobs/{digest}"
        subprocess.run(f"curl -sfL '{url}' | tar -xzf - -C '{target}'", shell=True, check=True)
    took = time.perf_counter() - started
    shutil.rmtree(into)
    return took


async def create(node: Node, ref: str) -> tuple[float, str]:
    """Seconds for a create naming ``ref`` as the API makes it (image or template); the sandbox id."""
    started = time.perf_counter()
    async with image_sources.held_source(node, ref) as source:
        rec = await node.create(source, SandboxSpec(timeout=600))
    return time.perf_counter() - started, rec.id


async def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"config": {k: v for k, v in vars(args).items() if k not in ("out", "data_dir")}}
    shutil.rmtree(args.data_dir, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-tasks-"))
    (work / "registry").mkdir()
    registry_gen = start_registry(work / "registry")
    registry = next(registry_gen)
    node = Node(Settings(data_dir=args.data_dir, build_base=False, repo="none"))
    await node.start()
    try:
        console.print(f"[bold]images[/bold]: pushing {args.tasks} task images to {registry.host}")
        images = make_images(registry, args)
        unique = {d: (c, u) for image in images for d, c, u in image.layers}
        out["images"] = {
            "count": len(images),
            "sum_of_sizes": sum(i.size for i in images),
            "unique_layer_bytes": sum(c for c, _ in unique.values()),
            "unique_layer_bytes_uncompressed": sum(u for _, u in unique.values()),
            "image_size_p50": statistics.median(i.size for i in images),
        }
        out["first_create"] = await first_creates(node, registry, images, work)
        out["second_create"] = await second_creates(node, images[: args.second])
        out["storage"] = await storage(node, out["images"])
        if args.rollouts:
            out["rollouts"] = await rollouts(node, images, args)
    finally:
        await node.stop(pause_running=False)
        next(registry_gen, None)
        shutil.rmtree(work, ignore_errors=True)
        if not args.keep:
            shutil.rmtree(args.data_dir, ignore_errors=True)
    return out


async def first_creates(node: Node, registry: Registry, images: list[TaskImage], work: Path) -> dict[str, Any]:
    console.print(f"[bold]first creates[/bold]: {len(images)} images, each against curl | tar -xz of its new layers")
    seen: set[str] = set()
    creates, bares, ratios, whole, whole_creates = [], [], [], [], []
    PHASES["pull"].clear()
    PHASES["boot_snapshot"].clear()
    for i, image in enumerate(images):
        new = [d for d, _, _ in image.layers if d not in seen]
        bare = await asyncio.to_thread(bare_pull, registry, image, new, work / "bare")
        sampled = i < 3 or i % WHOLE_EVERY == 0
        if sampled:
            all_layers = [d for d, _, _ in image.layers]
            whole.append(await asyncio.to_thread(bare_pull, registry, image, all_layers, work / "bare"))
        took, sandbox_id = await create(node, image.ref)
        if sampled:
            whole_creates.append(took)
        await node.kill(sandbox_id)
        seen.update(new)
        creates.append(took)
        bares.append(bare)
        ratios.append(took / bare)
        console.print(f"  {i + 1}/{len(images)}: {took:.2f} s (bare {bare:.2f} s, {len(new)} new layers)")
    return {
        "p50": pct(creates, 0.5),
        "p95": pct(creates, 0.95),
        "bare_p50": pct(bares, 0.5),
        "ratio_of_p50s": pct(creates, 0.5) / pct(bares, 0.5),
        "ratio_p50": pct(ratios, 0.5),
        "pull_p50": pct(PHASES["pull"], 0.5),  # inside the create: download and unpack, streamed
        "pull_ratio_of_p50s": pct(PHASES["pull"], 0.5) / pct(bares, 0.5),
        "boot_snapshot_p50": pct(PHASES["boot_snapshot"], 0.5),  # the build sandbox's boot and checkpoint
        "first_image": creates[0],
        "first_image_bare": bares[0],
        # Against curl | tar of the whole image (every layer, as a machine without the base pulls
        # it), on a sample of the images: the first three and every WHOLE_EVERY-th.
        "whole_image_bare_p50": pct(whole, 0.5),
        "whole_ratio_of_p50s": pct(whole_creates, 0.5) / pct(whole, 0.5),
        "whole_ratio_p50": pct([c / w for c, w in zip(whole_creates, whole, strict=True)], 0.5),
        "seconds": creates,
        "bare_seconds": bares,
    }


async def second_creates(node: Node, images: list[TaskImage]) -> dict[str, Any]:
    console.print(f"[bold]second creates[/bold]: {len(images)} images, by reference and by template id, alternately")
    by_ref: list[float] = []
    by_id: list[float] = []
    for i, image in enumerate(images):
        template = node.find_template(image.ref)
        pair = [(image.ref, by_ref), (template.id, by_id)]
        for ref, into in pair if i % 2 else reversed(pair):  # which goes first alternates
            took, sandbox_id = await create(node, ref)
            await node.kill(sandbox_id)
            into.append(took)
    return {
        "p50": pct(by_ref, 0.5),
        "p95": pct(by_ref, 0.95),
        "template_restore_p50": pct(by_id, 0.5),
        "template_restore_p95": pct(by_id, 0.95),
        "ratio": pct(by_ref, 0.5) / pct(by_id, 0.5),
    }


async def storage(node: Node, sizes: dict[str, Any]) -> dict[str, Any]:
    rows = await node.images()
    layers = {layer["id"]: layer for row in rows for layer in row["layers"]}
    stored_layers = sum(layer["storedBytes"] for layer in layers.values())
    own = [row["storedBytes"] - sum(layer["storedBytes"] for layer in row["layers"]) for row in rows]
    return {
        "stored_layer_bytes": stored_layers,
        "sum_of_sizes": sum(row["sizeBytes"] for row in rows),
        "unique_layer_bytes": sizes["unique_layer_bytes"],
        "unique_layer_bytes_uncompressed": sizes["unique_layer_bytes_uncompressed"],
        "stored_over_sum": stored_layers / max(1, sum(row["sizeBytes"] for row in rows)),
        "stored_over_unique_uncompressed": stored_layers / max(1, sizes["unique_layer_bytes_uncompressed"]),
        "per_image_own_p50": pct([float(x) for x in own], 0.5),  # its snapshot and conventions layer
        "templates_and_layers_bytes": stored_layers + sum(own),
    }


async def rollouts(node: Node, images: list[TaskImage], args: argparse.Namespace) -> dict[str, Any]:
    rows = {row["digest"]: row for row in await node.images()}
    units = []
    for image in images:
        row = rows[image.digest]
        task_layer = row["layers"][-1]["storedBytes"]
        units.append(row["storedBytes"] - sum(x["storedBytes"] for x in row["layers"]) + task_layer)
    shared = sum({x["id"]: x["storedBytes"] for row in rows.values() for x in row["layers"][:-1]}.values())
    unit = statistics.mean(units)  # what one more image costs: its snapshot, conventions and task layer
    # hold images fit under both marks, one more does not: each miss evicts about one image
    high, low = shared + (args.hold + 0.9) * unit, shared + (args.hold + 0.1) * unit
    node.settings.layer_cache_mb = max(1, round(high / MiB))
    node.settings.layer_cache_low_ratio = low / (node.settings.layer_cache_mb * MiB)  # one image out at a time
    await node.collect_garbage()
    held = [i for i in images if i.digest in _local(node)]
    console.print(
        f"[bold]rollouts[/bold]: {args.rollouts} over {len(images)} images, budget "
        f"{node.settings.layer_cache_mb} MiB ({len(held)} images held)"
    )
    evictions = _sample("aenv_image_evictions_total")
    pulled = _sample("aenv_image_pull_bytes_total")
    rng = random.Random(7)
    times: list[float] = []
    hit_times: list[float] = []
    miss_times: list[float] = []
    hits = 0
    for _ in range(args.rollouts):
        image = rng.choice(images)
        hit = image.digest in _local(node)
        took, sandbox_id = await create(node, image.ref)
        await node.kill(sandbox_id)
        times.append(took)
        (hit_times if hit else miss_times).append(took)
        hits += hit
    await node.collect_garbage()
    return {
        "budget_mb": node.settings.layer_cache_mb,
        "images_held": len(held),
        "rollouts": args.rollouts,
        "hit_rate": hits / args.rollouts,
        "evictions": _sample("aenv_image_evictions_total") - evictions,
        "pulled_bytes": _sample("aenv_image_pull_bytes_total") - pulled,
        "p50": pct(times, 0.5),
        "p95": pct(times, 0.95),
        "hit_p50": pct(hit_times, 0.5),
        "miss_p50": pct(miss_times, 0.5),
        "images_local_after": len(_local(node)),
        "cache_bytes_after": _sample("aenv_layer_cache_bytes"),
    }


def _sample(name: str) -> float:
    return REGISTRY.get_sample_value(name) or 0.0


def _local(node: Node) -> set[str]:
    return {t.image_digest for t in node.templates.values() if t.image_digest}


def render(results: dict[str, Any]) -> None:
    first, second, store = (results[k] for k in ("first_create", "second_create", "storage"))
    roll = results.get("rollouts")
    table = Table(title=f"{results['images']['count']} task images on this machine", header_style="bold")
    for col in ("measure", "aenv", "baseline (same run)"):
        table.add_column(col)
    table.add_row(
        "first create p50 / p95",
        f"{first['p50']:.2f} / {first['p95']:.2f} s",
        f"curl | tar -xz of the same new layers: {first['bare_p50']:.2f} s p50 ({first['ratio_of_p50s']:.2f}x; "
        f"per image {first['ratio_p50']:.2f}x p50)",
    )
    table.add_row(
        "",
        "",
        f"curl | tar -xz of the whole image: {first['whole_image_bare_p50']:.2f} s p50 "
        f"({first['whole_ratio_of_p50s']:.2f}x; per image {first['whole_ratio_p50']:.2f}x p50)",
    )
    table.add_row(
        "of which the pull (download and unpack, streamed) p50",
        f"{first['pull_p50']:.2f} s",
        f"{first['pull_ratio_of_p50s']:.2f}x the bare p50; the build's boot and snapshot "
        f"{first['boot_snapshot_p50']:.2f} s p50",
    )
    table.add_row(
        "first create of the first image (nothing cached)",
        f"{first['first_image']:.2f} s",
        f"its whole image bare: {first['first_image_bare']:.2f} s",
    )
    table.add_row(
        "second create p50 / p95",
        f"{second['p50'] * 1000:.0f} / {second['p95'] * 1000:.0f} ms",
        f"a plain template restore: {second['template_restore_p50'] * 1000:.0f} / "
        f"{second['template_restore_p95'] * 1000:.0f} ms ({second['ratio']:.2f}x)",
    )
    table.add_row(
        "layer bytes stored (each layer once, unpacked)",
        f"{store['stored_layer_bytes'] / MiB:.0f} MiB",
        f"sum of image sizes {store['sum_of_sizes'] / MiB:.0f} MiB; unique layers "
        f"{store['unique_layer_bytes'] / MiB:.0f} MiB compressed, "
        f"{store['unique_layer_bytes_uncompressed'] / MiB:.0f} MiB as tars",
    )
    table.add_row(
        "per image besides its layers (snapshot, conventions)", f"{store['per_image_own_p50'] / MiB:.1f} MiB", ""
    )
    if roll:
        table.add_row(
            f"{roll['rollouts']} rollouts, budget {roll['budget_mb']} MiB ({roll['images_held']} images)",
            f"hit rate {roll['hit_rate']:.0%}, {roll['evictions']:.0f} evictions",
            f"create p50 / p95 {roll['p50']:.2f} / {roll['p95']:.2f} s (hit {roll['hit_p50'] * 1000:.0f} ms, "
            f"miss {roll['miss_p50']:.2f} s); {roll['pulled_bytes'] / MiB:.0f} MiB pulled",
        )
    console.print(table)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tasks", type=int, default=0, help="task images (this mode; 0: the pull and build bench)")
    parser.add_argument("--repos", type=int, default=10, help="repositories the tasks are spread over")
    # SWE-bench's shape, scaled down: a shared base of a few hundred MiB, a layer per repository,
    # and per task ~30 MiB of its own (67 GiB of unique layers over 2,294 images).
    parser.add_argument("--base-mib", type=float, default=300.0, help="the shared base layer")
    parser.add_argument("--repo-mib", type=float, default=100.0, help="each repository's layer")
    parser.add_argument("--task-mib", type=float, default=30.0, help="each task's layer")
    parser.add_argument("--file-kib", type=float, default=100.0, help="the size of the layers' files")
    parser.add_argument("--second", type=int, default=20, help="images created a second time")
    parser.add_argument("--rollouts", type=int, default=100)
    parser.add_argument("--hold", type=int, default=10, help="images the rollouts' cache budget holds")
    parser.add_argument("--keep", action="store_true", help="keep the data dir")


def main(args: argparse.Namespace) -> None:
    _instrument()
    results = asyncio.run(run(args))
    render(results)
    out = args.out if args.out != Path("bench/results/images.json") else Path("bench/results/images-tasks.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.image_tasks", description=__doc__)
    parser.add_argument("--data-dir", type=Path, default=Path("/var/tmp/aenv-bench-image-tasks"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/images-tasks.json"))
    add_arguments(parser)
    main(parser.parse_args())
