"""``aenv images`` and ``aenv images prefetch FILE``: what the node holds of each image against
what the images add up to, and a prefetch followed to its end with a progress bar."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from aenv.sdk import AenvError, AsyncClient

POLL_SECONDS = 0.5
MAX_FILE_BYTES = 4 << 20  # a prefetch list: references of up to 1 KiB, a thousand at most (the API's bounds)


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB"


def totals(rows: list[dict[str, Any]]) -> dict[str, int]:
    """What sharing saves: the local images' sizes added up, against their distinct layers
    (compressed) and the bytes those take on the node's disk (each layer once)."""
    local = [r for r in rows if r.get("state") == "local"]
    layers: dict[str, dict[str, Any]] = {}
    for row in local:
        for layer in row.get("layers", []):
            layers[layer["id"]] = layer
    return {
        "images": len(rows),
        "local": len(local),
        "evicted": len(rows) - len(local),
        "sizeBytes": sum(int(r.get("sizeBytes", 0)) for r in local),
        "uniqueLayerBytes": sum(int(layer.get("sizeBytes", 0)) for layer in layers.values()),
        "storedLayerBytes": sum(int(layer.get("storedBytes", 0)) for layer in layers.values()),
    }


def table(rows: list[dict[str, Any]]) -> Group:
    t = Table(show_edge=False, header_style="bold")
    for col in ("reference", "digest", "template", "size", "stored", "last used", "in use", "state"):
        t.add_column(col, justify="right" if col in ("size", "stored") else "left", overflow="fold")
    for r in rows:
        state = Text(r["state"], style="green" if r["state"] == "local" else "dim")
        t.add_row(
            r["reference"],
            r["digest"][:19],
            r["name"] if r["name"] != r["digest"].replace(":", "-", 1) else r["templateID"],
            mib(r["sizeBytes"]),
            mib(r["storedBytes"]),
            str(r["lastUsed"])[:19].replace("T", " "),
            "yes" if r.get("inUse") else "",
            state,
        )
    sums = totals(rows)
    line = Text(
        f"{sums['images']} images ({sums['local']} local, {sums['evicted']} evicted): the local ones add up to "
        f"{mib(sums['sizeBytes'])}; their distinct layers are {mib(sums['uniqueLayerBytes'])} "
        f"({mib(sums['storedLayerBytes'])} on disk, each stored once)",
        style="dim",
    )
    return Group(t, line)


def references(path: Path) -> list[str]:
    """One reference a line; blank lines and what follows a ``#`` are not read."""
    if path.stat().st_size > MAX_FILE_BYTES:
        raise AenvError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB: not a list of image references", status=400)
    refs = [line.split("#", 1)[0].strip() for line in path.read_text(errors="replace").splitlines()]
    return [ref for ref in refs if ref]


async def follow(
    client: AsyncClient, refs: list[str], console: Console | None, on_job: Callable[[dict[str, Any]], None]
) -> dict[str, Any]:
    """Start a prefetch of ``refs`` and poll it until done: a progress bar on ``console`` (an
    overall bar and one per image being pulled), else nothing until the end. Returns its last state."""
    job = await client.prefetch_images(refs)
    on_job(job)
    if console is None:
        while job["state"] != "done":
            await asyncio.sleep(POLL_SECONDS)
            job = await client.prefetch_status(job["prefetchID"])
        return job
    columns = (TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[amount]}"), TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        overall = progress.add_task(f"{len(job['images'])} images", total=len(job["images"]), amount="")
        bars: dict[str, TaskID] = {}
        while True:
            show(progress, overall, bars, job)
            if job["state"] == "done":
                return job
            await asyncio.sleep(POLL_SECONDS)
            job = await client.prefetch_status(job["prefetchID"])


def show(progress: Progress, overall: TaskID, bars: dict[str, TaskID], job: dict[str, Any]) -> None:
    counts = job["counts"]
    finished = counts["ready"] + counts["failed"]
    described = f"{finished}/{len(job['images'])} images ({counts['failed']} failed)"
    pulled = f"{mib(sum(item['bytesDone'] for item in job['images']))} pulled"
    progress.update(overall, completed=finished, description=described, amount=pulled)
    for item in job["images"]:
        ref, state = item["reference"], item["state"]
        if state == "pulling" and ref not in bars:
            bars[ref] = progress.add_task(f"  {ref[-60:]}", total=None, amount="")
        if ref in bars:
            done, total = item["bytesDone"], item["bytesTotal"]
            amount = f"{mib(done)} of {mib(total)}" if total else ""
            progress.update(bars[ref], completed=done, total=total or None, amount=amount)
            if state in ("ready", "failed"):
                progress.remove_task(bars.pop(ref))


def summary(job: dict[str, Any], started: float) -> list[Text]:
    lines = []
    for item in job["images"]:
        if item["state"] == "failed":
            error = item.get("error") or {}
            lines.append(Text.assemble(("failed ", "red"), f"{item['reference']}: {error.get('message', '')}"))
    counts = job["counts"]
    pulled = sum(item["bytesDone"] for item in job["images"])
    lines.append(
        Text(
            f"{counts['ready']} ready, {counts['failed']} failed of {len(job['images'])} images in "
            f"{time.monotonic() - started:.1f} s ({mib(pulled)} pulled)"
        )
    )
    return lines
