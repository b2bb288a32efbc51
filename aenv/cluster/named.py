"""A team's named records in etcd (volumes, secrets): each under ``<prefix>v/<id>``, its name
claimed once per team under ``<prefix>n/<team>/<name>`` in the same transaction, so two nodes
making the same name at once make one record and a 409."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from aenv.cluster.store import TXN, ClusterStore
from aenv.errors import Conflict


class NameTaken(Conflict):
    """The team has one of that name already."""


class Named(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def team(self) -> str: ...

    @property
    def name(self) -> str: ...

    def to_json(self) -> dict[str, Any]: ...


R = TypeVar("R", bound=Named)


class NamedEntries(Generic[R]):
    def __init__(self, store: ClusterStore, prefix: str, what: str, decode: Callable[[dict[str, Any]], R]) -> None:
        self.etcd = store
        self.by_id, self.by_name = prefix + "v/", prefix + "n/"
        self.what, self.decode = what, decode

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.etcd.close()

    def _name_key(self, record: R) -> bytes:
        return f"{self.by_name}{record.team}/{record.name}".encode()

    def _value(self, record: R) -> bytes:
        return json.dumps(record.to_json(), separators=(",", ":")).encode()

    async def _txn(self, what: str, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.etcd.call(what, lambda c: c.transaction(compare=compare, success=success, failure=[]))
        return bool(ok)

    async def add(self, record: R) -> None:
        name_key = self._name_key(record)
        puts = [TXN.put(name_key, record.id.encode()), TXN.put((self.by_id + record.id).encode(), self._value(record))]
        if not await self._txn(f"make a {self.what}", [TXN.version(name_key) == 0], puts):
            raise NameTaken(f"a {self.what} named {record.name!r} already exists")

    async def put(self, record: R) -> None:
        key, value = (self.by_id + record.id).encode(), self._value(record)
        await self.etcd.call(f"write a {self.what}", lambda c: c.put(key, value), again=True)

    async def all(self) -> list[R]:
        got = await self.etcd.call(f"read {self.what}s", lambda c: c.get_prefix(self.by_id.encode()), again=True)
        found = []
        for kv in got:
            try:
                found.append(self.decode(json.loads(bytes(kv.value))))
            except (ValueError, KeyError, TypeError):
                continue  # an entry that does not decode is none of ours
        return found

    async def get(self, record_id: str) -> R | None:
        key = (self.by_id + record_id).encode()
        got = await self.etcd.call(f"read a {self.what}", lambda c: c.get(key), again=True)
        if got is None:
            return None
        try:
            return self.decode(json.loads(bytes(got.value)))
        except (ValueError, KeyError, TypeError):
            return None

    async def remove(self, record: R) -> None:
        deletes = [TXN.delete((self.by_id + record.id).encode()), TXN.delete(self._name_key(record))]
        await self._txn(f"delete a {self.what}", [], deletes)
