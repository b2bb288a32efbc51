"""deploy/prometheus and deploy/grafana name only metrics the code really exports: a real node's
/metrics (the session server) and a gateway's (its metrics over a mirror), parsed; promtool checks
the rules and the scrape config where it is installed (CI installs it)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import yaml

from aenv.cluster.metrics import GatewayMetrics
from tests.conftest import Server

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
RULES = DEPLOY / "prometheus" / "aenv-rules.yml"
METRIC = re.compile(r"\b(aenv_[a-z0-9_]+)\b")


def exported(text: str) -> set[str]:
    """The series names an exposition offers, from its TYPE lines (labeled families without samples yet too)."""
    names: set[str] = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            base = name.removesuffix("_total")  # the TYPE line of a counter names it with or without
            names |= {
                "counter": {f"{base}_total", f"{base}_created"},
                "histogram": {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"},
                "summary": {f"{name}_sum", f"{name}_count", name},
            }.get(kind, {name})
    return names


def gateway_exposition() -> str:
    mirror = SimpleNamespace(nodes={}, sandboxes={}, connected=True, synced_at=time.monotonic())
    metrics = GatewayMetrics(mirror)  # type: ignore[arg-type]
    metrics.observe("create", 201, 0.1)
    return metrics.render().decode()


def expressions() -> list[str]:
    rules = yaml.safe_load(RULES.read_text())
    exprs = [str(r["expr"]) for g in rules["groups"] for r in g["rules"]]
    grafana = json.loads((DEPLOY / "grafana" / "aenv.json").read_text())
    exprs += [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    return exprs


def test_rules_and_dashboard_use_exported_metrics(server: Server) -> None:
    node = httpx.get(f"{server.url}/metrics", timeout=30)
    assert node.status_code == 200
    known = exported(node.text) | exported(gateway_exposition())
    used = {name for expr in expressions() for name in METRIC.findall(expr)}
    assert used, "no metric named"
    assert used <= known, f"not exported by a node or a gateway: {sorted(used - known)}"


def test_the_alerts_the_issue_asks_for() -> None:
    rules = yaml.safe_load(RULES.read_text())
    alerts = {r["alert"]: r["expr"] for g in rules["groups"] for r in g["rules"]}
    assert 'up{job="aenv-node"} == 0' in alerts["AenvNodeDown"]
    assert 'op="create", outcome="error"' in alerts["AenvCreateFailures"]
    assert "aenv_repo_pending" in alerts["AenvRepositoryCommitBacklog"]
    assert "aenv_layer_cache_budget_bytes" in alerts["AenvLayerCacheNearBudget"]
    grafana = json.loads((DEPLOY / "grafana" / "aenv.json").read_text())
    assert grafana["uid"] and all(p["datasource"]["uid"] == "${datasource}" for p in grafana["panels"])


def test_promtool_accepts_the_rules_and_the_config() -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("CI must check the rules: apt-get install prometheus (scripts/install)")
        pytest.skip("needs promtool (Debian's prometheus package)")
    for args in (["check", "rules", str(RULES)], ["check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")]):
        done = subprocess.run([promtool, *args], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
