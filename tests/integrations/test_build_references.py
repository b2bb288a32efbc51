"""`name:<build id>` starts exactly that build, as E2B's API does. Harbor 0.26 builds a task's
template, then creates every sandbox by `name:<build id>` (its `template_ref`); aenv answered 404
"tag '<uuid>' does not exist", so Harbor failed out of the box. A build that ended in a template
that already existed (every step cached) is that template: its build id starts it too. An older
build starts while it is kept (a tag holds it) and is otherwise E2B's 404 "does not exist"
(which Harbor reads as "not ready yet"); never the newest build in its place."""

from __future__ import annotations

import secrets
import uuid

import pytest
from e2b import Sandbox, Template

from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


def marker(ref: str) -> str:
    sbx = Sandbox.create(template=ref, timeout=60)
    try:
        return sbx.commands.run("cat /home/user/marker").stdout.strip()
    finally:
        sbx.kill()


def build(name: str, text: str, tags: list[str] | None = None) -> str:
    recipe = Template().from_template("base").run_cmd(f"echo {text} > /home/user/marker")
    return Template.build(recipe, name, tags=tags).build_id


def refused(ref: str) -> str:
    with pytest.raises(Exception) as caught:
        Sandbox.create(template=ref, timeout=30)
    return str(caught.value)


def test_a_build_id_starts_that_build(e2b_env: Server) -> None:
    name = f"harbor-task__{secrets.token_hex(4)}"
    first = build(name, "one", tags=["v1"])
    assert marker(f"{name}:{first}") == "one"
    assert marker(f"{name.upper()}:{first.upper()}") == "one"  # names and UUIDs as E2B compares them

    again = build(name, "one")  # every step cached: the same template, under a new build id
    assert again != first
    assert marker(f"{name}:{again}") == "one" and marker(f"{name}:{first}") == "one"
    assert {t.tag: t.build_id for t in Template.get_tags(name)}["v1"] == again  # the newest build of it

    second = build(name, "two")
    assert marker(f"{name}:{second}") == "two" and marker(name) == "two"
    assert marker(f"{name}:{first}") == "one"  # the older build, kept by its tag v1

    Template.remove_tags(name, ["v1"])  # nothing holds the older build now: it is gone, not replaced
    for gone in (first, again):
        assert f"tag '{gone}' does not exist for template '{name}'" in refused(f"{name}:{gone}")


def test_a_build_id_never_names_another_template_or_an_unknown_build(e2b_env: Server) -> None:
    mine, other = f"mine-{secrets.token_hex(4)}", f"other-{secrets.token_hex(4)}"
    build_id = build(mine, "mine")
    build(other, "other")
    assert "does not exist" in refused(f"{other}:{build_id}")
    assert "does not exist" in refused(f"{mine}:{uuid.uuid4()}")
    assert marker(f"{mine}:{build_id}") == "mine"
