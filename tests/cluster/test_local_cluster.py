"""`./scripts/cluster up|status|down`: a real cluster on loopback (3 etcd members, 2 nodes, 1 gateway),
driven by the real E2B SDK through the variables `up` prints, and nothing of it left after `down`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox

from aenv.cluster.local import ClusterError, Layout, alive, check_ports, loops_under, mounts_under
from tests.cluster.conftest import require_etcd
from tests.conftest import DATA_DIR, Server

pytestmark = pytest.mark.sandbox
ROOT = Path(__file__).resolve().parents[2]
NODES, GATEWAYS = 2, 1


def run(*args: str, env: dict[str, str], timeout: float = 900) -> subprocess.CompletedProcess[str]:
    # `up` through the module: scripts/cluster would first reinstall the package (scripts/install).
    argv = (
        [sys.executable, "-m", "aenv.cluster.local", *args]
        if args[0] == "up"
        else [str(ROOT / "scripts/cluster"), *args]
    )
    return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def free_base_port() -> int:
    for _ in range(50):
        base = random.randrange(20000, 60000, 10)
        try:
            check_ports(Layout(Path("/nonexistent"), base), NODES, GATEWAYS)
        except ClusterError:
            continue
        return base
    raise RuntimeError("no free range of ports")


def exports(stdout: str) -> dict[str, str]:
    pairs = [line.removeprefix("export ").split("=", 1) for line in stdout.splitlines() if line.startswith("export ")]
    return dict(pairs)


@pytest.fixture()
def cluster_env(server: Server) -> Iterator[dict[str, str]]:
    require_etcd()
    root = DATA_DIR.parent / f"{DATA_DIR.name}-local-cluster"
    env = {
        **os.environ,
        "AENV_CLUSTER_DIR": str(root),
        "AENV_SPARE_UPPERS": "1",  # two cores shared by every node of the test
        "AENV_REPO_GC_INTERVAL": "0",  # the repository is the session server's too
    }
    env.pop("AENV_API_KEY", None)  # the cluster makes its own
    run("down", env=env)  # a previous run's leftovers
    # The node dirs are kept between local runs (the fetched `base` layers stay); the repository
    # is the session server's, where `base` is committed, so no node builds it.
    root.mkdir(exist_ok=True)
    (root / "repo").unlink(missing_ok=True)
    (root / "repo").symlink_to(DATA_DIR / "repo")
    (root / "api-key").unlink(missing_ok=True)
    try:
        yield env
    finally:
        run("down", env=env)


def nothing_left(root: Path, state: dict[str, object]) -> None:
    every = [*state["nodes"], *state["etcd"], *state["gatewayProcesses"]]  # type: ignore[misc]
    assert not [e for e in every if Path(f"/proc/{e['pid']}").exists() and alive(e["pid"], "")]
    ours = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(root).encode() in (proc / "cmdline").read_bytes():
                ours.append(proc.name)
        except OSError:
            continue
    assert ours == [], "processes of the cluster outlived `down`"
    assert mounts_under(root) == []
    assert loops_under(root) == []
    for node in state["nodes"]:  # type: ignore[attr-defined]
        runsc_root = Path(node["dataDir"]) / "runtime" / "runsc"
        assert not list(runsc_root.iterdir()), "runsc containers outlived `down`"
    for member in state["etcd"]:  # type: ignore[attr-defined]
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{member['url']}/health", timeout=2)
    assert not (root / "cluster.json").exists()


def test_up_e2b_down_leaves_nothing(cluster_env: dict[str, str]) -> None:
    env = cluster_env
    root = Path(env["AENV_CLUSTER_DIR"])
    base = free_base_port()
    started = time.monotonic()
    up = run("up", "--nodes", str(NODES), "--gateways", str(GATEWAYS), "--base-port", str(base), env=env)
    assert up.returncode == 0, up.stderr
    print(f"up in {time.monotonic() - started:.1f}s")
    variables = exports(up.stdout)
    state = json.loads((root / "cluster.json").read_text())

    # cluster.json: what runs, where
    assert state["apiKey"] == variables["E2B_API_KEY"] == (root / "api-key").read_text().strip()
    assert state["gateways"] == [f"http://127.0.0.1:{base}"] == [variables["E2B_API_URL"]]
    assert variables["E2B_SANDBOX_URL"] == variables["E2B_API_URL"]
    assert [n["nodeID"] for n in state["nodes"]] == ["n0", "n1"]
    assert len({n["dataDir"] for n in state["nodes"]}) == NODES
    for node in state["nodes"]:
        assert alive(node["pid"], node["dataDir"])
        assert Path(node["dataDir"]).parent == root / "nodes"
        assert httpx.get(f"{node['url']}/health", timeout=5).json()["status"] == "ok"
    assert len(state["etcd"]) == 3
    for member in state["etcd"]:
        assert alive(member["pid"], "etcd")
        assert httpx.get(f"{member['url']}/health", timeout=5).json()["health"] == "true"
    listed = httpx.get(f"{state['gateways'][0]}/nodes", headers={"X-API-Key": state["apiKey"]}, timeout=5).json()
    assert sorted(n["node_id"] for n in listed) == ["n0", "n1"]
    assert (root / "logs" / "node-n0.log").stat().st_size > 0

    # the real E2B SDK through the printed variables only
    sdk_env = {k: variables[k] for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")}
    saved = {k: os.environ.get(k) for k in sdk_env}
    os.environ.update(sdk_env)
    try:
        sbx = Sandbox.create(timeout=300)
        assert sbx.commands.run("echo through the cluster").stdout == "through the cluster\n"
        assert sbx.sandbox_id in [s.sandbox_id for s in Sandbox.list().next_items()]
        # one more straight on n1, which is then killed -9: its sandbox is down's to clean up
        os.environ["E2B_API_URL"] = os.environ["E2B_SANDBOX_URL"] = state["nodes"][1]["url"]
        orphan = Sandbox.create(timeout=300)
        assert orphan.commands.run("true").exit_code == 0
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    # idempotent, and clear when it cannot be
    again = run("up", "--nodes", str(NODES), "--gateways", str(GATEWAYS), "--base-port", str(base), env=env)
    assert again.returncode == 0 and exports(again.stdout) == variables, again.stderr
    other_shape = run("up", "--nodes", "3", "--base-port", str(base), env=env)
    assert other_shape.returncode == 1 and "already up" in other_shape.stderr
    elsewhere = {**env, "AENV_CLUSTER_DIR": str(root) + "-second"}
    taken = run("up", "--nodes", "1", "--gateways", "1", "--base-port", str(base), env=elsewhere)
    assert taken.returncode == 1 and f"{base} (gateway g0)" in taken.stderr, taken.stderr
    shutil.rmtree(elsewhere["AENV_CLUSTER_DIR"], ignore_errors=True)
    status = run("status", env=env)
    assert status.returncode == 0 and all(n["alive"] for n in json.loads(status.stdout)["nodes"])
    assert "apiKey" not in json.loads(status.stdout)

    os.kill(state["nodes"][1]["pid"], signal.SIGKILL)
    time.sleep(0.5)
    assert run("status", env=env).returncode == 1  # one process is gone
    down = run("down", env=env)
    assert down.returncode == 0, down.stderr
    nothing_left(root, state)
    assert run("status", env=env).returncode == 3
    assert run("down", env=env).returncode == 0  # again: nothing to do
