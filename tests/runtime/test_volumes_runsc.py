"""Volumes under real gVisor: the same SDK-level tests as tests/api/test_volumes.py (which the fast
tier runs on the fake runtime), here with runsc's bind mounts, checkpoints and restores: a pause
and resume mounts the volume again, a fork's child restored from its source's image mounts it,
gVisor resolves a sandbox's links inside the sandbox, a full volume is ENOSPC inside, and a fork's
children get copies of the volumes taken while the source is stopped for its checkpoint."""

from __future__ import annotations

import pytest
from e2b import Sandbox, Volume

from tests.api.test_volumes import (  # noqa: F401  (fixtures the tests below take)
    small_volumes_node,
    test_a_fork_may_give_each_child_its_own_copy_of_the_volumes,
    test_a_full_volume_is_enospc_inside_and_a_507_outside_never_the_hosts_disk,
    test_a_volume_is_shared_live_kept_through_a_pause_and_mounted_by_forks,
    test_links_a_sandbox_leaves_in_a_volume_are_never_followed_by_the_host,
    vol_env,
    volume,
)
from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.runsc]


def test_a_forks_copy_of_a_volume_is_the_moment_of_its_checkpoint(vol_env: Server, volume: Volume) -> None:  # noqa: F811
    """A process appends 1, 2, 3, ... to a log in the volume and then to one in /tmp, without a
    pause. A child's copy of the volume taken at another moment than its checkpoint would hold
    numbers its restored process then writes again (the copy later) or lack some (earlier); taken
    in the same stop, the child's volume log runs 1..N without a gap or a repeat."""
    src = Sandbox.create(timeout=120, volume_mounts={"/mnt/v": volume})
    children: list[str] = []
    try:
        loop = "i=0; while true; do i=$((i+1)); echo $i >> /mnt/v/log; echo $i >> /tmp/log; done"
        src.commands.run(f"sh -c '{loop}'", background=True)
        src.commands.run("sleep 1")
        with vol_env.client() as api:
            r = api.post(f"/sandboxes/{src.sandbox_id}/fork", json={"count": 2, "volumes": "clone"})
            assert r.status_code == 201, r.text
            children = [item["sandbox"]["sandboxID"] for item in r.json()]
            for child_id in children:
                child = Sandbox.connect(child_id)
                child.commands.run("sleep 0.5; pkill -f '[w]hile true'; true", user="root")
                out = child.commands.run("cat /mnt/v/log | tr '\\n' ' '").stdout.split()
                numbers = [int(n) for n in out if n.isdigit()]
                assert len(numbers) > 10 and numbers == list(range(1, len(numbers) + 1)), numbers[-20:]
    finally:
        src.kill()
        for child_id in children:
            Sandbox.kill(child_id)
        for v in Volume.list():
            if v.name.startswith(f"{volume.name}-"):
                Volume.destroy(v.volume_id)
