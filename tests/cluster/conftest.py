"""Cluster fixtures: a real 3-member etcd cluster per test (fresh, so killing members is free)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from aenv.cluster.store import ClusterStore
from tests.cluster.etcd import EtcdCluster


@pytest.fixture()
def etcd() -> Iterator[EtcdCluster]:
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
