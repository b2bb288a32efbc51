"""Snapshot repository benchmarks: `python -m bench.repo [--backend posix|s3] [--rounds N]` (root, runsc).

On the `base` template and a sandbox made from it:
- commit of `base` into an empty repository (chunk, hash, compress, upload), against the same
  artifacts written as one plain tar.zst in the same run (no chunking, no dedup, no manifests);
- commit of a first snapshot of a sandbox (20 MiB written, a process running), and of a second
  snapshot after a small change: bytes uploaded against the logical size each restores to;
- two durable pauses of that sandbox, idle (a resume between): bytes and objects uploaded;
- incremental memory: the checkpoint images of those snapshots and pauses committed one after the
  other into fresh repositories as packs of ~4 KiB chunks, as loose 1 MiB chunks (images before
  packs) and each as one whole zstd object: bytes and objects each uploads, objects an image is
  made of, and fetch of the last one (p50) by a node that knows nothing of it;
- create from that snapshot with its files in the node's cache, with its own files (image and
  upper layers) evicted, and on a cold cache (everything, the Debian layer included, fetched),
  each against the raw `runsc restore` inside the same operation.
With ``--backend s3`` the repository is a bucket on a local `moto` server (an S3 implementation
in Python: slower than real S3 for many small requests, so read its numbers as an upper bound).
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import zstandard
from rich.console import Console
from rich.table import Table

from aenv.config import Settings
from aenv.node import housekeeping, metrics
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.repo import encodings
from aenv.repo.backends import open_backend
from aenv.repo.repository import LocalArtifact, Repository, object_keys
from aenv.templates.builder import ensure_base, run_in
from bench.__main__ import _install_timer, mark, pct, runsc_since
from tests.repo.s3 import REGION, S3_KEY, start_moto

console = Console()
MiB = 2**20


def plain_archive(items: list[Any], dest: Path) -> int:
    """Baseline: every artifact as one tar.zst file (level 3), bytes written."""
    total = 0
    compressor = zstandard.ZstdCompressor(level=3)
    for n, item in enumerate(items):
        out = dest / f"{n}.zst"
        blocks = (
            encodings.tar_blocks(item.path)
            if item.encoding == "tar"
            else encodings.sparse_blocks(item.path, encodings.data_extents(item.path)[1])
        )
        with open(out, "wb") as f, compressor.stream_writer(f) as w:
            for block in blocks:
                w.write(block)
        total += out.stat().st_size
    return total


def plain_restore(items: list[Any], work: Path) -> float:
    """Baseline of a cold fetch: seconds to lay the same artifacts out again from local files
    (tar -x of each directory, a sparse copy of each disk image), no repository involved."""
    total = 0.0
    for n, item in enumerate(items):
        src, dest = work / f"{n}.src", work / f"{n}.out"
        if item.encoding == "tar":
            subprocess.run(["tar", "-C", str(item.path), "-cf", str(src), *encodings.TAR_OPTS, "."], check=True)
            dest.mkdir()
            argv = ["tar", "-C", str(dest), "-xf", str(src), "--same-permissions", "--same-owner", *encodings.TAR_OPTS]
        else:
            argv = ["cp", "--sparse=always", str(item.path), str(dest)]
        subprocess.run(["sync"], check=True)
        start = time.perf_counter()
        subprocess.run(argv, check=True)
        subprocess.run(["sync"], check=True)  # what a fetch writes must be on disk too
        total += time.perf_counter() - start
        subprocess.run(["rm", "-rf", str(src), str(dest)], check=True)
    return total


def moto_settings(work: Path) -> tuple[subprocess.Popen[bytes], dict[str, str]]:
    """A local moto server with a bucket `bench`, and the node settings that point at it."""
    proc, endpoint = start_moto(work / "moto.log")
    endpoint.new_bucket("bench")
    return proc, {
        "repo": "s3://bench/aenv",
        "repo_s3_endpoint": endpoint.url,
        "repo_s3_region": REGION,
        "repo_s3_access_key_id": S3_KEY["access_key_id"],
        "repo_s3_secret_access_key": S3_KEY["secret_access_key"],
    }


def s3_args(settings: dict[str, Any]) -> dict[str, Any]:
    return {
        "endpoint": settings.get("repo_s3_endpoint"),
        "region": settings.get("repo_s3_region"),
        "access_key_id": settings.get("repo_s3_access_key_id"),
        "secret_access_key": settings.get("repo_s3_secret_access_key"),
    }


async def create_timed(node: Node, ref: str) -> tuple[float, float, str]:
    """(seconds of the create, seconds of its runsc restore, sandbox id)."""
    await node.settle()
    m = mark()
    start = time.perf_counter()
    rec = await node.create(ref, SandboxSpec(timeout=600))
    dt = time.perf_counter() - start
    return dt, sum(runsc_since(m, "restore")), rec.id


async def run(args: argparse.Namespace) -> dict[str, Any]:
    _install_timer()
    work = Path(tempfile.mkdtemp(prefix="aenv-bench-repo-"))
    repo_settings: dict[str, Any] = {}  # posix: the data dir's own repository, kept between runs
    moto = None
    if args.backend == "s3":
        moto, repo_settings = moto_settings(work)
    results: dict[str, Any] = {"backend": args.backend}
    # The node's own data dir keeps `base` between runs; the repository is new each run.
    node = Node(Settings(data_dir=args.data_dir, repo_gc_interval=0, **repo_settings))
    await node.start()
    try:
        base = await ensure_base(node, on_log=lambda line: None)
        await node.artifacts.wait_committed(base)
        await node.artifacts.wait_all()  # records of earlier runs that this repository lacks

        console.print("[bold]commit of base[/bold] into an empty repository")
        empty_url = "s3://bench/empty" if args.backend == "s3" else str(work / "empty")
        empty = Repository(open_backend(empty_url, **s3_args(repo_settings)))
        body = json.loads(base.to_json())
        started = time.perf_counter()
        report = await asyncio.to_thread(empty.commit, "template", base.id, body, node.artifacts.items_of(base))
        commit_s = time.perf_counter() - started
        empty.close()
        (work / "plain").mkdir()
        started = time.perf_counter()
        plain = await asyncio.to_thread(plain_archive, node.artifacts.items_of(base), work / "plain")
        plain_s = time.perf_counter() - started
        shutil.rmtree(work / "plain")
        results["commit_base"] = {
            "seconds": commit_s,
            "logical_mib": report.logical_bytes / MiB,
            "uploaded_mib": report.new_bytes / MiB,
            "chunks": report.chunks,
            "baseline": "the same artifacts as one tar.zst each (level 3), no chunking",
            "baseline_seconds": plain_s,
            "baseline_mib": plain / MiB,
            "ratio": commit_s / plain_s,
        }

        console.print("[bold]snapshots[/bold]: first, then second after a small change")
        rec = await node.create("base", SandboxSpec(timeout=3600))
        link = node.get(rec.id).link
        assert link is not None
        await run_in(link, "head -c 20M /dev/urandom > /home/user/data.bin; sleep 100000 > /dev/null 2>&1 & sync")
        snaps = []
        for label, step in (("first", None), ("second", "echo small change > /home/user/note.txt")):
            if step:
                await run_in(link, step)
            start = time.perf_counter()
            snap = await node.snapshot(rec.id, durable=True)
            total = time.perf_counter() - start
            link = node.get(rec.id).link
            assert link is not None
            # Baseline: the memory image uploaded whole, as one zstd stream (what a snapshot sent
            # before its pages were chunked and shared with the last one's).
            image_items = [i for i in node.artifacts.items_of(snap) if i.kind == "image"]
            (work / "whole").mkdir(exist_ok=True)
            whole = await asyncio.to_thread(plain_archive, image_items, work / "whole")
            shutil.rmtree(work / "whole")
            image_bytes = sum(f.stat().st_size for f in image_items[0].path.rglob("*") if f.is_file())
            results[f"snapshot_{label}"] = {
                "image_mib": image_bytes / MiB,
                "image_whole_zst_mib": whole / MiB,
                "seconds_snapshot_and_commit": total,
                "commit_seconds": snap.commit["seconds"],
                "logical_mib": snap.commit["logical_bytes"] / MiB,
                "uploaded_mib": snap.commit["new_bytes"] / MiB,
                "new_chunks": snap.commit["new_chunks"],
                "chunks": snap.commit["chunks"],
            }
            snaps.append(snap)
        console.print("[bold]durable pauses[/bold] of the idle sandbox, a resume between")
        assert node.artifacts.repo is not None
        images = [node.files.image(s.image) for s in snaps]
        for label in ("first", "second"):
            await asyncio.sleep(1)
            await node.pause(rec.id)
            await node.artifacts.wait_pause_committed(rec.id)
            entry = await asyncio.to_thread(node.artifacts.repo.get_entry, "sandbox", rec.id)
            assert entry is not None, "the pause was not committed"
            paused = node.get(rec.id).rec
            kept = work / f"pause-{label}"
            await asyncio.to_thread(shutil.copytree, node.files.image(paused.image), kept)
            images.append(kept)
            results[f"pause_{label}"] = {
                "uploaded_mib": entry["commit"]["new_bytes"] / MiB,
                "new_objects": entry["commit"].get("new_objects", 0),
                "new_chunks": entry["commit"]["new_chunks"],
            }
            await node.resume(rec.id)
        await node.kill(rec.id)
        console.print(f"[bold]incremental memory[/bold]: {len(images)} images as packs, loose chunks, whole")
        results["images"] = await asyncio.to_thread(image_layouts, images, work, args, repo_settings)

        # The same create with the snapshot's image in loose 1 MiB chunks (the layout before packs).
        rec = await node.create(snaps[-1].id, SandboxSpec(timeout=3600))
        node.artifacts.repo.pack_images = False
        try:
            loose_snap = await node.snapshot(rec.id, durable=True)
        finally:
            node.artifacts.repo.pack_images = True
        await node.kill(rec.id)
        snaps.append(loose_snap)
        snap = snaps[-2]

        async def creates(label: str, evict: str, snap: Any = snap) -> None:
            times, raw, fetched_mib, plain = [], [], [], []
            own_layers = [x for x in snap.layers if x not in base.layers]
            for _ in range(args.rounds):
                await node.settle()  # a killed sandbox's overlay pins its layers until it is gone
                if evict == "own":
                    for layer in own_layers:
                        await node.files.remove(layer)
                    node.files.remove_image(snap.image)
                elif evict == "all":
                    items = [i for i in node.artifacts.items_of(snap) if i.kind != "guest"]
                    (work / "plain").mkdir(exist_ok=True)
                    plain.append(await asyncio.to_thread(plain_restore, items, work / "plain"))
                    node.settings.layer_cache_mb = 0
                    await housekeeping.gc_files(node)
                    node.settings.layer_cache_mb = 20 * 1024
                    await asyncio.to_thread(subprocess.run, ["sync"])
                before = metrics.REPO_FETCH_BYTES._value.get()
                dt, restore, sid = await create_timed(node, snap.id)
                fetched_mib.append((metrics.REPO_FETCH_BYTES._value.get() - before) / MiB)
                times.append(dt)
                raw.append(restore)
                await node.kill(sid)
            results[label] = {
                "p50_ms": pct(times, 0.5) * 1000,
                "p95_ms": pct(times, 0.95) * 1000,
                "fetched_mib": pct(fetched_mib, 0.5),
                "runsc_restore_p50_ms": pct(raw, 0.5) * 1000,
                "ratio": pct(times, 0.5) / pct(raw, 0.5),
                "n": len(times),
            }
            if plain:
                results[label]["plain_restore_p50_ms"] = pct(plain, 0.5) * 1000
                results[label]["plain_baseline"] = "tar -x / sparse cp of the same artifacts from local files"

        console.print(f"[bold]create from the snapshot[/bold] x{args.rounds}: cached, own files evicted, cold")
        await creates("create_cached", "none")
        await creates("create_own_fetched", "own")
        await creates("create_own_fetched_loose", "own", snaps[-1])
        args.rounds = min(args.rounds, 3)  # each cold round writes the whole Debian layer again
        await creates("create_cold", "all")
        for s in snaps:
            await node.delete_snapshot(s.id)
        await node.artifacts.gc_repository()  # the data dir's repository does not grow run after run
    finally:
        await node.stop(pause_running=False)
        if moto is not None:
            moto.terminate()
        shutil.rmtree(work, ignore_errors=True)
    return results


def image_layouts(images: list[Path], work: Path, args: argparse.Namespace, s3: dict[str, Any]) -> dict[str, Any]:
    """Each image committed in turn into a fresh repository per layout; then the last one fetched
    by a repository that has seen none of them, the layouts taking turns round after round (the
    machine's load drifts): wall time and this process's CPU time (tar's excluded)."""
    out: dict[str, Any] = {"images": len(images)}
    layouts = ("packed", "loose", "whole")
    urls, lasts = {}, {}
    for layout in layouts:
        urls[layout] = f"s3://bench/layout-{layout}" if args.backend == "s3" else str(work / f"layout-{layout}")
        backend = open_backend(urls[layout], **s3_args(s3))
        repo = Repository(backend, pack_images=layout == "packed")
        uploads, objects = [], []
        for n, image in enumerate(images):
            before = {i.key for i in backend.list("")}
            if layout == "whole":
                lasts[layout] = f"whole/{n}.tar.zst"
                data = zstandard.ZstdCompressor(level=3).compress(b"".join(encodings.tar_blocks(image)))
                backend.put(lasts[layout], data)
            else:
                repo.commit("snapshot", f"s{n}", {}, [LocalArtifact("image", f"img{n}", image, "tar")])
                entry = repo.get_entry("snapshot", f"s{n}")
                assert entry is not None
                lasts[layout] = repo.artifact_refs(entry)[0]
            made = [i for i in backend.list("") if i.key not in before and not i.key.startswith("locks/")]
            uploads.append(sum(i.size for i in made) / MiB)
            objects.append(len(made))
        made_of = 1 if layout == "whole" else 1 + len(object_keys(repo.read_manifest(lasts[layout], "bench")))
        repo.close()
        out[layout] = {"uploaded_mib": uploads, "objects_uploaded": objects, "objects_per_image": made_of}
    times: dict[str, list[float]] = {x: [] for x in layouts}
    cpu: dict[str, list[float]] = {x: [] for x in layouts}
    for r in range(max(args.rounds, 10)):
        for layout in layouts:
            backend = open_backend(urls[layout], **s3_args(s3))
            reader = Repository(backend, pack_images=layout == "packed")
            dest = work / f"fetch-{layout}-{r}"
            subprocess.run(["sync"], check=True)
            start, start_cpu = time.perf_counter(), time.process_time()
            if layout == "whole":
                data = zstandard.ZstdDecompressor().decompress(backend.get(lasts[layout]))
                dest.mkdir()
                encodings.untar([data], dest)
            else:
                reader.fetch_artifact(lasts[layout], dest, "bench")
            times[layout].append(time.perf_counter() - start)
            cpu[layout].append(time.process_time() - start_cpu)
            reader.close()
            shutil.rmtree(dest)
    for layout in layouts:
        out[layout].update(fetch_p50_ms=pct(times[layout], 0.5) * 1000, fetch_cpu_p50_ms=pct(cpu[layout], 0.5) * 1000)
    return out


def render(results: dict[str, Any]) -> None:
    table = Table(title=f"snapshot repository ({results['backend']}) on this machine", header_style="bold")
    for col in ("what", "time", "bytes", "vs baseline"):
        table.add_column(col)
    c = results["commit_base"]
    table.add_row(
        "commit base (empty repository)",
        f"{c['seconds']:.1f} s",
        f"{c['uploaded_mib']:.0f} MiB uploaded of {c['logical_mib']:.0f} MiB",
        f"{c['ratio']:.2f}x plain tar.zst ({c['baseline_seconds']:.1f} s, {c['baseline_mib']:.0f} MiB)",
    )
    for label in ("first", "second"):
        s = results[f"snapshot_{label}"]
        table.add_row(
            f"commit {label} snapshot",
            f"{s['commit_seconds'] * 1000:.0f} ms",
            f"{s['uploaded_mib']:.1f} MiB uploaded of {s['logical_mib']:.0f} MiB ({s['new_chunks']} new chunks)",
            f"{100 * s['uploaded_mib'] / s['logical_mib']:.2f}% of logical; its memory image "
            f"({s['image_mib']:.0f} MiB) whole as zstd: {s['image_whole_zst_mib']:.1f} MiB",
        )
    for label in ("first", "second"):
        p = results[f"pause_{label}"]
        table.add_row(
            f"durable pause, idle ({label})",
            "",
            f"{p['uploaded_mib']:.2f} MiB uploaded, {p['new_objects']} objects",
            "",
        )
    im = results["images"]
    for label, n in (("first", 0), ("second", 1)):
        versus = "; ".join(
            f"{name} {im[name]['uploaded_mib'][n]:.2f} MiB in {im[name]['objects_uploaded'][n]} objects"
            for name in ("loose", "whole")
        )
        table.add_row(
            f"image of the {label} snapshot, packed",
            "",
            f"{im['packed']['uploaded_mib'][n]:.2f} MiB in {im['packed']['objects_uploaded'][n]} objects",
            f"loose 1 MiB chunks / whole: {versus}",
        )
    later = im["packed"]["uploaded_mib"][2:]
    if later:
        table.add_row(
            "images of the pauses, packed",
            "",
            " / ".join(f"{x:.2f}" for x in later) + " MiB",
            "loose: " + " / ".join(f"{x:.2f}" for x in im["loose"]["uploaded_mib"][2:]) + " MiB",
        )
    table.add_row(
        "fetch of an image (the last), p50",
        f"{im['packed']['fetch_p50_ms']:.0f} ms ({im['packed']['fetch_cpu_p50_ms']:.0f} ms CPU)",
        f"made of {im['packed']['objects_per_image']} objects",
        f"loose {im['loose']['fetch_p50_ms']:.0f} ms ({im['loose']['fetch_cpu_p50_ms']:.0f} CPU, "
        f"{im['loose']['objects_per_image']} objects); whole {im['whole']['fetch_p50_ms']:.0f} ms "
        f"({im['whole']['fetch_cpu_p50_ms']:.0f} CPU, 1 object)",
    )
    for key, what in (
        ("create_cached", "create from snapshot, files cached"),
        ("create_own_fetched", "create, its image + upper fetched"),
        ("create_own_fetched_loose", "the same, image in loose 1 MiB chunks"),
        ("create_cold", "create, cold cache (all fetched)"),
    ):
        r = results[key]
        versus = f"{r['ratio']:.2f}x runsc restore ({r['runsc_restore_p50_ms']:.0f} ms)"
        if "plain_restore_p50_ms" in r:
            extra = r["p50_ms"] - r["runsc_restore_p50_ms"]
            versus += f"; fetch {extra / r['plain_restore_p50_ms']:.2f}x tar -x ({r['plain_restore_p50_ms']:.0f} ms)"
        table.add_row(
            what,
            f"{r['p50_ms']:.0f} ms (p95 {r['p95_ms']:.0f})",
            f"{r['fetched_mib']:.0f} MiB fetched" if r["fetched_mib"] else "",
            versus,
        )
    console.print(table)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.repo", description=__doc__)
    parser.add_argument("--backend", choices=["posix", "s3"], default="posix")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--data-dir", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    # Its own data dir for s3: the run's bucket lives only as long as the run, and a node whose
    # committed records were evicted locally must find them in the repository it was given next.
    args.data_dir = args.data_dir or Path("/var/tmp/aenv-bench" + ("-s3" if args.backend == "s3" else ""))
    results = asyncio.run(run(args))
    render(results)
    out = args.out or Path(f"bench/results/repo-{args.backend}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    console.print(f"JSON: {out}")


if __name__ == "__main__":
    main()
