"""A sandbox's CPU count is its share of a busy host (AENV_CPU_LIMIT=share, the default): two
sandboxes burning every core they can get split the host by their CPU counts, and neither starves;
with AENV_CPU_LIMIT=cap one alone gets no more than its count. Measured from the host, by the CPU
time each sandbox's cgroup was charged (cpuacct), never by a deadline.

Real runsc sandboxes on in-process nodes with the `tiny` template (tests/node/test_failures.py).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.node.spec import SandboxSpec
from aenv.runtime.gvisor import CGROUP_PARENT, CGROUP_ROOT
from tests.node.test_failures import commit_tiny, run_py
from tests.runtime.test_platforms_runsc import needs_runsc

pytestmark = pytest.mark.sandbox
# Burns a core per process it starts, until the sandbox is killed.
HOG = "import os, time\nfor _ in range({n}):\n    if os.fork() == 0:\n        while True: pass\ntime.sleep(3600)"


def charged(node: Node, sandbox_id: str) -> float:
    """CPU seconds the sandbox's cgroup has been charged."""
    sb = node.get(sandbox_id)
    assert sb.instance is not None
    usage = CGROUP_ROOT / "cpuacct" / CGROUP_PARENT / sb.instance.id / "cpuacct.usage"
    return int(usage.read_text()) / 1e9


async def burn(node: Node, sandboxes: list[str], seconds: float = 4.0) -> list[float]:
    """Each sandbox's CPU seconds over ``seconds`` of all of them burning."""
    before = [charged(node, s) for s in sandboxes]
    await asyncio.sleep(seconds)
    return [charged(node, s) - b for s, b in zip(sandboxes, before, strict=True)]


@pytest.fixture()
async def node_with(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Node]:
    needs_runsc()
    # A named platform: the CPU limit is part of what a calibration is kept for, so "auto" with
    # another limit would measure the host again (~40 s here); cgroups work alike on each.
    settings = Settings(data_dir=tmp_path / "node", build_base=False, cpu_limit=request.param, runsc_platform="ptrace")
    node = Node(settings)
    await node.start()
    await commit_tiny(node)
    yield node
    await node.stop(pause_running=False)


@pytest.mark.parametrize("node_with", ["share"], indirect=True)
async def test_busy_sandboxes_split_the_host_by_their_cpu_counts(node_with: Node) -> None:
    node = node_with
    cores = os.cpu_count() or 1
    big = await node.create("tiny", SandboxSpec(timeout=300, limits={"cpu_count": 2.0}))
    small = await node.create("tiny", SandboxSpec(timeout=300, limits={"cpu_count": 1.0}))
    for rec in (big, small):
        await run_py(node, rec.id, HOG.format(n=cores * 2), wait=False)
    await asyncio.sleep(2)  # the hogs started
    got_big, got_small = await burn(node, [big.id, small.id])
    assert got_small > 0.1 * got_big, (got_big, got_small)  # the smaller one is not starved
    assert got_big > 1.2 * got_small, (got_big, got_small)  # weights 2:1 (measured ~2x)


@pytest.mark.parametrize("node_with", ["cap"], indirect=True)
async def test_a_capped_sandbox_alone_gets_no_more_than_its_count(node_with: Node) -> None:
    node = node_with
    cores = os.cpu_count() or 1
    if cores < 2:
        pytest.skip("one core: a 1-core cap cannot be told from the host's own limit")
    rec = await node.create("tiny", SandboxSpec(timeout=300, limits={"cpu_count": 1.0}))
    await run_py(node, rec.id, HOG.format(n=cores * 2), wait=False)
    await asyncio.sleep(2)
    (got,) = await burn(node, [rec.id], seconds=4.0)
    assert got < 4.0 * 1.15, got  # one core's time over 4 s, whatever the host has idle
