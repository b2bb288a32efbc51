"""A team's named records in a real etcd (aenv/cluster/named.py): one name, one record, however
many nodes make it at once; names are per team; a removed record frees its name."""

from __future__ import annotations

import asyncio

import pytest

from aenv.cluster.named import NamedEntries, NameTaken
from aenv.cluster.store import ClusterStore
from aenv.secrets.store import EtcdSecretStore
from aenv.volumes.model import Volume
from aenv.volumes.store import EtcdVolumeStore


async def test_one_name_one_volume_however_many_make_it_at_once(store: ClusterStore) -> None:
    volumes: NamedEntries[Volume] = EtcdVolumeStore(store)
    tries = [Volume.new("data", "team-a") for _ in range(8)]
    outcomes = await asyncio.gather(*(volumes.add(v) for v in tries), return_exceptions=True)
    assert sum(o is None for o in outcomes) == 1
    assert all(isinstance(o, NameTaken) for o in outcomes if o is not None)
    kept = await volumes.all()
    assert [v.name for v in kept] == ["data"] and kept[0].id in {v.id for v in tries}
    other = Volume.new("data", "team-b")  # the same name in another team
    await volumes.add(other)
    assert await volumes.get(other.id) == other
    await volumes.remove(kept[0])
    again = Volume.new("data", "team-a")
    await volumes.add(again)  # the name is free again
    assert {v.id for v in await volumes.all()} == {other.id, again.id}
    with pytest.raises(NameTaken):
        await volumes.add(Volume.new("data", "team-b"))


async def test_secrets_are_listed_per_team(store: ClusterStore) -> None:
    from aenv.secrets.model import Secret

    secrets = EtcdSecretStore(store)
    mine = Secret(Secret.new_id(), "k", "team-a", 1, "sealed")
    theirs = Secret(Secret.new_id(), "k", "team-b", 1, "sealed")
    await secrets.add(mine)
    await secrets.add(theirs)
    assert [s.id for s in await secrets.all("team-a")] == [mine.id]
    assert {s.id for s in await secrets.all(None)} == {mine.id, theirs.id}
    await secrets.put(mine.changed(version=2))
    assert (await secrets.all("team-a"))[0].version == 2
