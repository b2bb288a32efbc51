"""`aenv keys`, `aenv teams` and `aenv usage`: a deployment's teams, their API keys and usage.

A team key manages its own team's keys; the admin key (AENV_API_KEY) manages teams and, with
``--team``, any team's keys and usage.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import typer

from aenv.sdk import AsyncClient
from aenv.sdk._wire import raise_for

# The CLI's own helpers (aenv/cli/main.py hands them over in ``register``): run, emit, out, err.
cli = SimpleNamespace(JSON_OPTION=typer.Option(False, "--json", help="JSON even on a terminal"), json=json)

keys_app = typer.Typer(help="The API keys of your team (or, for the admin key, of --team).", no_args_is_help=True)
teams_app = typer.Typer(help="The deployment's teams and their quotas (the admin key).", no_args_is_help=True)
TEAM_OPTION = typer.Option(None, "--team", help="Another team's (the admin key only)")
QUOTA_HELP = "0 = no limit"


async def _call(
    c: AsyncClient, method: str, path: str, body: dict[str, Any] | None = None, team: str | None = None
) -> Any:
    headers = dict(c._auth)
    if team:
        headers["X-Team-ID"] = team
    r = await c._http.request(method, path, json=body, headers=headers)
    raise_for(r)
    return r.json() if r.content else None


@keys_app.command("list")
def keys_list(team: str = TEAM_OPTION, as_json: bool = cli.JSON_OPTION) -> None:
    """The team's keys, masked (a key is shown once, when it is made)."""
    rows = cli.run(lambda c: _call(c, "GET", "/api-keys", team=team))
    for row in rows:
        mask = row.get("mask") or {}
        row["key"] = (
            f"{mask.get('prefix', '')}{mask.get('maskedValuePrefix', '')}...{mask.get('maskedValueSuffix', '')}"
        )
    cli.emit(rows, ["id", "name", "key", "createdAt"], title=f"{len(rows)} keys", as_json=as_json)


@keys_app.command("create")
def keys_create(name: str, team: str = TEAM_OPTION, as_json: bool = cli.JSON_OPTION) -> None:
    """Make a key; prints it (only now: the server keeps a digest)."""
    made = cli.run(lambda c: _call(c, "POST", "/api-keys", {"name": name}, team=team))
    _show_once(made, f"key {made['id']} ({made['name']}): {made['key']}", as_json)


@keys_app.command("delete")
def keys_delete(key_id: str, team: str = TEAM_OPTION) -> None:
    """Delete a key: it stops working (on every gateway of a cluster within seconds)."""
    cli.run(lambda c: _call(c, "DELETE", f"/api-keys/{key_id}", team=team))
    cli.err.print(f"key {key_id} deleted")


def _show_once(made: dict[str, Any], line: str, as_json: bool) -> None:
    """What holds a new key: JSON when asked or piped, else ``line`` and a warning that the key is
    shown this once (the server keeps a digest)."""
    if as_json or not cli.out.is_terminal:
        print(cli.json.dumps(made))
    else:
        cli.out.print(line, highlight=False)
        cli.err.print("Keep the key now: it is not shown again.")


def _quotas(
    running: int | None, paused: int | None, rate: float | None, fork: int | None, disk: int | None
) -> dict[str, Any]:
    given = {"maxRunning": running, "maxPaused": paused, "createsPerSecond": rate, "maxFork": fork, "maxDiskMB": disk}
    return {k: v for k, v in given.items() if v is not None}


def _team_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for row in rows:
        q = row.get("quotas") or {}
        row["quota"] = ", ".join(f"{k} {v}" for k, v in q.items() if v) or "none"
    return rows


RUNNING = typer.Option(None, "--max-running", min=0, help=f"Sandboxes not paused, at most ({QUOTA_HELP})")
PAUSED = typer.Option(None, "--max-paused", min=0, help=f"Paused sandboxes, at most ({QUOTA_HELP})")
RATE = typer.Option(None, "--creates-per-second", min=0, help=f"Creates a second, at most ({QUOTA_HELP})")
FORK = typer.Option(None, "--max-fork", min=0, help=f"Children of one fork, at most ({QUOTA_HELP})")
DISK = typer.Option(None, "--max-disk-mb", min=0, help=f"MiB of sandbox disks, paused ones too ({QUOTA_HELP})")


@teams_app.command("list")
def teams_list(as_json: bool = cli.JSON_OPTION) -> None:
    """Every team (the admin key), or your own."""
    rows = _team_rows(cli.run(lambda c: _call(c, "GET", "/teams")))
    cli.emit(rows, ["teamID", "name", "quota", "createdAt"], title=f"{len(rows)} teams", as_json=as_json)


@teams_app.command("create")
def teams_create(
    name: str,
    team_id: str = typer.Option(None, "--id", help="The team's id (default: a UUID)"),
    running: int = RUNNING,
    paused: int = PAUSED,
    rate: float = RATE,
    fork: int = FORK,
    disk: int = DISK,
    as_json: bool = cli.JSON_OPTION,
) -> None:
    """Make a team and its first API key (printed once)."""
    body: dict[str, Any] = {"name": name, "quotas": _quotas(running, paused, rate, fork, disk)}
    if team_id:
        body["teamID"] = team_id
    made = cli.run(lambda c: _call(c, "POST", "/teams", body))
    _show_once(made, f"team {made['teamID']} ({made['name']}), API key: {made['apiKey']}", as_json)


@teams_app.command("quota")
def teams_quota(
    team_id: str,
    running: int = RUNNING,
    paused: int = PAUSED,
    rate: float = RATE,
    fork: int = FORK,
    disk: int = DISK,
    as_json: bool = cli.JSON_OPTION,
) -> None:
    """Change a team's quotas (those given; 0 lifts one)."""
    body = {"quotas": _quotas(running, paused, rate, fork, disk)}
    team = cli.run(lambda c: _call(c, "PATCH", f"/teams/{team_id}", body))
    cli.emit(_team_rows([team]), ["teamID", "name", "quota"], as_json=as_json)


@teams_app.command("delete")
def teams_delete(team_id: str) -> None:
    """Delete a team that has nothing left (sandboxes, templates, snapshots); its keys go with it."""
    cli.run(lambda c: _call(c, "DELETE", f"/teams/{team_id}"))
    cli.err.print(f"team {team_id} deleted")


USAGE_COLUMNS = [
    "teamID",
    "runningSandboxes",
    "pausedSandboxes",
    "sandboxSeconds",
    "cpuSeconds",
    "memoryGiBSeconds",
    "storageGiBSeconds",
]


def usage(
    team: str = typer.Option(None, "--team", help="That team's (the admin key); default: your own"),
    every: bool = typer.Option(False, "--all", help="Every team's (the admin key)"),
    as_json: bool = cli.JSON_OPTION,
) -> None:
    """What your team used: sandbox-seconds, CPU-seconds, GiB-seconds of memory and of storage."""

    async def go(c: AsyncClient) -> list[dict[str, Any]]:
        if every:
            teams = await _call(c, "GET", "/teams")
            return [await _call(c, "GET", f"/teams/{t['teamID']}/usage") for t in teams]
        if team:
            return [await _call(c, "GET", f"/teams/{team}/usage")]
        mine = await _call(c, "GET", "/teams")  # a team key sees its own; the admin key is the default team's
        own = mine[0] if len(mine) == 1 else next((t for t in mine if t.get("isDefault")), None)
        return [await _call(c, "GET", f"/teams/{own['teamID']}/usage")] if own else []

    cli.emit(cli.run(go), USAGE_COLUMNS, title="usage", as_json=as_json)


def register(app: typer.Typer, **helpers: Callable[..., Any] | Any) -> None:
    for name, value in helpers.items():
        setattr(cli, name, value)
    app.add_typer(keys_app, name="keys")
    app.add_typer(teams_app, name="teams")
    app.command("usage")(usage)
