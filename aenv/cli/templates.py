"""Commands on templates and snapshots: build (from a Dockerfile or an image), templates, warm
(a template's warm pool) and snapshots.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

import typer

from aenv.cli.common import JSON_OPTION, _emit, _run, _transfer_progress, app, err, out
from aenv.sdk import AsyncClient, BuildError


@app.command()
def build(
    context: Path = typer.Argument(Path("."), help="build context (a directory)"),
    name: str = typer.Option(..., "--name", "-n", help="template name"),
    file: Path = typer.Option(
        None, "--file", "-f", help="Dockerfile: relative to the current directory, or absolute [CONTEXT/Dockerfile]"
    ),
    build_arg: list[str] = typer.Option([], "--build-arg", help="KEY=VALUE for an ARG"),
    image: str | None = typer.Option(None, "--image", help="no Dockerfile: make the template from this image"),
    registry_user: str | None = typer.Option(
        None, "--registry-user", help="login for the image's registry; the password comes from $AENV_REGISTRY_PASSWORD"
    ),
) -> None:
    """Build a template from a Dockerfile (streaming its log), or straight from an OCI image."""
    if image is not None:
        password = os.environ.get("AENV_REGISTRY_PASSWORD") if registry_user else None
        with _transfer_progress() as progress:
            task = progress.add_task(f"pulling {image}", total=None)

            def layer(index: int, layers: int, done: int, total: int) -> None:
                progress.update(task, description=f"layer {index}/{layers} of {image}", completed=done, total=total)

            def said(line: str) -> None:
                progress.console.print(line, markup=False, highlight=False)
                if line.startswith("pulled "):
                    progress.update(task, description=f"committing '{name}'", completed=0, total=None)

            row = _run(
                lambda c: c.template_from_image(
                    name, image, username=registry_user, password=password, on_log=said, on_progress=layer
                )
            )
        _emit([row], ["name", "templateID", "layers", "description"])
        return
    recipe = (file if file is not None else context / "Dockerfile").absolute()
    if not recipe.is_file():
        err.print(f"[red]error:[/red] no Dockerfile at {recipe} (name another with -f PATH)")
        raise typer.Exit(2)
    args = dict(a.split("=", 1) for a in build_arg if "=" in a)
    with _transfer_progress() as progress:
        # One line: the context's upload (a bar), then the build's step (the log prints above it).
        task = progress.add_task(f"sending the context of '{name}'", total=None)

        def uploaded(sent: int, total: int) -> None:
            progress.update(task, completed=sent, total=total)
            if sent == total:
                progress.update(task, description=f"building '{name}'")

        def show(line: str) -> None:
            if line.startswith("["):
                progress.update(task, description=f"building '{name}': {line[:80]}")
                progress.console.print(f"[bold]{line}[/bold]")
            else:
                progress.console.print(line, markup=False, highlight=False)

        outcome = _built(
            lambda c: c.build(name, context, dockerfile=str(recipe), build_args=args, on_log=show, on_upload=uploaded)
        )
    _show_built(outcome)


def _built(build: Callable[[AsyncClient], Awaitable[dict[str, Any]]]) -> dict[str, Any] | BuildError:
    """Run a streamed build; its template, or the error it ended with (shown once the progress
    display is gone)."""

    async def go(c: AsyncClient) -> dict[str, Any] | BuildError:
        try:
            return await build(c)
        except BuildError as exc:
            return exc

    return _run(go)


def _show_built(outcome: dict[str, Any] | BuildError) -> None:
    if isinstance(outcome, BuildError):
        err.print(f"[red]build failed:[/red] {outcome.message}")
        if outcome.output:
            err.print(outcome.output, markup=False, highlight=False)
        raise typer.Exit(1)
    _emit([outcome], ["name", "templateID", "layers", "description"])


template_app = typer.Typer(help="Built-in templates: `aenv template build desktop`.", no_args_is_help=True)
app.add_typer(template_app, name="template")


@template_app.command("build")
def template_build(
    name: str = typer.Argument(..., help="the built-in template: desktop"),
    browser: str | None = typer.Option(
        None, "--browser", help="desktop: chromium, firefox-esr or none [the node's AENV_DESKTOP_BROWSER]"
    ),
) -> None:
    """Build a built-in template on the node anew (desktop: Debian's X desktop for e2b-desktop),
    streaming its log."""
    with _transfer_progress() as progress:
        task = progress.add_task(f"building '{name}'", total=None)

        def show(line: str) -> None:
            progress.console.print(line, markup=False, highlight=False)
            progress.update(task, description=f"building '{name}': {line[:70]}")

        outcome = _built(lambda c: c.build_builtin(name, browser=browser, on_log=show))
    _show_built(outcome)


@app.command()
def templates(as_json: bool = JSON_OPTION) -> None:
    """List templates."""
    rows = _run(lambda c: c.templates())
    _emit(rows, ["name", "templateID", "layers", "sandboxes", "committed", "createdAt"], as_json=as_json)


@app.command()
def warm(
    template: str,
    size: int = typer.Argument(None, min=0, help="the most idle sandboxes to keep (omit to show the pool)"),
    default: bool = typer.Option(False, "--default", help="follow the node's AENV_WARM_POOL again"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Show or set a template's warm pool: idle sandboxes kept restored, taken by creates."""
    wanted: int | None | Literal["keep"] = None if default else ("keep" if size is None else size)
    info = _run(lambda c: c.warm_pool(template, wanted))
    if as_json or not out.is_terminal:
        print(json.dumps(info))
        return
    _emit([info], ["name", "size", "target", "ready", "recentCreates", "memberMB"])


@app.command()
def snapshots(as_json: bool = JSON_OPTION) -> None:
    """List snapshots."""
    rows = _run(lambda c: c.snapshots())
    if as_json or not out.is_terminal:
        print(json.dumps(rows))
        return
    _emit(
        [{**r, "names": ",".join(r.get("names", []))} for r in rows],
        ["snapshotID", "names", "sandboxID", "committed", "createdAt"],
    )
