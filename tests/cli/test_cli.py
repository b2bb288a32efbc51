"""The aenv CLI, in-process, against a real server (JSON output when not on a terminal)."""

from __future__ import annotations

import json
from pathlib import Path

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
        return result.exit_code, result.stdout

    return run


def test_cli_tour(cli, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    code, text = cli("create", "--env", "GREETING=hi", "--meta", "via=cli")
    assert code == 0, text
    sid = json.loads(text)["sandboxID"]
    try:
        code, text = cli("exec", sid, "echo $GREETING from $E2B_SANDBOX_ID")
        assert (code, text) == (0, f"hi from {sid}\n")
        code, _ = cli("exec", sid, "exit 5")
        assert code == 5
        src = tmp_path / "in.txt"
        src.write_text("payload")
        assert cli("upload", sid, str(src), "/home/user/in.txt")[0] == 0
        code, text = cli("ls", sid, "/home/user")
        assert code == 0 and any(e["name"] == "/home/user/in.txt" for e in json.loads(text))
        dst = tmp_path / "out.txt"
        assert cli("download", sid, "/home/user/in.txt", str(dst))[0] == 0
        assert dst.read_text() == "payload"
        code, text = cli("fork", sid, "-n", "2")
        assert code == 0, text
        children = [c["sandboxID"] for c in json.loads(text)]
        assert len(children) == 2
        assert cli("pause", sid)[0] == 0
        code, text = cli("list", "--meta", "via=cli")
        states = {r["sandboxID"]: r["state"] for r in json.loads(text)}
        assert states[sid] == "paused" and all(states[c] == "running" for c in children)
        assert cli("resume", sid)[0] == 0
        code, text = cli("snapshot", sid, "--durable")
        assert code == 0 and (snap := json.loads(text)["snapshotID"])
        code, text = cli("snapshots")
        assert {"snapshotID": snap, "committed": True}.items() <= next(
            s for s in json.loads(text) if s["snapshotID"] == snap
        ).items()
        code, text = cli("repo", "status")
        status = json.loads(text)
        assert code == 0 and status["url"].startswith("file://") and snap not in status["pending"]
        code, text = cli("repo", "gc")
        report = json.loads(text)
        assert code == 0 and (report["skipped"] or report["live_chunks"] > 0)
        code, text = cli("templates")
        assert any(t["name"] == "base" for t in json.loads(text))
        assert cli("rm", *children)[0] == 0
    finally:
        cli("rm", sid)
    code, _ = cli("rm", sid)
    assert code == 1  # already gone
    code, _ = cli("exec", "nosuchsandbox", "true")
    assert code == 1


def test_an_unreachable_server_is_a_clear_error_with_what_to_do() -> None:
    from tests.conftest import free_port

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    result = CliRunner().invoke(app, ["--url", url, "--api-key", API_KEY, "exec", "sbx_nothing", "true"])
    assert result.exit_code == 1
    assert f"cannot reach the aenv server: {url}" in result.stderr.replace("\n", "")
    said = " ".join(result.stderr.split())
    assert "./scripts/serve" in said and "AENV_URL" in said
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)  # no crash dump


@pytest.mark.parametrize(
    ("args", "key", "says", "hint"),
    [
        (["exec", "nosuchsandbox1", "true"], API_KEY, "not found", "aenv list"),
        (["list"], "wrong-key", "API key", "AENV_API_KEY"),
        (["create", "--template", "nosuchtemplate"], API_KEY, "nosuchtemplate", "aenv templates"),
    ],
)
def test_errors_say_what_to_do_next(server: Server, args: list[str], key: str, says: str, hint: str) -> None:
    result = CliRunner().invoke(app, ["--url", server.url, "--api-key", key, *args])
    assert result.exit_code == 1, result.output
    said = " ".join(result.stderr.split())
    assert said.startswith("error:") and says in said and hint in said, said
    assert "Traceback" not in result.output


def test_doctor_shows_the_host_the_kept_platform_choice_and_the_server(
    cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, server: Server
) -> None:  # type: ignore[no-untyped-def]
    from aenv.runtime import platforms

    kept = tmp_path / "platform.json"
    trials = [platforms.Trial("systrap", {"spawn": 0.5, "stat": 0.25}, True), platforms.Trial("kvm", error="hung")]
    platforms.save(kept, platforms.Choice("systrap", "calibration", trials, {"k": 1}, 1_700_000_000.0))
    monkeypatch.setenv("AENV_RUNSC_CALIBRATION", str(kept))
    monkeypatch.setenv("AENV_RUNSC_PLATFORM", "auto")
    code, text = cli("doctor", "--json")
    report = json.loads(text)
    checks = {c["check"]: c for c in report["checks"]}
    assert {"python", "root", "runsc", "cgroups", "kvm", "disk", "runsc platform", "server"} <= set(checks)
    assert code == (1 if any(c["status"] == "fail" for c in checks.values()) else 0)
    assert checks["python"]["status"] == "ok"
    detail = checks["runsc platform"]["detail"]
    assert detail.startswith("systrap (kept calibration") and "systrap 0.75 s" in detail and "kvm unusable" in detail
    assert report["calibration"]["trials"]["kvm"] == {"unusable": "hung"}
    assert checks["server"]["status"] == "ok" and server.url in checks["server"]["detail"]
    assert report["server"]["status"] == "ok"

    kept.write_text("{damaged")
    code, text = cli("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(text)["checks"]}
    assert checks["runsc platform"]["status"] == "warn" and "not measured yet" in checks["runsc platform"]["detail"]


def test_doctor_checks_what_the_qemu_driver_needs(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("AENV_DRIVER", "qemu")
    code, text = cli("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(text)["checks"]}
    assert checks["qemu"]["status"] == "ok", checks["qemu"]  # scripts/install installed it here
    assert "qemu-img" in checks["qemu"]["detail"] and "guest kernel" in checks["qemu"]["detail"]
    monkeypatch.setenv("AENV_QEMU", str(tmp_path / "no-such-qemu"))
    code, text = cli("doctor", "--json")
    checks = {c["check"]: c for c in json.loads(text)["checks"]}
    assert code == 1
    assert checks["qemu"]["status"] == "fail" and "AENV_DRIVER=qemu ./scripts/install" in checks["qemu"]["detail"]
    monkeypatch.delenv("AENV_DRIVER")
    code, text = cli("doctor", "--json")
    assert "qemu" not in {c["check"] for c in json.loads(text)["checks"]}  # another driver's needs are not asked
