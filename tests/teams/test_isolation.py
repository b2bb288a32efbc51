"""Team B against team A's sandboxes, snapshot, template, team and keys, on every route of one node.

The routes are read from the app itself (tests/teams/attacks.py): a route with a path parameter is
attacked with A's ids and must answer exactly as for ids that do not exist (status and body, ids
aside); a route without one must say in ``UNSCOPED`` what another team may do there, so a new
route fails this test until it does. Seen failing with the team checks off (aenv/teams/guard.py
``restricted`` returning None): every test here failed (B's alias check found A's template, the
dashboard listed it, B's SDK connected to A's sandbox).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server
from tests.teams.attacks import Owned, drop_owned, envd_traffic, make_owned, routes_with_ids, routes_without_ids
from tests.teams.conftest import TeamKey, new_team

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def two_teams(teams_node: Server) -> Iterator[tuple[Owned, TeamKey]]:
    with teams_node.client() as admin:
        a, b = new_team(admin, "iso-a"), new_team(admin, "iso-b")
    owned = make_owned(a, Path(teams_node.data_dir) / "imports" / "bb")
    yield owned, b
    drop_owned(owned)


def test_every_route_with_an_id_answers_another_teams_as_one_that_does_not_exist(
    two_teams: tuple[Owned, TeamKey],
) -> None:
    assert routes_with_ids(*two_teams) > 80


def test_every_route_without_an_id_is_classified_and_holds(
    two_teams: tuple[Owned, TeamKey], teams_node: Server
) -> None:
    routes_without_ids(*two_teams, Path(teams_node.data_dir) / "imports" / "bb")


def test_envd_traffic_and_tokens_do_not_cross_teams(two_teams: tuple[Owned, TeamKey]) -> None:
    envd_traffic(*two_teams)


def test_a_public_template_is_used_by_every_team_and_changed_by_its_own_only(
    two_teams: tuple[Owned, TeamKey], teams_node: Server
) -> None:
    """`bb` is the default team's, public. Seen failing without the ownership check: team B
    deleted it (204)."""
    _, b = two_teams
    with b.client() as client:
        made = client.post("/sandboxes", json={"templateID": "bb", "timeout": 30})
        assert made.status_code == 201
        client.delete(f"/sandboxes/{made.json()['sandboxID']}")
        for method, path, body in (
            ("DELETE", "/templates/bb", None),
            ("PATCH", "/templates/bb", {"public": False}),
            ("PATCH", "/templates/bb", {"aliases": ["bb:stolen"]}),
            ("PUT", "/templates/bb/warm-pool", {"size": 3}),
            ("POST", "/templates/tags", {"target": "bb", "tags": ["stolen"]}),
            ("DELETE", "/templates/tags", {"name": "bb", "tags": ["latest"]}),
        ):
            r = client.request(method, path, json=body)
            assert r.status_code == 403, (method, path, r.status_code, r.text[:200])
    with teams_node.client() as admin:
        bb = admin.get("/templates/bb").json()
        assert bb["public"] is True and bb["aliases"] == ["bb"]
        assert admin.get("/templates/bb/warm-pool").json()["size"] in (None, 0)
