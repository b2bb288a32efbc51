"""Volumes under real gVisor: the same SDK-level tests as tests/api/test_volumes.py (which the fast
tier runs on the fake runtime), here with runsc's bind mounts, checkpoints and restores: a pause
and resume mounts the volume again, a fork's child restored from its source's image mounts it,
gVisor resolves a sandbox's links inside the sandbox, and a full volume is ENOSPC inside."""

from __future__ import annotations

import pytest

from tests.api.test_volumes import (  # noqa: F401  (fixtures the tests below take)
    small_volumes_node,
    test_a_full_volume_is_enospc_inside_and_a_507_outside_never_the_hosts_disk,
    test_a_volume_is_shared_live_kept_through_a_pause_and_mounted_by_forks,
    test_links_a_sandbox_leaves_in_a_volume_are_never_followed_by_the_host,
    vol_env,
    volume,
)

pytestmark = [pytest.mark.sandbox, pytest.mark.runsc]
