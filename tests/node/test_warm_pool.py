"""Warm pools (aenv/node/warmpool.py): a create takes an idle, already restored sandbox of its
template and gets exactly what a fresh one would (its own id, tokens, env, metadata, timeout,
lifecycle and network rules); pool members are never listed, counted or billed; a create the pool
cannot serve as asked (other limits) restores as before; a rebuilt or deleted template's members go.

One node for the module, on a busybox template (nothing to debootstrap).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.node.warmpool import RETRY_MAX_SECONDS, Build, Failing, Member, plan
from aenv.runtime.base import Limits
from tests.conftest import Server, e2b_client, start_server
from tests.images.oci import busybox_layer, write_layout
from tests.node.test_restart import runsc_containers

pytestmark = pytest.mark.sandbox

READY = 60.0  # how long a pool may take to fill on a busy two-core machine


def bb_layout(root: Path, tag: str, marker: str) -> str:
    layer = busybox_layer().symlink("bin/nc", "busybox").file("build", marker.encode())
    write_layout(root, [layer.bytes()], tag, {"User": "user", "WorkingDir": "/home/user"})  # E2B's defaults
    return f"oci:{root}:{tag}"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("warm") / "data"
    env = {"AENV_BUILD_BASE": "false", "AENV_REPO": "none", "AENV_WARM_POOL_MIN_FREE_MB": "0"}
    srv = start_server(data, extra_env=env, wait_for=None)
    with srv.client() as api:
        r = api.post(
            "/templates/from-image", json={"name": "bb", "image": bb_layout(data / "imports" / "v1", "v1", "one")}
        )
        assert r.status_code == 201, r.text
    yield srv
    srv.stop()
    assert runsc_containers(srv) == set()  # members are torn down with the node


@pytest.fixture()
def api(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(node, monkeypatch)


def warm(api: httpx.Client, size: int | None, template: str = "bb") -> dict[str, object]:
    r = api.put(f"/templates/{template}/warm-pool", json={"size": size})
    assert r.status_code == 200, r.text
    return dict(r.json())


def ready(api: httpx.Client, count: int, template: str = "bb") -> dict[str, object]:
    deadline = time.monotonic() + READY
    while True:
        status = api.get(f"/templates/{template}/warm-pool").json()
        if status["ready"] == count or time.monotonic() > deadline:
            return dict(status)
        time.sleep(0.2)


def instances(node: Server, count: int) -> set[str]:
    """The node's runsc containers, once there are ``count`` (dropped members go in the background)."""
    deadline = time.monotonic() + READY
    while len(found := runsc_containers(node)) != count and time.monotonic() < deadline:
        time.sleep(0.3)
    return found


def claims(api: httpx.Client) -> dict[str, float]:
    text = api.get("/metrics").text
    found = re.findall(r'^aenv_warm_pool_creates_total\{outcome="(\w+)"\} ([0-9.e+]+)$', text, re.M)
    return {outcome: float(n) for outcome, n in found}


def test_a_claimed_sandbox_is_a_fresh_one_with_everything_the_create_asked(api: httpx.Client, node: Server) -> None:
    warm(api, 2)
    assert ready(api, 2)["ready"] == 2
    members = instances(node, 2)
    assert len(members) == 2
    before = claims(api)
    body = {
        "templateID": "bb",
        "timeout": 120,
        "envVars": {"FOO": "bar"},
        "metadata": {"run": "7"},
        "secure": True,
        "allow_internet_access": False,
        "autoPause": True,
    }
    started = time.monotonic()
    r = api.post("/sandboxes", json=body)
    took = time.monotonic() - started
    assert r.status_code == 201, r.text
    assert claims(api).get("hit", 0) == before.get("hit", 0) + 1
    assert took < 2.0  # no restore (hundreds of ms); generous for a loaded machine
    info = r.json()
    sid = info["sandboxID"]
    assert runsc_containers(node) <= members  # it is one of the members: nothing new was restored
    got = api.get(f"/sandboxes/{sid}").json()
    assert got["metadata"] == {"run": "7"} and got["allowInternetAccess"] is False
    assert got["lifecycle"]["onTimeout"] == "pause"
    left = time.mktime(time.strptime(got["endAt"][:19], "%Y-%m-%dT%H:%M:%S")) - time.mktime(time.gmtime())
    assert 100 < left <= 121

    sbx = Sandbox.connect(sid)
    out = sbx.commands.run("echo $FOO $E2B_SANDBOX_ID; id -un").stdout.split()
    assert out == ["bar", sid, "user"]
    # Its rules are the create's: no internet (the egress proxy refuses at once, naming the rule).
    ask = "printf 'CONNECT 1.1.1.1:80 HTTP/1.1\\r\\nHost: 1.1.1.1:80\\r\\n\\r\\n' | nc -w 5 127.0.0.1 3128"
    refused = sbx.commands.run(ask + " 2>&1 || true").stdout
    assert refused.startswith("HTTP/1.1 403"), refused
    # Secure: envd wants this sandbox's own token.
    envd = httpx.get(f"{node.url}/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"})
    assert envd.status_code in (200, 204)
    denied = httpx.post(
        f"{node.url}/process.Process/List",
        headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "Content-Type": "application/json"},
        content=b"{}",
    )
    assert denied.status_code == 401, denied.text
    sbx.kill()


def test_members_are_never_listed_counted_or_shown(api: httpx.Client, node: Server) -> None:
    warm(api, 2)
    assert ready(api, 2)["ready"] == 2
    assert api.get("/sandboxes").json() == []
    assert api.get("/v2/sandboxes").json() == []
    metrics = api.get("/metrics").text
    assert 'aenv_sandboxes{state="running"} 0.0' in metrics
    assert 'aenv_warm_pool_members{template="bb"} 2.0' in metrics
    template = api.get("/templates/bb").json()
    assert template["sandboxes"] == 0


def test_a_create_with_other_limits_restores_and_leaves_the_pool_alone(api: httpx.Client, node: Server) -> None:
    warm(api, 1)
    assert ready(api, 1)["ready"] == 1
    members = instances(node, 1)
    before = claims(api)
    r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 60, "limits": {"memoryMB": 512}})
    assert r.status_code == 201, r.text
    assert claims(api).get("miss", 0) == before.get("miss", 0) + 1
    sid = r.json()["sandboxID"]
    assert api.get(f"/sandboxes/{sid}").json()["memoryMB"] == 512
    assert members < runsc_containers(node)  # restored anew; the member still waits
    assert api.delete(f"/sandboxes/{sid}").status_code == 204


def test_a_rebuilt_template_flushes_its_pool_and_claims_give_the_new_build(api: httpx.Client, node: Server) -> None:
    warm(api, 1)
    assert ready(api, 1)["ready"] == 1
    old = instances(node, 1)
    image = bb_layout(node.data_dir / "imports" / "v2", "v2", "two")
    assert api.post("/templates/from-image", json={"name": "bb", "image": image}).status_code == 201
    deadline = time.monotonic() + READY
    while runsc_containers(node) & old and time.monotonic() < deadline:
        time.sleep(0.3)
    assert runsc_containers(node) & old == set()
    assert ready(api, 1)["ready"] == 1
    sbx = Sandbox.create(template="bb", timeout=60)
    assert sbx.commands.run("cat /build").stdout == "two"
    sbx.kill()


def test_sizes_are_checked_and_a_deleted_template_takes_its_members_along(api: httpx.Client, node: Server) -> None:
    for bad in ({"size": -1}, {"size": "2"}, {"size": 1001}, {}, {"size": 1, "x": 2}):
        r = api.put("/templates/bb/warm-pool", json=bad)
        assert r.status_code == 400 and set(r.json()) >= {"code", "message"}, r.text
    r = api.put("/templates/nope/warm-pool", json={"size": 1})
    assert r.status_code == 404 and set(r.json()) >= {"code", "message"}, r.text
    image = bb_layout(node.data_dir / "imports" / "gone", "gone", "gone")
    assert api.post("/templates/from-image", json={"name": "gone", "image": image}).status_code == 201
    warm(api, 0)  # only the template to delete keeps members
    warm(api, 2, "gone")
    assert ready(api, 0)["ready"] == 0
    assert ready(api, 2, "gone")["ready"] == 2
    assert api.delete("/templates/gone").status_code == 204
    assert instances(node, 0) == set()


def test_a_template_whose_members_fail_to_restore_is_retried_ever_more_rarely(api: httpx.Client, node: Server) -> None:
    """A broken build (its checkpoint damaged on disk) would fail a restore every pass, forever:
    the pool waits 2, 4, 8 ... s between tries, says why, and the node serves everyone else."""
    images = node.data_dir / "fs" / "images"
    before = set(images.iterdir())
    image = bb_layout(node.data_dir / "imports" / "broken", "broken", "broken")
    assert api.post("/templates/from-image", json={"name": "broken", "image": image}).status_code == 201
    (made,) = set(images.iterdir()) - before
    (made / "checkpoint.img").write_bytes(b"not a checkpoint")
    try:
        warm(api, 0)
        warm(api, 1, "broken")
        time.sleep(9)  # tries at 0, ~2 and ~6 s (each try's restore takes a moment too); not 9
        status = api.get("/templates/broken/warm-pool").json()
        assert status["ready"] == 0 and 2 <= status["failures"] <= 3, status
        assert status["lastError"] and 0 < status["retryIn"] <= 8, status
        r = api.post("/sandboxes", json={"templateID": "bb", "timeout": 60})
        assert r.status_code == 201, r.text
        assert api.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
    finally:
        warm(api, None, "broken")
        assert api.delete("/templates/broken").status_code == 204


def test_the_cli_shows_and_sets_a_pool(node: Server) -> None:
    env = {"AENV_URL": node.url, "AENV_API_KEY": node.env["AENV_API_KEY"], "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "aenv.cli.main", "warm", "bb"]
    out = subprocess.run([*run, "3", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert '"size": 3' in out.stdout and '"explicit": true' in out.stdout
    out = subprocess.run([*run, "--default", "--json"], capture_output=True, text=True, env=env, timeout=60)
    assert '"size": 0' in out.stdout and '"explicit": false' in out.stdout, out.stdout + out.stderr


# -- the pool's decisions, without a node ------------------------------------------------------------------
def member(name: str, build: Build) -> Member:
    from aenv.node.sandbox import LiveSandbox
    from aenv.node.store import SandboxRecord

    rec = SandboxRecord(id="warm-x", template_id=name, started_at=0, end_at=0)
    return Member(sb=LiveSandbox(rec), build=build, limits=Limits(), held=[])


B1, B2 = Build("t1", "img1", ("l",), "g"), Build("t2", "img2", ("l",), "g")


def decide(pools: dict[str, list[Member]], **kw: object) -> object:
    args: dict[str, object] = {
        "sizes": {"a": 4},
        "demand": {"a": 10},
        "current": {"a": B1},
        "explicit": set(),
        "member_mb": 50,
        "budget_mb": 1000,
        "pressure": False,
        "quiet": True,
    }
    args.update(kw)
    return plan(pools, **args)  # type: ignore[arg-type]


def test_the_default_size_follows_demand_and_an_explicit_one_is_kept() -> None:
    assert decide({}).targets == {"a": 4}  # type: ignore[attr-defined]
    assert decide({}, demand={"a": 2}).targets == {"a": 2}  # type: ignore[attr-defined]
    assert decide({}, demand={}).targets == {"a": 0}  # type: ignore[attr-defined]
    assert decide({}, demand={}, explicit={"a"}).targets == {"a": 4}  # type: ignore[attr-defined]  # as asked
    assert decide({}).refill == "a"  # type: ignore[attr-defined]
    assert decide({}, quiet=False).refill is None  # type: ignore[attr-defined]


def test_stale_extra_over_budget_and_pressured_members_are_dropped() -> None:
    pools = {"a": [member("a", B2), member("a", B1), member("a", B1), member("a", B1)]}
    out = decide(pools, demand={"a": 2})
    assert [m.build for m in out.drop] == [B2, B1]  # type: ignore[attr-defined]
    out = decide(pools, budget_mb=100)  # two members fit
    assert len(out.drop) == 2 and out.refill is None  # type: ignore[attr-defined]
    out = decide(pools, pressure=True)
    assert len(out.drop) == 2 and out.refill is None  # type: ignore[attr-defined]  # the stale one and one more
    out = decide(pools, current={"a": None})  # deleted
    assert len(out.drop) == 4  # type: ignore[attr-defined]


def test_a_template_resting_after_failures_is_not_refilled_and_its_wait_doubles() -> None:
    assert decide({}, resting=frozenset({"a"})).refill is None  # type: ignore[attr-defined]
    sizes, demand, current = {"a": 4, "b": 1}, {"a": 10, "b": 10}, {"a": B1, "b": B2}
    out = decide({}, sizes=sizes, demand=demand, current=current, resting=frozenset({"a"}))
    assert out.refill == "b"  # type: ignore[attr-defined]  # the other template is still served
    waits, failing = [], None
    for _ in range(10):
        failing = Failing.after(failing, B1, "boom")
        waits.append(round(failing.until - time.monotonic()))
    assert waits[:4] == [2, 4, 8, 16] and waits[-1] == RETRY_MAX_SECONDS and failing is not None
    assert failing.failures == 10 and Failing.after(failing, B2, "rebuilt").failures == 1  # a new build: afresh
