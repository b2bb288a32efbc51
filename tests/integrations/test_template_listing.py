"""E2B's template listings: `GET /v2/templates` (teamID, nextToken, limit; the next page's token in
x-next-token, as the SDK's paginators read it) and `GET /default-templates`, each item E2B's whole
Template model (the SDK's own model parses it); aenv answered 404 to both."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, Template
from e2b.api.client.models.template import Template as TemplateModel

from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture()
def api(e2b_env: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": API_KEY}, timeout=60) as client:
        yield client


def pages(api: httpx.Client, limit: int, **params: str) -> list[list[dict[str, object]]]:
    out, token = [], None
    while True:
        query = {"limit": str(limit), **params, **({"nextToken": token} if token else {})}
        r = api.get("/v2/templates", params=query)
        assert r.status_code == 200, r.text
        out.append(r.json())
        token = r.headers.get("x-next-token")
        if not token:
            return out


def test_templates_are_listed_in_pages_as_e2b_models(api: httpx.Client) -> None:
    names = [f"listed-{secrets.token_hex(3)}" for _ in range(3)]
    built = {name: Template.build(Template().from_template("base").run_cmd(f"echo {name}"), name) for name in names}
    whole = pages(api, 100)
    assert len(whole) == 1
    listed = {t["name"]: t for t in whole[0]}
    assert set(names) | {"base"} <= set(listed)
    for name in names:
        model = TemplateModel.from_dict(listed[name])  # every field E2B's model requires, well typed
        assert model.build_id == built[name].build_id and model.build_status.value == "ready"
        assert model.aliases[0] == name and model.public is False and model.is_default is False
        assert model.cpu_count >= 1 and model.memory_mb > 0 and model.disk_size_mb > 0
    assert TemplateModel.from_dict(listed["base"]).is_default is True

    one_by_one = pages(api, 1)
    assert all(len(page) == 1 for page in one_by_one)
    assert [t["templateID"] for page in one_by_one for t in page] == [t["templateID"] for t in whole[0]]
    assert api.get("/v2/templates", params={"nextToken": "not-a-token"}).status_code == 400
    assert api.get("/v2/templates", params={"limit": "0"}).status_code == 400


def test_default_templates_and_spawn_counts(api: httpx.Client) -> None:
    defaults = api.get("/default-templates")
    assert defaults.status_code == 200
    names = [t["name"] for t in defaults.json()]
    assert names[0] == "base" and set(names) <= {"base", "desktop"}, names  # `desktop` once built
    before = TemplateModel.from_dict(defaults.json()[0]).spawn_count
    Sandbox.create(template="base", timeout=30).kill()
    after = TemplateModel.from_dict(api.get("/default-templates").json()[0])
    assert after.spawn_count == before + 1 and after.last_spawned_at is not None


def test_a_team_lists_its_own_templates_and_no_other_teams(api: httpx.Client, e2b_env: Server) -> None:
    made = api.post("/teams", json={"name": f"lister-{secrets.token_hex(3)}"})
    assert made.status_code == 201, made.text
    team, key = made.json()["teamID"], made.json()["apiKey"]
    mine = f"mine-{secrets.token_hex(3)}"
    Template.build(Template().from_template("base").run_cmd("true"), mine, api_key=key)
    with httpx.Client(base_url=e2b_env.url, headers={"X-API-Key": key}, timeout=60) as client:
        own = {t["name"] for t in client.get("/v2/templates").json()}
        assert mine in own and "base" in own
        assert {t["name"] for t in client.get("/v2/templates", params={"teamID": team}).json()} == own
        other = client.get("/v2/templates", params={"teamID": "default"})
        assert other.status_code == 403 and other.json()["code"] == 403
    admin_view = {t["name"] for t in api.get("/v2/templates", params={"teamID": team}).json()}
    assert mine in admin_view  # the admin key lists any team's
    assert mine not in {t["name"] for t in api.get("/v2/templates").json()}  # its own team is the default
