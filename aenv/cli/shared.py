"""What a team keeps beside its sandboxes: ``aenv volumes``, ``aenv secrets``, ``aenv webhooks``,
and ``aenv events`` (a sandbox's lifecycle, or the team's)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import typer

from aenv.cli.common import JSON_OPTION, _emit, _run, app, out
from aenv.sdk import AsyncClient
from aenv.sdk._wire import raise_for

volumes_app = typer.Typer(help="Volumes: directories that outlive sandboxes, mounted by name.", no_args_is_help=True)
secrets_app = typer.Typer(help="Secrets: write-only values, encrypted at rest.", no_args_is_help=True)
webhooks_app = typer.Typer(help="Webhooks: lifecycle events POSTed as they happen.", no_args_is_help=True)
app.add_typer(volumes_app, name="volumes")
app.add_typer(secrets_app, name="secrets")
app.add_typer(webhooks_app, name="webhooks")
EVENT_TYPES = "created, resumed, updated, paused, checkpointed, killed"


async def _call(
    c: AsyncClient,
    method: str,
    path: str,
    *,
    body: dict[str, Any] | None = None,
    params: dict[str, Any] | None = None,
    headers: dict[str, str] | None = None,
    content: bytes | None = None,
) -> Any:
    r = await c._http.request(method, path, json=body, params=params, headers=headers or dict(c._auth), content=content)
    raise_for(r)
    if not r.content:
        return None
    return r.json() if r.headers.get("content-type", "").startswith("application/json") else r.content


async def _content(c: AsyncClient, volume_id: str, method: str, kind: str, path: str, **kw: Any) -> Any:
    """A call of the volume's content API with its own token (as the E2B SDK makes them)."""
    token = (await _call(c, "GET", f"/volumes/{volume_id}"))["token"]
    headers = {"Authorization": f"Bearer {token}"}
    params = {"path": path, **kw.pop("params", {})}
    return await _call(c, method, f"/volumecontent/{volume_id}/{kind}", params=params, headers=headers, **kw)


# -- volumes --------------------------------------------------------------------------------------------
@volumes_app.command("list")
def volumes_list(as_json: bool = JSON_OPTION) -> None:
    """The team's volumes."""
    rows = _run(lambda c: _call(c, "GET", "/volumes"))
    _emit(rows, ["volumeID", "name"], title=f"{len(rows)} volumes", as_json=as_json)


@volumes_app.command("create")
def volumes_create(name: str, as_json: bool = JSON_OPTION) -> None:
    """Make a volume; mount it with `aenv create --volume PATH=NAME` or E2B's volumeMounts."""
    made = _run(lambda c: _call(c, "POST", "/volumes", body={"name": name}))
    _emit([made], ["volumeID", "name"], as_json=as_json)


@volumes_app.command("delete")
def volumes_delete(volume_id: str) -> None:
    """Delete a volume and everything in it (refused while a sandbox mounts it)."""
    _run(lambda c: _call(c, "DELETE", f"/volumes/{volume_id}"))
    out.print(f"deleted volume {volume_id}")


@volumes_app.command("ls")
def volumes_ls(
    volume_id: str,
    path: str = typer.Argument("/", help="a directory of the volume"),
    depth: int = typer.Option(1, "--depth", min=1, max=16),
    as_json: bool = JSON_OPTION,
) -> None:
    """A volume's directory listing (links shown, never followed)."""
    rows = _run(lambda c: _content(c, volume_id, "GET", "dir", path, params={"depth": depth}))
    _emit(rows, ["type", "path", "size", "mode", "uid", "mtime"], title=f"{len(rows)} entries", as_json=as_json)


@volumes_app.command("cat")
def volumes_cat(volume_id: str, path: str) -> None:
    """A file of a volume, to standard output."""
    data = _run(lambda c: _content(c, volume_id, "GET", "file", path))
    sys.stdout.buffer.write(data if isinstance(data, bytes) else str(data).encode())


@volumes_app.command("put")
def volumes_put(
    volume_id: str,
    path: str,
    source: Path = typer.Argument(..., exists=True, dir_okay=False, help="a local file (- is not taken)"),
) -> None:
    """Write a local file into a volume (its parents made)."""
    data = source.read_bytes()
    made = _run(lambda c: _content(c, volume_id, "PUT", "file", path, params={"force": "true"}, content=data))
    out.print(f"wrote {made['path']} ({made['size']} bytes)")


# -- secrets --------------------------------------------------------------------------------------------
@secrets_app.command("list")
def secrets_list(as_json: bool = JSON_OPTION) -> None:
    """The team's secrets (never their values)."""
    rows = _run(lambda c: _call(c, "GET", "/secrets"))
    _emit(rows, ["secretID", "name", "currentVersion", "updatedAt"], title=f"{len(rows)} secrets", as_json=as_json)


@secrets_app.command("set")
def secrets_set(
    name: str,
    value: str = typer.Option(None, "--value", help="the value (default: read from standard input)"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Keep a secret, or give an existing one a new version."""
    secret = value if value is not None else sys.stdin.read().rstrip("\n")

    async def put(c: AsyncClient) -> Any:
        try:
            await _call(c, "GET", f"/secrets/{name}")
        except Exception:  # not there: made
            return await _call(c, "POST", "/secrets", body={"name": name, "value": secret})
        return await _call(c, "POST", f"/secrets/{name}", body={"value": secret})

    _emit([_run(put)], ["secretID", "name", "currentVersion"], as_json=as_json)


@secrets_app.command("delete")
def secrets_delete(name: str) -> None:
    """Delete a secret."""
    _run(lambda c: _call(c, "DELETE", f"/secrets/{name}"))
    out.print(f"deleted secret {name}")


# -- events and webhooks --------------------------------------------------------------------------------
@app.command()
def events(
    sandbox_id: str = typer.Argument(None, help="one sandbox's (killed ones too); none: the team's"),
    limit: int = typer.Option(20, "--limit", min=1, max=100),
    kinds: list[str] = typer.Option(None, "--type", help=f"only these ({EVENT_TYPES})"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Lifecycle events, oldest first: what happened to a sandbox, or to the team's."""
    params: dict[str, Any] = {"limit": limit, "orderAsc": "true"}
    if kinds:
        params["types"] = [k if "." in k else f"sandbox.lifecycle.{k}" for k in kinds]
    path = f"/events/sandboxes/{sandbox_id}" if sandbox_id else "/events/sandboxes"
    rows = _run(lambda c: _call(c, "GET", path, params=params))
    for row in rows:
        row["event"] = row["type"].rsplit(".", 1)[-1]
        data = row.get("eventData") or {}
        row["detail"] = data.get("kill_reason") or data.get("set_timeout") or ""
    _emit(rows, ["timestamp", "sandboxId", "event", "detail"], title=f"{len(rows)} events", as_json=as_json)


@webhooks_app.command("list")
def webhooks_list(as_json: bool = JSON_OPTION) -> None:
    """The team's webhooks (never their secrets)."""
    rows = _run(lambda c: _call(c, "GET", "/events/webhooks"))
    _emit(rows, ["id", "name", "url", "enabled", "events"], title=f"{len(rows)} webhooks", as_json=as_json)


@webhooks_app.command("create")
def webhooks_create(
    url: str,
    secret: str = typer.Option(..., "--secret", help="signs every delivery (e2b-signature)"),
    name: str = typer.Option("aenv", "--name"),
    kinds: list[str] = typer.Option(None, "--type", help=f"the events it gets (default all: {EVENT_TYPES})"),
    as_json: bool = JSON_OPTION,
) -> None:
    """Register a webhook: every event it asks for is POSTed to URL as it happens, signed."""
    chosen = [k if "." in k else f"sandbox.lifecycle.{k}" for k in kinds] if kinds else None
    every = [f"sandbox.lifecycle.{k.strip()}" for k in EVENT_TYPES.split(",")]
    body = {"name": name, "url": url, "events": chosen or every, "signatureSecret": secret}
    made = _run(lambda c: _call(c, "POST", "/events/webhooks", body=body))
    _emit([made], ["id", "name", "url", "events"], as_json=as_json)


@webhooks_app.command("delete")
def webhooks_delete(webhook_id: str) -> None:
    """Delete a webhook: no more deliveries."""
    _run(lambda c: _call(c, "DELETE", f"/events/webhooks/{webhook_id}"))
    out.print(f"deleted webhook {webhook_id}")
