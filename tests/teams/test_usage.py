"""What a team used, counted by the node: sandbox-seconds, CPU-seconds (its cgroups), memory and
storage GiB-seconds, on GET /teams/{id}/usage, /teams/{id}/metrics (E2B's TeamMetric) and /metrics."""

from __future__ import annotations

import re
import time
from typing import Any

import httpx
import pytest

from tests.teams.conftest import TeamKey, new_team

pytestmark = pytest.mark.sandbox
BURN = "i=0; while [ $i -lt 400000 ]; do i=$((i+1)); done"  # about a second of one core


def _usage(client: httpx.Client, team: TeamKey) -> dict[str, Any]:
    r = client.get(f"/teams/{team.team_id}/usage")
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


def _until(check: Any, what: str, timeout: float = 20) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := check()):
        assert time.monotonic() < deadline, what
        time.sleep(0.3)
    return value


def test_usage_is_counted_per_team(admin: httpx.Client) -> None:
    from e2b import Sandbox

    team, idle = new_team(admin, "usage"), new_team(admin, "idle")
    sbx = Sandbox.create("bb", api_key=team.key, api_url=team.url, sandbox_url=team.url, timeout=120)
    try:
        assert sbx.commands.run(BURN, timeout=60).exit_code == 0
        with team.client() as client:
            used = _until(lambda: (u := _usage(client, team))["cpuSeconds"] >= 0.5 and u, "CPU-seconds counted")
            assert used["runningSandboxes"] == 1 and used["pausedSandboxes"] == 0
            seconds = used["sandboxSeconds"]
            assert seconds > 0
            # 1024 MiB of memory and 2048 MiB of disk a sandbox (the node's defaults)
            assert used["memoryGiBSeconds"] == pytest.approx(seconds, rel=0.05)
            assert used["storageGiBSeconds"] == pytest.approx(2 * seconds, rel=0.05)
            assert client.post(f"/sandboxes/{sbx.sandbox_id}/pause").status_code == 204
            paused = _until(lambda: (u := _usage(client, team))["pausedSandboxes"] == 1 and u, "paused counted")
            time.sleep(2.5)
            later = _usage(client, team)
            assert later["sandboxSeconds"] == pytest.approx(paused["sandboxSeconds"], abs=1.5)  # paused: no time
            assert later["storageGiBSeconds"] >= paused["storageGiBSeconds"] + 3  # its disk is still held
            series = client.get(f"/teams/{team.team_id}/metrics").json()
            assert (
                series and {"timestamp", "timestampUnix", "concurrentSandboxes", "sandboxStartRate"} <= series[0].keys()
            )
            assert max(p["concurrentSandboxes"] for p in series) == 1
            assert any(p["sandboxStartRate"] > 0 for p in series)
            assert series[-1]["cpuSeconds"] >= 0.5
            start = series[-1]["timestampUnix"]
            assert all(
                p["timestampUnix"] >= start
                for p in client.get(f"/teams/{team.team_id}/metrics", params={"start": start}).json()
            )
            top = client.get(f"/teams/{team.team_id}/metrics/max", params={"metric": "concurrent_sandboxes"}).json()
            assert top["value"] == 1 and top["timestampUnix"] > 0  # E2B's MaxTeamMetric
            assert client.get(f"/teams/{team.team_id}/metrics/max", params={"metric": "cpu"}).status_code == 400
            assert client.get(f"/teams/{idle.team_id}/usage").status_code == 404  # another team's
        with idle.client() as client:
            assert _usage(client, idle)["sandboxSeconds"] == 0
        assert _usage(admin, team)["cpuSeconds"] >= 0.5  # the admin key reads any team's
        text = admin.get("/metrics").text
        found = re.search(rf'aenv_team_cpu_seconds_total{{team="{team.team_id}"}} ([0-9.e+]+)', text)
        assert found is not None and float(found.group(1)) >= 0.5
        assert f'aenv_team_sandboxes{{state="paused",team="{team.team_id}"}} 1.0' in text
    finally:
        sbx.kill()
