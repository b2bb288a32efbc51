"""``aenv nodes``: a cluster's nodes as its gateway sees them, and draining or undraining one."""

from __future__ import annotations

import json
from typing import Any

import typer
from rich.progress import BarColumn, Progress

from aenv.cli.common import JSON_OPTION, _emit, _run, app, err, out
from aenv.sdk import AenvError, AsyncClient

NODE_COLUMNS = [
    "nodeID",
    "status",
    "address",
    "sandboxCount",
    "sandboxPausedCount",
    "sandboxStartingCount",
    "room",
    "allocatedCPU",
    "load1",
]


@app.command()
def nodes(
    node_id: str = typer.Argument(None, help="one node's detail (or `drain NODE`, `undrain NODE`)"),
    drained: str = typer.Argument(None, metavar="[NODE]", help="with `drain` or `undrain`: the node"),
    move: bool = typer.Option(False, "--move", help="with `drain`: resume its sandboxes on other nodes"),
    as_json: bool = JSON_OPTION,
) -> None:
    """The nodes of a cluster, as its gateway sees them (AENV_URL names a gateway).
    `aenv nodes drain NODE [--move]`: the node takes no new work and pauses its running sandboxes
    durably (--move: resumes them on other nodes), with progress, until it is empty.
    `aenv nodes undrain NODE`: the node takes new work again (a drain under way stops)."""
    if node_id == "drain" and drained:
        _drain(drained, move=move, as_json=as_json or not err.is_terminal)
        return
    if node_id == "undrain" and drained:
        _undrain(drained, as_json=as_json or not out.is_terminal)
        return
    if drained:
        err.print(f"[red]error:[/red] unexpected argument {drained!r} (drain a node with `aenv nodes drain NODE`)")
        raise typer.Exit(2)

    async def go(c: AsyncClient) -> list[dict[str, Any]] | dict[str, Any]:
        try:
            return await (c.node(node_id) if node_id else c.nodes())
        except AenvError as exc:
            if exc.status == 404 and not node_id:
                raise AenvError(f"{c._http.base_url} is not a gateway: it has no nodes", status=404) from None
            raise

    found = _run(go)
    if as_json or not out.is_terminal:
        print(json.dumps(found))
    elif isinstance(found, dict):
        for key, value in found.items():
            out.print(f"[bold]{key}[/bold]: {value}")
    else:
        _emit(found, NODE_COLUMNS, title=f"{len(found)} nodes")


def _undrain(node_id: str, *, as_json: bool) -> None:
    """A gateway's ``POST /nodes/{id}/undrain``: the node as it is after (JSON, or a line)."""

    async def go(c: AsyncClient) -> dict[str, Any]:
        return await c.undrain_node(node_id)

    node = _run(go)
    if as_json:
        print(json.dumps(node))
    else:
        out.print(
            f"node {node.get('nodeID', node_id)} takes new work again (status {node.get('status')})", highlight=False
        )


def _drain(node_id: str, *, move: bool, as_json: bool) -> None:
    """Drain a node: a progress bar on a terminal (each sandbox paused, durable, moved), or its
    progress reports as JSON lines."""

    async def go(c: AsyncClient) -> dict[str, Any]:
        if as_json:
            return await c.drain_node(node_id, move=move, on_progress=lambda p: print(json.dumps(p), flush=True))
        with Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            "{task.completed}/{task.total}",
            "{task.fields[detail]}",
            console=err,
        ) as progress:
            task = progress.add_task(f"draining {node_id}", total=None, detail="")

            def show(p: dict[str, Any]) -> None:
                finished = (p["moved"] if p["move"] else p["durable"]) + p["failed"]
                detail = f"paused {p['paused']}, durable {p['durable']}, moved {p['moved']}, failed {p['failed']}"
                progress.update(task, total=max(p["total"], 1), completed=finished, detail=detail)

            return await c.drain_node(node_id, move=move, on_progress=show)

    last = _run(go)
    if as_json:
        return
    for message in last.get("errors", []):
        err.print(f"[yellow]{message}[/yellow]")
    err.print(
        f"node {node_id} drained in {last['seconds']} s: {last['total']} running sandboxes, "
        f"{last['durable']} paused durably, {last['moved']} moved, {last['failed']} failed"
    )
    if last["failed"]:
        raise typer.Exit(1)
