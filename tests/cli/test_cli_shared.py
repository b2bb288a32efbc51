"""`aenv volumes`, `aenv secrets`, `aenv webhooks`, `aenv events` and `aenv create --volume` against
a real node: what the E2B API keeps beside sandboxes, from the command line."""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import httpx
import pytest
from typer.testing import CliRunner

from aenv.cli.main import app
from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture()
def cli(server: Server):  # type: ignore[no-untyped-def]
    runner = CliRunner()

    def run(*args: str, stdin: str | None = None) -> tuple[int, str]:
        result = runner.invoke(app, ["--url", server.url, "--api-key", API_KEY, *args], input=stdin)
        return result.exit_code, result.stdout

    return run


def test_volumes_from_the_command_line(cli, api: httpx.Client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    name = f"cli-{secrets.token_hex(3)}"
    code, text = cli("volumes", "create", name, "--json")
    assert code == 0, text
    volume_id = json.loads(text)[0]["volumeID"]
    try:
        local = tmp_path / "in.txt"
        local.write_text("from the cli\n")
        assert cli("volumes", "put", volume_id, "/dir/in.txt", str(local))[0] == 0
        code, text = cli("volumes", "ls", volume_id, "/", "--depth", "2", "--json")
        assert code == 0 and {e["path"] for e in json.loads(text)} == {"/dir", "/dir/in.txt"}
        assert cli("volumes", "cat", volume_id, "/dir/in.txt") == (0, "from the cli\n")
        code, sid = cli("create", "--volume", f"/mnt/data={name}", "--quiet")
        assert code == 0, sid
        sid = sid.strip()
        try:
            assert cli("exec", sid, "cat /mnt/data/dir/in.txt") == (0, "from the cli\n")
            code, text = cli("fork", sid, "-n", "1", "--clone-volumes", "--json")
            assert code == 0, text
            child = json.loads(text)[0]["sandboxID"]
            assert cli("exec", child, "echo mine > /mnt/data/dir/in.txt")[0] == 0
            assert cli("volumes", "cat", volume_id, "/dir/in.txt") == (0, "from the cli\n")  # the child's copy took it
            assert cli("rm", child)[0] == 0
            copy = next(v for v in api.get("/volumes").json() if v["name"] == f"{name}-{child}")
            assert cli("volumes", "cat", copy["volumeID"], "/dir/in.txt") == (0, "mine\n")
            assert cli("volumes", "delete", copy["volumeID"])[0] == 0
        finally:
            assert cli("rm", sid)[0] == 0
        code, text = cli("events", sid, "--json")
        told = [e for e in json.loads(text) if e["event"] != "updated"]  # exec's connect renews its timeout
        assert code == 0 and [e["event"] for e in told] == ["created", "checkpointed", "killed"], text  # the fork's
        assert [e["detail"] for e in told] == ["", "", "request"]
    finally:
        assert cli("volumes", "delete", volume_id)[0] == 0
    code, text = cli("volumes", "list", "--json")
    assert code == 0 and volume_id not in text


def test_secrets_and_webhooks_from_the_command_line(cli, api: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    name, value = f"cli-{secrets.token_hex(3)}", f"value-{secrets.token_hex(8)}"
    code, text = cli("secrets", "set", name, stdin=value + "\n")
    assert code == 0 and value not in text, text
    code, text = cli("secrets", "set", name, "--value", value + "2", "--json")
    assert code == 0 and json.loads(text)[0]["currentVersion"] == 2 and value not in text
    code, text = cli("secrets", "list", "--json")
    assert code == 0 and name in text and value not in text
    assert cli("secrets", "delete", name)[0] == 0
    assert api.get(f"/secrets/{name}").status_code == 404
    code, text = cli(
        "webhooks", "create", "http://127.0.0.1:9/hook", "--secret", "cli-secret-123", "--type", "killed", "--json"
    )
    assert code == 0, text
    made = json.loads(text)[0]
    assert made["events"] == ["sandbox.lifecycle.killed"] and "cli-secret-123" not in text
    code, text = cli("webhooks", "list", "--json")
    assert code == 0 and made["id"] in text and "cli-secret-123" not in text
    assert cli("webhooks", "delete", made["id"])[0] == 0
    assert api.get(f"/events/webhooks/{made['id']}").status_code == 404
