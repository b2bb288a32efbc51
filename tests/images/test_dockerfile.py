"""Dockerfile builds: parsing (no sandbox), then real builds with the step cache and start command."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import Sandbox

from aenv.sdk import BuildError, Client
from aenv.templates import dockerfile as df
from tests.conftest import API_KEY, Server
from tests.images.oci import Registry, busybox_layer, start_registry


def test_parse_continuations_flags_and_forms() -> None:
    text = 'ARG V=1\nFROM img:${V}\n# comment\nRUN a \\\n  && b\nCOPY --chown=u:g x y /d/\nCMD ["s", "1"]\n'
    steps = df.parse(text)
    assert [s.keyword for s in steps] == ["ARG", "FROM", "RUN", "COPY", "CMD"]
    assert steps[2].args == "a  && b" and steps[2].line == 4
    assert steps[3].flags == {"chown": "u:g"} and df.copy_args(steps[3], {}) == (["x", "y"], "/d/")
    assert steps[4].exec_form() == ["s", "1"]
    assert df.substitute("${A:-x}/${B:+y}/$C", {"B": "1", "C": "c"}) == "x/y/c"


@pytest.mark.parametrize(
    "text",
    [
        "RUN x",
        "FROM a\nFROM b",
        "FROM a\nFROBNICATE x",
        "FROM a\nRUN --mount=type=cache true",
        "FROM a\nADD http://x /y",
    ],
)
def test_parse_refuses_what_it_cannot_build(text: str) -> None:
    with pytest.raises(df.DockerfileError):
        steps = df.parse(text)
        for step in steps:
            if step.keyword == "ADD":
                df.copy_args(step, {})


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


DOCKERFILE = """
ARG GREETING=hello
FROM {image}
ARG GREETING
ENV APP_HOME=/app MSG="${{GREETING}} world"
WORKDIR $APP_HOME
COPY --chown=user:user files/ ./files/
COPY note.txt .
RUN echo "$MSG" > built.txt && id -un > who.txt
USER user
RUN echo "as $(id -un)" > /app/files/user.txt
EXPOSE 8080
CMD ["/bin/sh", "-c", "while true; do date +%s > /tmp/hb.new && mv /tmp/hb.new /tmp/heartbeat; sleep 0.2; done"]
"""


@pytest.mark.sandbox
def test_build_cache_and_start_command(registry: Registry, server: Server, e2b_env: Server, tmp_path: Path) -> None:
    registry.push_image("tests/bbase", "1", [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")])
    ctx = tmp_path / "ctx"
    (ctx / "files" / "sub").mkdir(parents=True)
    (ctx / "files" / "sub" / "data.txt").write_text("data")
    (ctx / "note.txt").write_text("note v1")
    (ctx / "Dockerfile").write_text(DOCKERFILE.format(image=f"{registry.host}/tests/bbase:1"))

    logs: list[str] = []
    with Client(server.url, API_KEY) as client:
        row = client.build("app", ctx, build_args={"GREETING": "hi"}, on_log=logs.append)
        assert row["name"] == "app"
        assert any(line.startswith("[") and "RUN" in line for line in logs)

        sbx = Sandbox.create(template="app", timeout=120)
        try:
            run = sbx.commands.run
            assert run("cat /app/built.txt /app/who.txt /app/note.txt").stdout == "hi world\nroot\nnote v1"
            assert run("cat /app/files/sub/data.txt /app/files/user.txt").stdout == "dataas user\n"
            assert run("stat -c %U /app/files /app/files/sub/data.txt").stdout.split() == ["user", "user"]
            assert run("echo $MSG").stdout == "hi world\n"
            # The recipe's last USER and WORKDIR are the sandbox's defaults (as E2B persists them).
            assert run("id -un; pwd").stdout.split() == ["user", "/app"]
            assert run("id -un; pwd", user="root").stdout.split() == ["root", "/app"]
            first = int(run("cat /tmp/heartbeat").stdout)
            time.sleep(1.5)
            assert int(run("cat /tmp/heartbeat").stdout) > first  # the start command runs on
        finally:
            sbx.kill()

        logs.clear()
        started = time.monotonic()
        again = client.build("app", ctx, build_args={"GREETING": "hi"}, on_log=logs.append)
        assert again["templateID"] == row["templateID"]  # nothing changed: not even a new commit
        steps = [line for line in logs if line.startswith("[") and ("RUN" in line or "COPY" in line)]
        assert steps and all(line.endswith("(cached)") for line in steps), steps
        assert time.monotonic() - started < 60

        # Only this COPY and what follows it run again. Its own content: a data dir kept from an
        # earlier run has every step of a fixed "v2" cached.
        v2 = f"note v2 {uuid.uuid4().hex}"
        (ctx / "note.txt").write_text(v2)
        logs.clear()
        client.build("app", ctx, build_args={"GREETING": "hi"}, on_log=logs.append)
        marks = {
            line.split("] ", 1)[1].split(" ")[0] + line.split("] ", 1)[1][4:20]: line
            for line in logs
            if line.startswith("[")
        }
        copy_files = next(line for line in logs if "COPY --chown" in line)
        copy_note = next(line for line in logs if "COPY note.txt" in line)
        assert copy_files.endswith("(cached)") and not copy_note.endswith("(cached)"), marks
        assert not any(line.endswith("(cached)") for line in logs if line.startswith("[") and "RUN" in line)
        sbx = Sandbox.create(template="app", timeout=60)
        try:
            assert sbx.commands.run("cat /app/note.txt").stdout == v2
        finally:
            sbx.kill()

        (ctx / "Dockerfile").write_text(f"FROM {registry.host}/tests/bbase:1\nRUN echo about to fail; exit 3\n")
        with pytest.raises(BuildError) as failed:
            client.build("broken", ctx)
        assert failed.value.step == 2 and "exit status 3" in failed.value.message
        assert "about to fail" in failed.value.output
        assert "broken" not in [t["name"] for t in client.templates()]


@pytest.mark.sandbox
def test_e2b_template_builder(registry: Registry, e2b_env: Server, tmp_path: Path) -> None:
    """The `e2b` SDK's Template builder, unchanged, against aenv's template build API."""
    from e2b import Template, wait_for_file

    registry.push_image("tests/e2bbase", "1", [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")])
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "main.txt").write_text("from the context")
    template = (
        Template(file_context_path=str(tmp_path))
        .from_image(f"{registry.host}/tests/e2bbase:1")
        .copy("app/main.txt", "/home/user/app/")
        .set_envs({"MODE": "e2b built"})
        .run_cmd("echo $MODE > /home/user/built.txt")
        .run_cmd("id -un > /who", user="root")
        .set_workdir("/home/user/app")
        .set_start_cmd(  # written whole each time: a `>` alone leaves it empty until date writes (seen in CI)
            "sh -c 'while true; do date +%s > /tmp/beat.new && mv /tmp/beat.new /tmp/beat; sleep 0.2; done'",
            wait_for_file("/tmp/beat"),
        )
    )
    logs: list[str] = []
    info = Template.build(template, "e2btpl:v1", on_build_logs=lambda entry: logs.append(entry.message))
    assert info.name.startswith("e2btpl") or info.template_id
    assert any("RUN" in line for line in logs)
    assert Template.exists("e2btpl")

    sbx = Sandbox.create(template="e2btpl", timeout=60)
    try:
        run = sbx.commands.run
        assert run("cat /home/user/app/main.txt").stdout == "from the context"
        assert run("cat /home/user/built.txt /who").stdout == "e2b built\nroot\n"
        assert run("cat /tmp/beat").stdout.strip().isdigit()  # the start command is running
        assert run("pwd").stdout.strip() == "/home/user/app"  # set_workdir persists into sandboxes
    finally:
        sbx.kill()

    failing = Template().from_image(f"{registry.host}/tests/e2bbase:1").run_cmd("exit 9")
    with pytest.raises(Exception) as failed:  # the SDK raises its BuildException
        Template.build(failing, "e2bfail")
    assert "failed to run command 'exit 9': exit status 9" in str(failed.value)


@pytest.mark.sandbox
def test_e2b_tags_name_builds(registry: Registry, e2b_env: Server) -> None:
    """Tags as E2B has them: name:v1 keeps its build after name:v2 is built; the bare name is the
    newest build; tags can be assigned, listed and removed with the SDK."""
    from e2b import Template

    registry.push_image("tests/tagbase", "1", [(busybox_layer().dir("tmp", 0o1777).bytes(), "gzip")])
    image = f"{registry.host}/tests/tagbase:1"
    name = f"tagged-{uuid.uuid4().hex[:8]}"  # the local test data dir outlives a run
    v1 = Template.build(Template().from_image(image).run_cmd("echo one > /home/user/v"), f"{name}:v1")
    v2 = Template.build(Template().from_image(image).run_cmd("echo two > /home/user/v"), f"{name}:v2")
    assert v1.build_id != v2.build_id

    def content(ref: str) -> str:
        sbx = Sandbox.create(template=ref, timeout=60)
        try:
            return sbx.commands.run("cat /home/user/v").stdout.strip()
        finally:
            sbx.kill()

    assert (content(f"{name}:v1"), content(f"{name}:v2"), content(name)) == ("one", "two", "two")
    tags = {t.tag: t.build_id for t in Template.get_tags(name)}
    assert tags == {"v1": v1.build_id, "v2": v2.build_id}

    info = Template.assign_tags(f"{name}:v1", ["stable"])
    assert info.build_id == v1.build_id and content(f"{name}:stable") == "one"
    Template.assign_tags(f"{name}:v2", ["stable"])  # a tag moves between builds
    assert content(f"{name}:stable") == "two"

    Template.remove_tags(name, ["v1"])  # its build has no tag left: it is gone
    assert set(t.tag for t in Template.get_tags(name)) == {"v2", "stable"}
    with pytest.raises(Exception, match=f"{name}:v1|tag 'v1' does not exist for template '{name}'"):
        Sandbox.create(template=f"{name}:v1", timeout=30)
