"""Commands on sandboxes: create, exec, shell, upload, download, ls, pause, resume, snapshot, fork,
rm and list.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

from aenv.cli.common import JSON_OPTION, _emit, _pairs, _run, _transfer_progress, _with_status, app, err, out
from aenv.sdk import AsyncClient, AsyncSandbox


@app.command()
def create(
    template: str = typer.Option("base", "--template", "-t"),
    timeout: int = typer.Option(None, help="Seconds until the sandbox is paused or killed [default: 300]"),
    env: list[str] = typer.Option([], "--env", "-e", help="KEY=VALUE, repeatable"),
    meta: list[str] = typer.Option([], "--meta", "-m", help="KEY=VALUE metadata, repeatable"),
    auto_pause: bool = typer.Option(False, "--auto-pause", help="Pause instead of kill on timeout"),
    keep_memory: bool = typer.Option(
        True, "--keep-memory/--no-keep-memory", help="With --auto-pause: keep memory, or only the file system"
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="Print only the sandbox id"),
    grace: int = typer.Option(
        None, "--grace", help="Seconds after its timeout it is held for scoring commands only (the SDK's scoring=True)"
    ),
    image: str = typer.Option(
        None, "--image", help="An OCI image reference to create from (pulled and built on its first create)"
    ),
    volume: list[str] = typer.Option([], "--volume", "-v", help="PATH=VOLUME: mount a volume there, repeatable"),
) -> None:
    """Create a sandbox and print its id."""

    async def go(c: AsyncClient) -> AsyncSandbox:
        work = c.create(
            template,
            timeout=timeout,
            envs=_pairs(env, "--env"),
            metadata=_pairs(meta, "--meta"),
            auto_pause=auto_pause,
            keep_memory=keep_memory,
            grace=grace,
            image=image,
            volumes=_pairs(volume, "--volume"),
        )
        return await _with_status(f"creating from {image or template}", work)

    sbx = _run(go)
    if out.is_terminal or quiet:
        print(sbx.sandbox_id)
    else:
        print(json.dumps({"sandboxID": sbx.sandbox_id, "templateID": sbx.template_id}))


@app.command("exec", context_settings={"allow_interspersed_args": False})
def exec_(
    sandbox_id: str,
    command: list[str] = typer.Argument(..., help="Command (one argument is run by bash -l -c)"),
    user: str = typer.Option(None, "--user", "-u"),
    cwd: str = typer.Option(None, "--cwd"),
    timeout: float = typer.Option(0, help="Kill the command after this many seconds (0: no limit)"),
) -> None:
    """Run a command, streaming its output; exits with the command's exit code."""

    def write(stream: Any) -> Callable[[str], None]:
        def emit(text: str) -> None:
            stream.write(text)
            stream.flush()

        return emit

    async def go(c: AsyncClient) -> int:
        sbx = await c.connect(sandbox_id)
        cmd: str | list[str] = command[0] if len(command) == 1 else command
        result = await sbx.exec(
            cmd, user=user, cwd=cwd, timeout=timeout or None, on_stdout=write(sys.stdout), on_stderr=write(sys.stderr)
        )
        return result.exit_code

    raise typer.Exit(_run(go))


@app.command()
def shell(sandbox_id: str, user: str = typer.Option(None, "--user", "-u")) -> None:
    """An interactive shell (PTY) inside a sandbox."""
    import termios
    import tty

    async def go(c: AsyncClient) -> int:
        sbx = await c.connect(sandbox_id)
        cols, rows = os.get_terminal_size() if sys.stdin.isatty() else (80, 24)
        session = await sbx.pty(cols=cols, rows=rows, user=user)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        loop.add_reader(sys.stdin.fileno(), lambda: queue.put_nowait(os.read(sys.stdin.fileno(), 4096)))

        async def pump_in() -> None:
            while data := await queue.get():
                await session.send(data)

        if sys.stdin.isatty():
            import signal

            def resized() -> None:
                size = os.get_terminal_size()
                asyncio.ensure_future(session.resize(size.columns, size.lines))

            loop.add_signal_handler(signal.SIGWINCH, resized)
        feeder = asyncio.ensure_future(pump_in())
        try:
            async for chunk in session.output():
                os.write(sys.stdout.fileno(), chunk)
        finally:
            feeder.cancel()
            loop.remove_reader(sys.stdin.fileno())
            await session.close()
        return session.exit_code or 0

    saved = termios.tcgetattr(sys.stdin) if sys.stdin.isatty() else None
    try:
        if saved is not None:
            tty.setraw(sys.stdin)
        code = _run(go)
    finally:
        if saved is not None:
            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, saved)
    raise typer.Exit(code)


@app.command()
def upload(sandbox_id: str, local: Path, remote: str) -> None:
    """Copy a local file into a sandbox, streamed, with progress."""
    if not local.is_file():
        err.print(f"[red]error:[/red] {local} is not a file")
        raise typer.Exit(2)

    async def go(c: AsyncClient) -> int:
        sbx = await c.connect(sandbox_id)
        with _transfer_progress() as progress:
            task = progress.add_task(f"{local.name} -> {remote}", total=local.stat().st_size)
            return await sbx.write_from(
                remote, local, on_progress=lambda sent, total: progress.update(task, completed=sent, total=total)
            )

    size = _run(go)
    err.print(f"{local} -> {remote}: {size} bytes")


@app.command()
def download(sandbox_id: str, remote: str, local: Path) -> None:
    """Copy a file out of a sandbox, with progress."""

    async def go(c: AsyncClient) -> int:
        sbx = await c.connect(sandbox_id)
        with open(local, "wb") as f, _transfer_progress() as progress:
            task = progress.add_task(remote, total=None)

            def sink(chunk: bytes) -> None:
                f.write(chunk)
                progress.advance(task, len(chunk))

            return await sbx.read_to(remote, sink, on_size=lambda size: progress.update(task, total=size))

    size = _run(go)
    err.print(f"{size} bytes -> {local}")


@app.command()
def ls(
    sandbox_id: str, path: str = typer.Argument("/home/user"), depth: int = typer.Option(1), as_json: bool = JSON_OPTION
) -> None:
    """List a directory inside a sandbox."""

    async def go(c: AsyncClient) -> list[dict[str, Any]]:
        return await (await c.connect(sandbox_id)).ls(path, depth=depth)

    entries = _run(go)
    rows = [
        {
            "name": e["path"],
            "type": e["type"].removeprefix("FILE_TYPE_").lower(),
            "size": e.get("size", 0),
            "mode": e.get("permissions", ""),
        }
        for e in entries
    ]
    _emit(rows, ["mode", "size", "type", "name"], as_json=as_json)


@app.command()
def pause(
    sandbox_ids: list[str],
    keep_memory: bool = typer.Option(
        True, "--keep-memory/--no-keep-memory", help="Keep memory and processes, or only the file system"
    ),
) -> None:
    """Pause sandboxes: their memory and processes go to disk; no CPU or RAM is held. With
    --no-keep-memory only the file system is kept and the resume boots the sandbox fresh."""

    async def go(c: AsyncClient) -> None:
        for sid in sandbox_ids:
            work = AsyncSandbox(c, {"sandboxID": sid}).pause(keep_memory=keep_memory)
            await _with_status(f"pausing {sid}", work)

    _run(go)


@app.command()
def resume(
    sandbox_ids: list[str],
    timeout: int = typer.Option(None, help="Seconds each then runs [default: its own, the one it was last given]"),
) -> None:
    """Resume paused sandboxes."""

    async def go(c: AsyncClient) -> None:
        for sid in sandbox_ids:
            await _with_status(f"resuming {sid}", c.connect(sid, timeout=timeout))

    _run(go)


@app.command()
def snapshot(
    sandbox_id: str,
    name: str = typer.Option(None, "--name"),
    durable: bool = typer.Option(False, "--durable", help="return once the snapshot repository holds it"),
) -> None:
    """Snapshot a running sandbox (it keeps running); create new sandboxes from the snapshot id."""

    async def go(c: AsyncClient) -> str:
        what = f"snapshotting {sandbox_id}" + (" and committing it" if durable else "")
        return await _with_status(what, AsyncSandbox(c, {"sandboxID": sandbox_id}).snapshot(name, durable=durable))

    snap = _run(go)
    print(snap) if out.is_terminal else print(json.dumps({"snapshotID": snap}))


@app.command()
def fork(
    sandbox_id: str,
    n: int = typer.Option(1, "-n", "--count"),
    timeout: int = typer.Option(None),
    clone_volumes: bool = typer.Option(
        False, "--clone-volumes", help="Each child gets its own copy of the sandbox's volumes (<name>-<child id>)"
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Fork a running sandbox into N children that start from its exact state."""

    async def go(c: AsyncClient) -> list[AsyncSandbox]:
        source = AsyncSandbox(c, {"sandboxID": sandbox_id})
        forking = source.fork(n, timeout=timeout, clone_volumes=clone_volumes)
        return await _with_status(f"forking {sandbox_id} into {n}", forking)

    children = _run(go)
    rows = [{"sandboxID": ch.sandbox_id, "parentID": sandbox_id} for ch in children]
    _emit(rows, ["sandboxID", "parentID"], as_json=as_json)


@app.command()
def rm(sandbox_ids: list[str]) -> None:
    """Kill sandboxes."""

    async def go(c: AsyncClient) -> list[str]:
        missing = []
        for sid in sandbox_ids:
            if not await AsyncSandbox(c, {"sandboxID": sid}).kill():
                missing.append(sid)
        return missing

    missing = _run(go)
    if missing:
        err.print(f"[red]not found:[/red] {' '.join(missing)}")
        raise typer.Exit(1)


@app.command("list")
def list_(
    state: list[str] = typer.Option([], "--state"),
    meta: list[str] = typer.Option([], "--meta", "-m"),
    all_teams: bool = typer.Option(False, "--all-teams", help="Every team's (the deployment's admin key)"),
    as_json: bool = JSON_OPTION,
) -> None:
    """List sandboxes (your team's; with --all-teams and the admin key, every team's)."""

    async def go(c: AsyncClient) -> list[Any]:
        return await c.list(state=state or None, metadata=_pairs(meta, "--meta"), all_teams=all_teams)

    rows = [
        {
            "sandboxID": s.sandbox_id,
            "template": s.template_id,
            "state": s.raw.get("aenvState", s.state),
            "team": s.raw.get("teamID", ""),
            "endAt": s.end_at,
            "metadata": json.dumps(s.metadata),
        }
        for s in _run(go)
    ]
    columns = ["sandboxID", "template", "state", *(["team"] if all_teams else []), "endAt", "metadata"]
    _emit(rows, columns, as_json=as_json)
