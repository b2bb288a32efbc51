"""Cluster fixtures: a real 3-member etcd cluster per test (fresh, so killing members is free)."""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator, Iterator

import pytest

from aenv.cluster.store import ClusterStore
from tests.cluster.etcd import EtcdCluster


def require_etcd() -> None:
    if shutil.which("etcd") is None:
        if os.environ.get("CI"):
            pytest.fail("CI must run the cluster tests: etcd is missing (scripts/install installs etcd-server)")
        pytest.skip("needs etcd (Debian: apt-get install etcd-server; scripts/install does it)")


@pytest.fixture()
def etcd() -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(3)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture()
async def store(etcd: EtcdCluster) -> AsyncIterator[ClusterStore]:
    s = ClusterStore.from_url(etcd.url)
    yield s
    await s.close()
