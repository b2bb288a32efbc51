"""The `aenv` command line: a thin shell over the public SDK (plus `server`, which runs a node).

Tables on a terminal, JSON when piped; errors are caught in one place and become exit code 1.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx
import typer
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TransferSpeedColumn
from rich.table import Table
from rich.text import Text

from aenv.sdk import AenvError, AsyncClient, AsyncSandbox, BuildError

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


@app.command()
def server(
    host: str = typer.Option(None, help="Address to listen on [default: 127.0.0.1]"),
    port: int = typer.Option(None, help="Port [default: 3000]"),
    data_dir: Path = typer.Option(None, "--data-dir", help="State directory [default: /var/lib/aenv]"),
    repo: str = typer.Option(
        None, "--repo", help="Snapshot repository: a path, s3://bucket/prefix or none [default: <data-dir>/repo]"
    ),
    cluster: str = typer.Option(None, "--cluster", help="Join a cluster: etcd[s]://H1:P1,H2:P2,... (docs/cluster.md)"),
    advertise: str = typer.Option(
        None, "--advertise", help="URL gateways reach this node at [default: http://host:port]"
    ),
    node_id: str = typer.Option(
        None, "--node-id", help="This node's id in the cluster [default: kept in the data dir]"
    ),
) -> None:
    """Run a node: the API on one port, with the `base` template ready."""
    from pydantic import ValidationError

    from aenv.api.server import check_settings, serve
    from aenv.config import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if repo is not None:
        overrides["repo"] = repo
    for name, value in (("cluster", cluster), ("advertise", advertise), ("node_id", node_id)):
        if value is not None:
            overrides[name] = value
    try:
        settings = Settings(**overrides)
        check_settings(settings)
    except ValidationError as exc:
        for problem in exc.errors():
            where = ".".join(str(part) for part in problem["loc"])
            err.print(f"[red]error:[/red] AENV_{where.upper()}: {problem['msg']}")
        raise typer.Exit(2) from None
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    try:
        asyncio.run(serve(settings))
    except AenvError as exc:  # the port or the data dir taken, a failed `base` build: no traceback
        from rich.markup import escape

        err.print(f"[red]error:[/red] {escape(exc.message)}")  # log lines may hold [brackets]
        raise typer.Exit(1) from None


@app.command()
def gateway(
    cluster: str = typer.Option(
        None, "--cluster", help="The cluster's etcd: etcd[s]://H1:P1,... [default: $AENV_CLUSTER]"
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: int = typer.Option(8080, help="Port"),
    ws_max_message_mb: int = typer.Option(
        16, "--ws-max-message-mb", min=1, help="Largest WebSocket message relayed either way (larger: close 1009)"
    ),
    create_timeout: float = typer.Option(
        120.0, "--create-timeout", min=0.1, help="Seconds a node has to answer a create before it is tried again"
    ),
    domain: str = typer.Option(
        None, "--domain", help="Domain mode: api.DOMAIN is the control plane, <port>-<id>.DOMAIN a sandbox's port"
    ),
    tls_cert: Path = typer.Option(None, "--tls-cert", help="Serve HTTPS with this PEM certificate (chain)"),
    tls_key: Path = typer.Option(None, "--tls-key", help="The certificate's PEM private key"),
) -> None:
    """Run a gateway: one URL in front of the cluster's nodes (docs/cluster.md)."""
    from aenv.api.connections import check_tls
    from aenv.cluster.gateway import GatewaySettings, check_domain, serve_gateway
    from aenv.cluster.store import ClusterStore, EtcdTls, EtcdUser

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request otherwise
    cluster = cluster or os.environ.get("AENV_CLUSTER", "")
    if not cluster:
        err.print("[red]error:[/red] --cluster etcd://HOST:PORT[,...] (or AENV_CLUSTER) is needed")
        raise typer.Exit(2)
    api_key = os.environ.get("AENV_API_KEY", "")
    if not api_key:  # the nodes' key: the gateway's own routes (the node list) need it too
        err.print("[red]error:[/red] AENV_API_KEY (the cluster's API key, as the nodes have it) is needed")
        raise typer.Exit(2)
    cluster_tls = EtcdTls.from_env(os.environ)
    try:
        cluster_user = EtcdUser.from_env(os.environ)
        ClusterStore.from_url(cluster, tls=cluster_tls)  # the URL and the TLS files checked (no connection yet)
        domain = check_domain(domain) if domain else None
        check_tls(tls_cert, tls_key)
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    settings = GatewaySettings(
        cluster=cluster,
        api_key=api_key,
        ws_max_message_mb=ws_max_message_mb,
        create_timeout=create_timeout,
        domain=domain,
        tls_cert=str(tls_cert) if tls_cert else None,
        tls_key=str(tls_key) if tls_key else None,
        cluster_tls=cluster_tls,
        cluster_user=cluster_user,
    )
    asyncio.run(serve_gateway(settings, host=host, port=port))


@app.command("etcd-auth")
def etcd_auth(
    cluster: str = typer.Option(None, "--cluster", help="etcd://H1:P1,... (or AENV_CLUSTER)"),
    root_password_file: Path = typer.Option(..., "--root-password-file", help="etcd's root user's password"),
    node_password_file: Path = typer.Option(
        None, "--node-password-file", help="aenv-node's password [default: random: it logs in by certificate]"
    ),
    gateway_password_file: Path = typer.Option(
        None, "--gateway-password-file", help="aenv-gateway's password [default: random: by certificate]"
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Turn etcd's auth on for a cluster: etcd's root user, and the users and roles aenv-node
    (everything under /aenv/) and aenv-gateway (reads; writes sandbox entries and tombstones only).
    Run it again to change the passwords given (a user given none keeps its own). Nodes and
    gateways then log in with AENV_CLUSTER_USER
    and AENV_CLUSTER_PASSWORD_FILE, or by a client certificate whose CN is the user
    (docs/cluster.md, "etcd users and roles")."""
    from aenv.cluster.auth import GATEWAY_USER, NODE_USER, enable_auth
    from aenv.cluster.store import EtcdTls

    cluster = cluster or os.environ.get("AENV_CLUSTER", "")
    if not cluster:
        err.print("[red]error:[/red] --cluster etcd://HOST:PORT[,...] (or AENV_CLUSTER) is needed")
        raise typer.Exit(2)

    def secret(path: Path | None) -> str | None:
        if path is None:
            return None
        try:
            value = path.read_text(errors="replace")[:1025].removesuffix("\n")
        except OSError as exc:
            raise AenvError(f"cannot read {path}: {exc.strerror}") from None
        if not value or len(value) > 1024:
            raise AenvError(f"{path} must hold a password of 1 to 1024 characters")
        return value

    try:
        root = secret(root_password_file)
        assert root is not None
        passwords = {NODE_USER: secret(node_password_file), GATEWAY_USER: secret(gateway_password_file)}
        report = asyncio.run(enable_auth(cluster, root, passwords, tls=EtcdTls.from_env(os.environ)))
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    rows = [{"user": user, "role": user, "may": ", ".join(grants)} for user, grants in report.users.items()]
    if as_json or not out.is_terminal:
        print(json.dumps({"enabledNow": report.enabled_now, "users": rows}))
        return
    _emit(rows, ["user", "role", "may"])
    out.print("etcd's auth turned on" if report.enabled_now else "etcd's auth was on already: users and roles updated")


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
    as_json: bool = JSON_OPTION,
) -> None:
    """Fork a running sandbox into N children that start from its exact state."""

    async def go(c: AsyncClient) -> list[AsyncSandbox]:
        return await _with_status(
            f"forking {sandbox_id} into {n}", AsyncSandbox(c, {"sandboxID": sandbox_id}).fork(n, timeout=timeout)
        )

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
    as_json: bool = JSON_OPTION,
) -> None:
    """List sandboxes."""

    async def go(c: AsyncClient) -> list[Any]:
        return await c.list(state=state or None, metadata=_pairs(meta, "--meta"))

    rows = [
        {
            "sandboxID": s.sandbox_id,
            "template": s.template_id,
            "state": s.raw.get("aenvState", s.state),
            "endAt": s.end_at,
            "metadata": json.dumps(s.metadata),
        }
        for s in _run(go)
    ]
    _emit(rows, ["sandboxID", "template", "state", "endAt", "metadata"], as_json=as_json)


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
    from urllib.parse import quote

    async def go(c: AsyncClient) -> dict[str, Any]:
        result: dict[str, Any] = await c._post(f"/nodes/{quote(node_id, safe='')}/undrain", {})
        return result

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

        async def go(c: AsyncClient) -> dict[str, Any] | BuildError:
            try:
                return await c.build(
                    name, context, dockerfile=str(recipe), build_args=args, on_log=show, on_upload=uploaded
                )
            except BuildError as exc:
                return exc

        outcome = _run(go)
    if isinstance(outcome, BuildError):
        err.print(f"[red]build failed:[/red] {outcome.message}")
        if outcome.output:
            err.print(outcome.output, markup=False, highlight=False)
        raise typer.Exit(1)
    _emit([outcome], ["name", "templateID", "layers", "description"])


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
    warm: int = typer.Option(
        None, "--warm", min=0, help="Set the template's warm pool to this many sandboxes first (aenv warm)"
    ),
) -> None:
    """Serve SandboxFusion's API (POST /run_code, /run_jupyter) on this node or cluster: point
    SANDBOX_FUSION_URL at http://HOST:PORT/run_code (docs/integrations.md)."""
    import uvicorn

    from aenv.integrations.fusion import create_app

    if warm is not None:  # restored ahead: a request's create takes a member instead of a restore
        _run(lambda c: c.warm_pool(template, warm))
    client = AsyncClient(_opts["url"], _opts["api_key"])
    app_ = create_app(client, template=template, max_concurrency=concurrency)
    uvicorn.run(app_, host=host, port=port, http="httptools", log_level="warning")


from aenv.cli.teams import register as _register_teams  # noqa: E402 - its commands use the helpers above

_register_teams(app, run=_run, emit=_emit, out=out, err=err)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
