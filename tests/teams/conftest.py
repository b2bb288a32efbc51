"""One busybox node for the teams tests (template `bb`, made public so every team may use it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.conftest import DATA_DIR, Server, _have_runtime, start_busybox_node


@dataclass
class TeamKey:
    team_id: str
    key: str
    url: str

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-Key": self.key}, timeout=120)


def new_team(admin: httpx.Client, name: str, **quotas: float) -> TeamKey:
    r = admin.post("/teams", json={"name": name, "quotas": quotas})
    assert r.status_code == 201, r.text
    body = r.json()
    return TeamKey(body["teamID"], body["apiKey"], str(admin.base_url).rstrip("/"))


@pytest.fixture(scope="package")
def teams_node() -> Iterator[Server]:
    if not _have_runtime():
        if os.environ.get("CI"):
            pytest.fail("CI must run the sandbox tests: need root, runsc and debootstrap")
        pytest.skip("needs root, runsc and debootstrap (the CI machine has them)")
    # Bursts of 200 creates: the host's memory check must not be what answers them. A queued burst
    # of 200 through a quota of 8 took over 60 s on a loaded CI machine: waits up to 300 s.
    env = {"AENV_MIN_FREE_MEMORY_MB": "0", "AENV_MAX_CREATE_WAIT": "300", "AENV_METRICS_INTERVAL": "1"}
    srv = start_busybox_node(Path(f"{DATA_DIR}-teams"), env)
    with srv.client() as admin:
        assert admin.patch("/templates/bb", json={"public": True}).status_code == 200
        for item in admin.get("/v2/sandboxes", headers={"X-Team-ID": "*"}).json():
            admin.delete(f"/sandboxes/{item['sandboxID']}", headers={"X-Team-ID": "*"})
    yield srv
    srv.stop()


@pytest.fixture()
def admin(teams_node: Server) -> Iterator[httpx.Client]:
    with teams_node.client() as client:
        yield client
