"""Watching and serving what runs: ``aenv logs`` (a sandbox's commands and log), ``aenv top`` (live
view of a node or cluster) and ``aenv fusion`` (SandboxFusion's API in front of it).
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import typer
from rich.table import Table
from rich.text import Text

from aenv.cli.common import JSON_OPTION, _opts, _run, app, err, out
from aenv.sdk import AsyncClient


@app.command()
def logs(
    sandbox_id: str,
    as_json: bool = JSON_OPTION,
    output: Path = typer.Option(
        None,
        "--output",
        "-o",
        help="Write its rollout log to this file instead: every command it ran with the end of its output "
        "and its exit code, one JSON object a line ('-': standard output)",
    ),
) -> None:
    """A sandbox's recent commands (with their exit codes) and its log (what the node did with it:
    created, paused, resumed, snapshots, forks, timeouts, each with how long it took; and what its
    agent wrote), as the node kept them."""
    if output is not None:
        entries = _run(lambda c: c.rollout_log(sandbox_id))
        lines = "".join(json.dumps(e, ensure_ascii=False) + "\n" for e in entries)
        if str(output) == "-":
            sys.stdout.write(lines)
        else:
            output.write_text(lines, encoding="utf-8")
            err.print(f"{len(entries)} commands written to {output}")
        return
    found = _run(lambda c: c.logs(sandbox_id))
    if as_json or not out.is_terminal:
        print(json.dumps(found))
        return
    rows = [
        {
            "started": time.strftime("%H:%M:%S", time.localtime(c["startedAt"])),
            "exit": "" if c["exitCode"] is None else c["exitCode"],
            "ended": c["error"] or c["status"] or ("running" if c["endedAt"] is None else ""),
            "command": c["cmd"],
        }
        for c in reversed(found["commands"])
    ]
    table = Table(title=f"{len(rows)} recent commands", show_edge=False, header_style="bold")
    for column in ("started", "exit", "ended", "command"):
        table.add_column(column)
    for row in rows:
        table.add_row(*(Text(str(row[c])) for c in ("started", "exit", "ended", "command")))
    out.print(table)
    if found["logs"]:
        out.rule("log: what the node did with it, and what its agent wrote")
        for line in found["logs"]:
            stamp = (line["timestamp"] or "")[11:19]  # RFC 3339: its time of day
            out.print(Text.assemble((f"{stamp} ", "dim"), line["line"]))


@app.command()
def top(
    once: bool = typer.Option(False, "--once", help="print one frame (rates over --interval) and exit"),
    interval: float = typer.Option(2.0, "--interval", min=0.2, help="seconds between readings"),
) -> None:
    """Live view of a node, or of a cluster through its gateway (AENV_URL): nodes, rates,
    latency percentiles, failures by reason."""
    from rich.live import Live

    from aenv.cli import top as view

    async def go(c: AsyncClient) -> None:
        url = str(c._http.base_url)
        then = view.Reading.of(await c.overview())
        if once:
            await asyncio.sleep(interval)
            out.print(view.frame(url, view.Reading.of(await c.overview()), then))
            return
        with Live(view.frame(url, then, None), console=out, auto_refresh=False) as live:
            while True:
                await asyncio.sleep(interval)
                now = view.Reading.of(await c.overview())
                live.update(view.frame(url, now, then), refresh=True)
                then = now

    try:
        _run(go)
    except KeyboardInterrupt:
        pass


@app.command()
def fusion(
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: int = typer.Option(8080, help="Port"),
    template: str = typer.Option("base", help="Template each request's sandbox is created from"),
    concurrency: int = typer.Option(16, min=1, help="Requests running at once (more wait their turn)"),
    queue: int = typer.Option(
        1024, min=0, help="Requests waiting for their turn beyond --concurrency; past both, 503 at once"
    ),
    warm: int = typer.Option(
        None, "--warm", min=0, help="Set the template's warm pool to this many sandboxes first (aenv warm)"
    ),
) -> None:
    """Serve SandboxFusion's API (POST /run_code, /run_jupyter) on this node or cluster: point
    SANDBOX_FUSION_URL at http://HOST:PORT/run_code (docs/integrations.md)."""
    from aenv.integrations.fusion import FusionLimits, serve

    if warm is not None:  # restored ahead: a request's create takes a member instead of a restore
        _run(lambda c: c.warm_pool(template, warm))
    client = AsyncClient(_opts["url"], _opts["api_key"])
    serve(client, host=host, port=port, template=template, limits=FusionLimits(concurrency=concurrency, queue=queue))
