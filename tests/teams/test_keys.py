"""Teams and their API keys on one node: E2B's /api-keys shapes, keys kept as digests, the admin key
as the default team's, and `aenv keys` / `aenv teams` / `aenv usage`."""

from __future__ import annotations

import json
import re
import uuid
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from aenv.cli.main import app as cli_app
from tests.conftest import API_KEY, Server
from tests.teams.conftest import new_team

pytestmark = pytest.mark.sandbox
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?Z")
# E2B's spec (spec/openapi.yml): TeamAPIKey, CreatedTeamAPIKey, IdentifierMaskingDetails, Team.
TEAM_API_KEY = {"id", "name", "mask", "createdAt"}
MASK = {"prefix", "valueLength", "maskedValuePrefix", "maskedValueSuffix"}
TEAM = {"teamID", "name", "apiKey", "isDefault"}


def _check_key_item(item: dict[str, object]) -> None:
    assert TEAM_API_KEY <= item.keys()
    uuid.UUID(str(item["id"]))
    assert RFC3339.fullmatch(str(item["createdAt"]))
    assert isinstance(item["mask"], dict) and MASK <= item["mask"].keys()
    assert item.get("createdBy") is None and item.get("lastUsed") is None


def test_api_keys_have_e2b_shapes_work_at_once_and_stop_when_deleted(admin: httpx.Client) -> None:
    from e2b import Sandbox
    from e2b.exceptions import AuthenticationException

    team = new_team(admin, "keys")
    with team.client() as client:
        made = client.post("/api-keys", json={"name": "ci runner"})
        assert made.status_code == 201, made.text
        body = made.json()
        _check_key_item(body)
        key = body["key"]
        assert re.fullmatch(r"e2b_[0-9a-f]{40}", key)
        assert body["name"] == "ci runner"
        assert body["mask"] == {
            "prefix": "e2b_",
            "valueLength": 40,
            "maskedValuePrefix": key[4:6],
            "maskedValueSuffix": key[-4:],
        }
        listed = client.get("/api-keys").json()
        assert {k["name"] for k in listed} == {"default", "ci runner"}
        for item in listed:
            _check_key_item(item)
            assert "key" not in item and key not in json.dumps(item)
        # E2B's own client with the new key: it works at once
        url = str(admin.base_url).rstrip("/")
        sbx = Sandbox.create("bb", api_key=key, api_url=url, sandbox_url=url, timeout=60)
        try:
            assert sbx.commands.run("echo hi").stdout == "hi\n"
            assert [s.sandbox_id for s in Sandbox.list(api_key=key, api_url=url).next_items()] == [sbx.sandbox_id]
            renamed = client.patch(f"/api-keys/{body['id']}", json={"name": "renamed"})
            assert renamed.status_code == 200 and renamed.json()["name"] == "renamed"
            assert client.delete(f"/api-keys/{body['id']}").status_code == 204
            with pytest.raises(AuthenticationException):
                Sandbox.list(api_key=key, api_url=url).next_items()
            gone = httpx.get(f"{url}/v2/sandboxes", headers={"X-API-Key": key})
            assert gone.status_code == 401 and gone.json()["code"] == 401
            again = client.delete(f"/api-keys/{body['id']}")
            assert again.status_code == 404 and again.json()["message"] == "id not found"
            assert client.get(f"/sandboxes/{sbx.sandbox_id}").status_code == 200  # the team's other key
        finally:
            client.delete(f"/sandboxes/{sbx.sandbox_id}")


def test_keys_are_kept_as_digests_only(admin: httpx.Client, teams_node: Server) -> None:
    team = new_team(admin, "digests")
    with team.client() as client:
        key = client.post("/api-keys", json={"name": "secret"}).json()["key"]
    stored = b"".join(p.read_bytes() for p in Path(teams_node.data_dir).glob("teams.db*"))
    assert stored, "the node keeps its teams in <data-dir>/teams.db"
    for raw in (key, team.key):
        assert raw.encode() not in stored and raw[4:].encode() not in stored
    import hashlib

    assert hashlib.sha256(key.encode()).hexdigest().encode() in stored
    assert oct(Path(teams_node.data_dir, "teams.db").stat().st_mode & 0o777) == "0o600"


def test_a_team_key_manages_only_its_own_team(admin: httpx.Client) -> None:
    a, b = new_team(admin, "own-a"), new_team(admin, "own-b")
    with a.client() as client:
        teams = client.get("/teams").json()
        assert [t["teamID"] for t in teams] == [a.team_id] and TEAM <= teams[0].keys()
        assert teams[0]["apiKey"] == "" and teams[0]["isDefault"] is False  # a key is shown once, when made
        assert client.get(f"/teams/{a.team_id}").json()["apiKey"] == ""
        assert client.post("/teams", json={"name": "x"}).status_code == 403
        assert client.patch(f"/teams/{a.team_id}", json={"quotas": {"maxRunning": 0}}).status_code == 403
        other = client.get(f"/teams/{b.team_id}")
        missing = client.get(f"/teams/{uuid.uuid4()}")
        assert other.status_code == missing.status_code == 404
        # another team's id in X-Team-ID is refused as a wrong key is
        assert client.get("/v2/sandboxes", headers={"X-Team-ID": b.team_id}).status_code == 401
        b_key_id = next(k["id"] for k in admin.get("/api-keys", headers={"X-Team-ID": b.team_id}).json())
        assert client.delete(f"/api-keys/{b_key_id}").status_code == 404
    with b.client() as client:
        assert client.get("/api-keys").status_code == 200  # still works


def test_the_admin_key_is_the_default_team_and_manages_teams(admin: httpx.Client) -> None:
    teams = admin.get("/teams").json()
    default = next(t for t in teams if t["isDefault"])
    assert default["teamID"] == "default" and default["apiKey"] == ""  # the admin key is never echoed
    for headers in ({}, {"X-Team-ID": "*"}, {"Authorization": f"Bearer {API_KEY}"}):
        answers = [admin.get("/teams", headers=headers), admin.get("/teams/default", headers=headers)]
        assert all(r.status_code == 200 and API_KEY not in r.text and API_KEY[4:] not in r.text for r in answers)
    listed = admin.get("/api-keys").json()
    assert listed[0]["name"].startswith("admin") and listed[0]["mask"]["maskedValueSuffix"] == API_KEY[-4:]
    assert admin.delete(f"/api-keys/{listed[0]['id']}").status_code == 400  # it is the deployment's
    team = new_team(admin, "managed", maxRunning=3)
    changed = admin.patch(f"/teams/{team.team_id}", json={"name": "renamed", "quotas": {"createsPerSecond": 5}})
    assert changed.status_code == 200
    assert changed.json()["quotas"] == {
        "maxRunning": 3,
        "maxPaused": 0,
        "createsPerSecond": 5.0,
        "maxFork": 0,
        "maxDiskMB": 0,
        "maxVolumes": 0,
    }
    bad = admin.patch(f"/teams/{team.team_id}", json={"quotas": {"maxRunning": True}})
    assert bad.status_code == 400 and "maxRunning" in bad.json()["message"]
    assert admin.patch(f"/teams/{team.team_id}", json={"quotas": {"nope": 1}}).status_code == 400
    # admin with X-Team-ID acts for that team (E2B's admin auth)
    made = admin.post("/api-keys", json={"name": "by-admin"}, headers={"X-Team-ID": team.team_id})
    assert made.status_code == 201
    with httpx.Client(base_url=admin.base_url, headers={"X-API-Key": made.json()["key"]}) as client:
        assert [t["teamID"] for t in client.get("/teams").json()] == [team.team_id]
    # a team's volumes and secrets keep it, as its sandboxes do: nothing of it is left ownerless
    with httpx.Client(base_url=admin.base_url, headers={"X-API-Key": team.key}) as client:
        volume = client.post("/volumes", json={"name": "kept"}).json()["volumeID"]
        assert client.post("/secrets", json={"name": "kept", "value": "v"}).status_code == 201
        held = admin.delete(f"/teams/{team.team_id}")
        assert held.status_code == 409 and "1 volumes, 1 secrets" in held.json()["message"], held.text
        assert client.delete(f"/volumes/{volume}").status_code in (200, 204)
        assert client.delete("/secrets/kept").status_code in (200, 204)
    assert admin.delete(f"/teams/{team.team_id}").status_code == 204
    with httpx.Client(base_url=admin.base_url, headers={"X-API-Key": team.key}) as client:
        assert client.get("/v2/sandboxes").status_code == 401  # its keys went with it


def test_the_cli_makes_teams_keys_and_shows_usage(teams_node: Server) -> None:
    runner = CliRunner()

    def run(*args: str, key: str = API_KEY) -> dict[str, object] | list[dict[str, object]]:
        result = runner.invoke(cli_app, ["--url", teams_node.url, "--api-key", key, *args, "--json"])
        assert result.exit_code == 0, result.output
        parsed: dict[str, object] | list[dict[str, object]] = json.loads(result.stdout)
        return parsed

    made = run("teams", "create", "cli team", "--max-running", "2", "--creates-per-second", "4")
    assert isinstance(made, dict)
    team_id, key = str(made["teamID"]), str(made["apiKey"])
    teams = run("teams", "list")
    assert isinstance(teams, list) and any(t["teamID"] == team_id for t in teams)
    quota = run("teams", "quota", team_id, "--max-paused", "5")
    assert isinstance(quota, list) and quota[0]["quotas"]["maxPaused"] == 5  # type: ignore[index]
    second = run("keys", "create", "second", key=key)
    assert isinstance(second, dict) and str(second["key"]).startswith("e2b_")
    keys = run("keys", "list", key=key)
    assert isinstance(keys, list) and {k["name"] for k in keys} == {"default", "second"}
    assert any(str(k["key"]).endswith(str(second["key"])[-4:]) for k in keys)
    runner.invoke(cli_app, ["--url", teams_node.url, "--api-key", key, "keys", "delete", str(second["id"])])
    assert {k["name"] for k in run("keys", "list", key=key)} == {"default"}  # type: ignore[union-attr]
    usage = run("usage", key=key)
    assert isinstance(usage, list) and usage[0]["teamID"] == team_id and "cpuSeconds" in usage[0]
    assert run("usage")[0]["teamID"] == "default"  # type: ignore[index]  # the admin key's own team
    everyone = run("usage", "--all")
    assert isinstance(everyone, list) and {u["teamID"] for u in everyone} >= {"default", team_id}


def test_an_operator_lists_every_team_and_every_teams_sandboxes(admin: httpx.Client, teams_node: Server) -> None:
    """The admin key lists every team (GET /teams, `aenv teams list`) and, with X-Team-ID: *, every
    team's sandboxes, each with its teamID (`aenv list --all-teams`); a team key sees its own,
    and asking for every team with one is a wrong key's 401."""
    a, b = new_team(admin, "listed-a"), new_team(admin, "listed-b")
    made = {}
    for team in (a, b):
        with team.client() as client:
            r = client.post("/v2/sandboxes", json={"templateID": "bb", "timeout": 120})
            assert r.status_code == 201, r.text
            made[team.team_id] = r.json()["sandboxID"]
    try:
        assert {a.team_id, b.team_id, "default"} <= {t["teamID"] for t in admin.get("/teams").json()}
        own = {s["sandboxID"] for s in admin.get("/v2/sandboxes").json()}
        assert not own & set(made.values())  # the admin key alone is the default team
        every = {s["sandboxID"]: s["teamID"] for s in admin.get("/v2/sandboxes", headers={"X-Team-ID": "*"}).json()}
        assert {sid: every.get(sid) for sid in made.values()} == {sid: team for team, sid in made.items()}
        with a.client() as client:
            assert [s["sandboxID"] for s in client.get("/v2/sandboxes").json()] == [made[a.team_id]]
            assert client.get("/v2/sandboxes", headers={"X-Team-ID": "*"}).status_code == 401
        listed = CliRunner().invoke(
            cli_app, ["--url", teams_node.url, "--api-key", API_KEY, "list", "--all-teams", "--json"]
        )
        assert listed.exit_code == 0, listed.output
        rows = {row["sandboxID"]: row["team"] for row in json.loads(listed.stdout)}
        assert {sid: rows.get(sid) for sid in made.values()} == {sid: team for team, sid in made.items()}
    finally:
        for team in (a, b):
            with team.client() as client:
                client.delete(f"/sandboxes/{made[team.team_id]}")
