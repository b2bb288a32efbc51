"""CLI conventions of issue 15: `build -f` as docker's, `--json` on listings, `logs`, `top --once`."""

from __future__ import annotations

import json
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

    def run(*args: str) -> tuple[int, str]:
        result = runner.invoke(app, ["--url", server.url, "--api-key", API_KEY, *args])
        return result.exit_code, result.stdout + (result.stderr if result.stderr_bytes is not None else "")

    return run


@pytest.mark.parametrize("where", ["relative-to-cwd", "absolute-inside", "absolute-outside"])
def test_build_f_names_the_dockerfile_as_docker_does(
    cli, api: httpx.Client, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:  # type: ignore[no-untyped-def]
    context = tmp_path / "context"
    (context / "sub").mkdir(parents=True)
    (context / "hello.txt").write_text("from the context\n")
    recipe = "FROM base\nCOPY hello.txt /opt/hello.txt\nENV WHERE=" + where + "\n"
    # a Dockerfile in the context that must not be the one used
    (context / "Dockerfile").write_text("FROM base\nENV WHERE=wrong\n")
    if where == "relative-to-cwd":
        (context / "sub" / "Build.df").write_text(recipe)
        monkeypatch.chdir(context / "sub")
        file = "Build.df"
    elif where == "absolute-inside":
        (context / "sub" / "Build.df").write_text(recipe)
        file = str(context / "sub" / "Build.df")
    else:
        (tmp_path / "elsewhere.df").write_text(recipe)
        file = str(tmp_path / "elsewhere.df")
    name = f"cli-f-{where}"
    code, text = cli("build", str(context), "--name", name, "-f", file)
    try:
        assert code == 0, text
        sid = api.post("/sandboxes", json={"templateID": name, "timeout": 60}).json()["sandboxID"]
        try:
            code, out = cli("exec", sid, "cat /opt/hello.txt; echo $WHERE")
            assert (code, out) == (0, f"from the context\n{where}\n")
        finally:
            api.delete(f"/sandboxes/{sid}")
    finally:
        api.delete(f"/templates/{name}")


def test_build_f_that_is_missing_says_what_to_do(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, text = cli("build", str(tmp_path), "--name", "nothing", "-f", str(tmp_path / "nope.df"))
    assert code == 2 and "-f PATH" in " ".join(text.split())  # rich wraps long lines


def test_listings_take_json_and_logs_show_commands(cli, api: httpx.Client) -> None:  # type: ignore[no-untyped-def]
    code, text = cli("create", "--meta", "via=conventions")
    assert code == 0, text
    sid = json.loads(text)["sandboxID"]
    try:
        assert cli("exec", sid, "echo one")[0] == 0
        assert cli("exec", sid, "exit 7")[0] == 7
        for args in (("list", "--json"), ("templates", "--json"), ("snapshots", "--json"), ("ls", sid, "--json")):
            code, text = cli(*args)
            assert code == 0 and isinstance(json.loads(text), list), (args, text)
        code, text = cli("repo", "status", "--json")
        assert code == 0 and "pending" in json.loads(text)
        code, text = cli("repo", "gc", "--json")
        assert code == 0 and isinstance(json.loads(text), dict), text
        code, text = cli("fork", sid, "-n", "1", "--json")
        assert code == 0 and [c["parentID"] for c in json.loads(text)] == [sid], text
        cli("rm", json.loads(text)[0]["sandboxID"])
        code, text = cli("logs", sid, "--json")
        assert code == 0, text
        commands = json.loads(text)["commands"]
        assert [(c["cmd"].split(" -c ")[-1], c["exitCode"]) for c in commands[:2]] == [("exit 7", 7), ("echo one", 0)]
        code, text = cli("top", "--once", "--interval", "0.5")
        assert code == 0, text
        node = api.get("/dashboard/api/nodes").json()[0]
        assert node["nodeID"] in text and "create" in text and "p99" in text
    finally:
        cli("rm", sid)
    code, text = cli("logs", sid)
    assert code == 1 and "not found" in text.lower()


def test_upload_streams_a_file_with_progress_and_download_gets_it_back(cli, api: httpx.Client, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """`aenv upload` streams the file in chunks (it used to read it whole into memory) and the SDK
    reports progress up to the file's size; the bytes arrive unchanged."""
    import asyncio
    import os

    from aenv.sdk import AsyncClient

    local = tmp_path / "payload.bin"
    local.write_bytes(os.urandom(3 * (1 << 20) + 12345))  # more than one chunk, not a whole number of them
    sid = api.post("/sandboxes", json={"templateID": "base", "timeout": 120}).json()["sandboxID"]
    try:
        code, text = cli("upload", sid, str(local), "/home/user/payload.bin")
        assert code == 0, text
        code, text = cli("download", sid, "/home/user/payload.bin", str(tmp_path / "back.bin"))
        assert code == 0, text
        assert (tmp_path / "back.bin").read_bytes() == local.read_bytes()

        seen: list[tuple[int, int]] = []

        async def with_progress() -> int:
            async with AsyncClient(str(api.base_url), API_KEY) as client:
                sbx = await client.connect(sid)
                return await sbx.write_from("/home/user/again.bin", local, on_progress=lambda *p: seen.append(p))

        size = local.stat().st_size
        assert asyncio.run(with_progress()) == size

        told: list[int] = []  # a download's progress bar has the file's size as its total

        async def download_size() -> int:
            async with AsyncClient(str(api.base_url), API_KEY) as client:
                sbx = await client.connect(sid)
                return await sbx.read_to("/home/user/payload.bin", lambda _: None, on_size=told.append)

        assert asyncio.run(download_size()) == size and told == [size]
        assert len(seen) == 4 and seen[-1] == (size, size) and [s for s, _ in seen] == sorted(s for s, _ in seen)
        code, text = cli("exec", sid, "cmp /home/user/payload.bin /home/user/again.bin && echo same")
        assert (code, text) == (0, "same\n")
        assert cli("upload", sid, str(tmp_path / "missing.bin"), "/tmp/x")[0] == 2
    finally:
        api.delete(f"/sandboxes/{sid}")
