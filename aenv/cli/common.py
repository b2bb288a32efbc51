"""What every command of the `aenv` CLI shares: the Typer app and its global options, a client
call run with its errors caught in one place (exit code 1 and a hint), tables on a terminal and
JSON when piped, progress bars.

The commands are in the modules beside this one, one per group; :mod:`aenv.cli.main` imports them
all (in the order ``aenv --help`` lists them).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from aenv.sdk import AenvError, AsyncClient

app = typer.Typer(help="aenv: isolated, forkable sandboxes for agentic RL.", no_args_is_help=True)
out = Console()
err = Console(stderr=True, soft_wrap=True)  # an error is one line, whatever the width: logs and tests grep it
T = TypeVar("T")
_opts: dict[str, str | None] = {"url": None, "api_key": None}


@app.callback()
def _root(
    url: str = typer.Option(None, envvar="AENV_URL", help="Server URL [default: http://127.0.0.1:3000]"),
    api_key: str = typer.Option(None, envvar="AENV_API_KEY", help="API key [default: <data-dir>/api-key]"),
) -> None:
    """aenv: isolated, forkable sandboxes for agentic RL."""
    _opts["url"], _opts["api_key"] = url, api_key


def _run(fn: Callable[[AsyncClient], Coroutine[Any, Any, T]]) -> T:
    async def main() -> T:
        async with AsyncClient(_opts["url"], _opts["api_key"]) as client:
            try:
                return await fn(client)
            except httpx.TransportError as exc:
                raise OSError(f"{client._http.base_url}: {exc or type(exc).__name__}") from exc

    try:
        return asyncio.run(main())
    except AenvError as exc:
        err.print(Text.assemble(("error: ", "red"), exc.message))
        hint = next_step(exc)
        if hint:
            err.print(Text(hint, style="dim"))
        raise typer.Exit(1) from None
    except OSError as exc:
        err.print(Text.assemble(("error: ", "red"), f"cannot reach the aenv server: {exc}"))
        err.print(Text(UNREACHABLE_HINT, style="dim"))
        raise typer.Exit(1) from None


UNREACHABLE_HINT = (
    "Is a server running there? Start one with ./scripts/serve (or aenv server), or point the CLI at "
    "yours with --url or AENV_URL (a cluster: one of its gateways)."
)


def next_step(exc: AenvError) -> str:
    """What to do about an error, where the CLI can say more than the server's message."""
    from aenv import errors

    hints: list[tuple[type[AenvError], str]] = [
        (
            errors.Unauthenticated,
            "Give the server's API key with --api-key or AENV_API_KEY (a node keeps it in "
            "<data-dir>/api-key, /var/lib/aenv/api-key by default; the CLI reads that file when it can).",
        ),
        (errors.SandboxNotFound, "aenv list shows the sandboxes there are (aenv list --state paused for paused ones)."),
        (errors.SnapshotNotFound, "aenv snapshots lists the snapshots there are."),
        (errors.TemplateNotFound, "aenv templates lists the templates there are; aenv build makes one."),
        (
            errors.LimitExceeded,
            "The node (or cluster) is full: try again in a moment, or kill or pause sandboxes you no longer need.",
        ),
        (
            errors.ClusterUnavailable,
            "The cluster's etcd has no quorum or cannot be reached: running sandboxes still work; try again soon.",
        ),
        (
            errors.ImageIncompatible,
            "Rebuild the template (aenv build: its steps come from the build cache), or resume without memory.",
        ),
        (errors.WrongState, "aenv list (or GET /sandboxes/ID) shows the sandbox's state."),
    ]
    return next((hint for kind, hint in hints if isinstance(exc, kind)), "")


JSON_OPTION = typer.Option(False, "--json", help="JSON even on a terminal")


def _emit(rows: list[dict[str, Any]], columns: list[str], title: str | None = None, *, as_json: bool = False) -> None:
    """A table for people, JSON for programs (and with ``--json``)."""
    if as_json or not out.is_terminal:
        print(json.dumps(rows, indent=None))
        return
    table = Table(title=title, show_edge=False, header_style="bold")
    for col in columns:
        table.add_column(col)
    for row in rows:
        table.add_row(*(str(row.get(c, "")) for c in columns))
    out.print(table)


async def _with_status(message: str, work: Awaitable[T]) -> T:
    if not err.is_terminal:
        return await work
    started = time.monotonic()
    with err.status(message):
        result = await work
    err.print(f"{message} done in {time.monotonic() - started:.2f}s")
    return result


def _pairs(values: list[str], what: str) -> dict[str, str]:
    out_: dict[str, str] = {}
    for v in values:
        key, sep, value = v.partition("=")
        if not sep:
            raise typer.BadParameter(f"{what} must be KEY=VALUE, got {v!r}")
        out_[key] = value
    return out_


def _transfer_progress() -> Progress:
    """A bar for bytes on their way (uploads, downloads, a build's context), on stderr."""
    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        console=err,
        transient=True,
    )
