"""A template an E2B build names with capitals is found by that name, as E2B finds it: Harbor
names each task's template `<task>__<hash>` from the task's own name, checks `alias_exists` with
it and creates from it. Seen failing before the fix: the build stored `case-env__...` (names are
lowercase), then `alias_exists` said False (a rebuild every trial) and the create was a 404."""

from __future__ import annotations

import secrets

import pytest
from e2b import Sandbox, Template

from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


def test_a_mixed_case_build_name_is_found_by_it(e2b_env: Server) -> None:
    name = f"Case-Env__{secrets.token_hex(4).upper()}"
    Template.build(Template().from_template("base").run_cmd("echo built > /home/user/marker"), alias=name)
    assert Template.alias_exists(name) and Template.alias_exists(name.lower())
    sbx = Sandbox.create(template=name, timeout=60)
    try:
        assert sbx.commands.run("cat /home/user/marker").stdout == "built\n"
    finally:
        sbx.kill()
    assert not Template.alias_exists(name + "X")  # still only what was built
