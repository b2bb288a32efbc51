"""``aenv desktop SANDBOX``: the live view of a desktop sandbox in a browser.

The stream is the one E2B's Desktop SDK starts (x11vnc on the display, noVNC's proxy on port
6080), started here if it is not running. Its page is reached through the node's port proxy, which
routes a host named ``6080-<sandbox id>.<anything>`` to the sandbox: on a node with a domain,
``https://6080-<id>.<domain>``; otherwise ``6080-<id>.localhost``, a name browsers resolve to this
machine, on the node's own port when the node is here, or on a local relay to the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import shlex
import ssl
import webbrowser
from typing import Any
from urllib.parse import urlsplit

import typer

from aenv.cli.common import _run, app, err, out
from aenv.errors import AenvError
from aenv.sdk import AsyncClient

NOVNC_PORT = 6080  # where the SDK's noVNC proxy listens
VNC_PORT = 5900
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1", "[::1]"}


def stream_script(password: str | None) -> str:
    """Shell (as the sandbox's user) that starts the SDK's stream unless it runs, then waits for
    noVNC's port; prints ``running`` if the stream was there already."""
    auth = (
        f"mkdir -p ~/.vnc && x11vnc -storepasswd {shlex.quote(password)} ~/.vnc/passwd >/dev/null 2>&1 && pw=-usepw"
        if password
        else "pw=-nopw"
    )
    return f"""
if pgrep -x x11vnc >/dev/null; then echo running; else
  {auth}
  x11vnc -bg -display ${{DISPLAY:-:0}} -forever -wait 50 -shared -rfbport {VNC_PORT} $pw 2>/tmp/x11vnc_stderr.log
fi
if ! netstat -tuln | grep -q ":{NOVNC_PORT} "; then
  (cd /opt/noVNC/utils && exec setsid ./novnc_proxy --vnc localhost:{VNC_PORT} --listen {NOVNC_PORT} \
    --web /opt/noVNC) >/tmp/novnc.log 2>&1 </dev/null &
fi
for _ in $(seq 100); do netstat -tuln | grep -q ":{NOVNC_PORT} " && exit 0; sleep 0.1; done
echo "noVNC did not start: $(tail -3 /tmp/novnc.log)" >&2; exit 1
"""


def page_query(password: str | None, view_only: bool) -> str:
    query = "autoconnect=true&resize=scale" + ("&view_only=true" if view_only else "")
    return query + (f"&password={password}" if password else "")


@app.command()
def desktop(
    sandbox_id: str,
    auth: bool = typer.Option(False, "--auth", help="the stream asks a password (in the URL printed)"),
    view_only: bool = typer.Option(False, "--view-only", help="watch without sending mouse or keys"),
    browser: bool = typer.Option(True, "--browser/--no-browser", help="open the URL in a browser"),
) -> None:
    """Open the live view (noVNC) of a desktop sandbox: starts its stream if need be, prints the
    URL; where the node is not on this machine and has no domain, relays to it until Ctrl-C."""
    password = secrets.token_urlsafe(12) if auth else None

    async def go(c: AsyncClient) -> dict[str, Any]:
        sbx = await c.connect(sandbox_id)
        ran = await sbx.exec(stream_script(password), timeout=60)
        if ran.exit_code != 0:
            raise AenvError(f"the stream did not start in {sandbox_id}: {ran.stderr.strip()[-300:]}")
        info: dict[str, Any] = await c._get(f"/sandboxes/{sandbox_id}")
        return {"running": ran.stdout.strip() == "running", "domain": info.get("domain")}

    state = _run(go)
    if state["running"] and password:
        err.print("the stream was running already: its own password stays (this one is not set)")
        password = None
    node = urlsplit(_node_url())
    query = page_query(password, view_only)
    if state["domain"]:
        _show(f"https://{NOVNC_PORT}-{sandbox_id}.{state['domain']}/vnc.html?{query}", browser)
        return
    if (node.hostname or "") in LOCAL_HOSTS:
        port = node.port or (443 if node.scheme == "https" else 80)
        _show(f"{node.scheme}://{NOVNC_PORT}-{sandbox_id}.localhost:{port}/vnc.html?{query}", browser)
        return
    asyncio.run(_relay(node.scheme, node.hostname or "", node.port, sandbox_id, query, browser))


def _node_url() -> str:
    from aenv.cli.common import _opts

    return str(_opts["url"])


def _show(url: str, browser: bool) -> None:
    out.print(url, markup=False, highlight=False, soft_wrap=True)
    if browser:
        with contextlib.suppress(Exception):  # no browser here: the URL is printed
            webbrowser.open(url)


async def _relay(scheme: str, host: str, port: int | None, sandbox_id: str, query: str, browser: bool) -> None:
    """A local port whose connections go to the node as they are (TLS to an HTTPS node): the
    browser names the sandbox in its Host header, which the node routes."""
    tls = ssl.create_default_context() if scheme == "https" else None
    target_port = port or (443 if tls else 80)

    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            with contextlib.suppress(Exception):
                writer.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            name = host if tls else None
            up_r, up_w = await asyncio.open_connection(host, target_port, ssl=tls, server_hostname=name)
        except OSError as exc:
            err.print(f"cannot reach the node at {host}:{target_port}: {exc}")
            writer.close()
            return
        await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    local = server.sockets[0].getsockname()[1]
    _show(f"http://{NOVNC_PORT}-{sandbox_id}.localhost:{local}/vnc.html?{query}", browser)
    err.print(f"relaying 127.0.0.1:{local} to {host}:{target_port}; Ctrl-C to stop")
    async with server:
        with contextlib.suppress(asyncio.CancelledError, KeyboardInterrupt):
            await server.serve_forever()
