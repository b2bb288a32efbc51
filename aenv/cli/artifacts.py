"""Where templates come from and go: ``aenv images`` (the images a node holds, prefetching them)
and ``aenv repo`` (the snapshot repository: status, fetch, gc).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import typer

from aenv.cli.common import JSON_OPTION, _run, _transfer_progress, _with_status, app, err, out
from aenv.sdk import AenvError, AsyncClient

images_app = typer.Typer(
    help="Images this node holds as templates (made by creates that name an image), and prefetches."
)
app.add_typer(images_app, name="images")


@images_app.callback(invoke_without_command=True)
def images(ctx: typer.Context, as_json: bool = JSON_OPTION) -> None:
    """Each image: reference, digest, template, size (its compressed layers), bytes stored on the
    node, last use, in use, local or evicted; then what they add up to against their distinct layers."""
    if ctx.invoked_subcommand is not None:
        return
    from aenv.cli import images as view

    rows = _run(lambda c: c.images())
    if as_json or not out.is_terminal:
        print(json.dumps(rows))
        return
    out.print(view.table(rows))


@images_app.command("prefetch")
def images_prefetch(
    file: Path = typer.Argument(..., exists=True, dir_okay=False, help="one image reference a line; # comments"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Pull images and make them templates ahead of their first creates, with progress; exits 1
    if any failed (each failure said in E2B's words)."""
    from aenv.cli import images as view

    started = time.monotonic()

    def begun(job: dict[str, Any]) -> None:
        if not as_json and err.is_terminal:
            err.print(f"prefetch {job['prefetchID']}: {len(job['images'])} images", highlight=False)

    async def go(c: AsyncClient) -> dict[str, Any]:
        refs = view.references(file)
        if not refs:
            raise AenvError(f"{file}: no image reference in it", status=400)
        console = err if err.is_terminal and not as_json else None
        return await view.follow(c, refs, console, begun)

    job = _run(go)
    if as_json or not out.is_terminal:
        print(json.dumps(job))
    else:
        for line in view.summary(job, started):
            out.print(line, highlight=False)
    if job["counts"]["failed"]:
        raise typer.Exit(1)


repo_app = typer.Typer(help="The snapshot repository templates and snapshots are committed to.")
app.add_typer(repo_app, name="repo")


@repo_app.command("status")
def repo_status(as_json: bool = JSON_OPTION) -> None:
    """Where the node commits, and what it has not committed yet."""
    info = _run(lambda c: c.repository())
    if as_json or not out.is_terminal:
        print(json.dumps(info))
        return
    for key in ("url", "templates", "snapshots", "committed", "pending", "cacheBytes", "cacheBudgetBytes"):
        out.print(f"[bold]{key}[/bold]: {info.get(key)}")


@repo_app.command("fetch")
def repo_fetch(name: str, as_json: bool = JSON_OPTION) -> None:
    """Bring a template's or snapshot's files from the repository into the node's cache (ahead of
    its first create there), with progress."""
    with _transfer_progress() as progress:
        task = progress.add_task(f"fetching {name}", total=None)
        answer = _run(
            lambda c: c.fetch_template(
                name, on_progress=lambda done, total: progress.update(task, completed=done, total=total)
            )
        )
    if as_json or not out.is_terminal:
        print(json.dumps(answer))
        return
    fetched = answer.get("fetchedBytes", 0)
    out.print(f"{name}: {fetched / 2**20:.1f} MiB fetched" if fetched else f"{name}: already in this node's cache")


@repo_app.command("gc")
def repo_gc(as_json: bool = JSON_OPTION) -> None:
    """Delete repository chunks and artifacts that no template or snapshot needs."""
    report = _run(lambda c: _with_status("collecting repository garbage", c.repository_gc()))
    if as_json or not out.is_terminal:
        print(json.dumps(report))
    elif report.get("skipped"):
        out.print(f"skipped: {report['skipped']}")
    else:
        freed = report.get("freed_bytes", 0) / 2**20
        out.print(
            f"deleted {report.get('deleted_chunks', 0)} chunks and {report.get('deleted_artifacts', 0)} artifacts, "
            f"{freed:.1f} MiB freed ({report.get('live_chunks', 0)} chunks in use)"
        )
