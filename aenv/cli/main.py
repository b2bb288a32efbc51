"""The `aenv` command line: a thin shell over the public SDK (plus `server`, which runs a node)."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import typer

app = typer.Typer(help="aenv: isolated, forkable sandboxes for agentic RL.", no_args_is_help=True)


@app.callback()
def _root() -> None:
    """aenv: isolated, forkable sandboxes for agentic RL."""


@app.command()
def server(
    host: str = typer.Option(None, help="Address to listen on [default: 127.0.0.1]"),
    port: int = typer.Option(None, help="Port [default: 3000]"),
    data_dir: Path = typer.Option(None, "--data-dir", help="State directory [default: /var/lib/aenv]"),
) -> None:
    """Run a node: the API on one port, with the `base` template ready."""
    from aenv.api.server import serve
    from aenv.config import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    settings = Settings(**overrides)
    asyncio.run(serve(settings))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
