"""A cluster's events and webhooks, in etcd, shared by every node (a gateway forwards /events/ to
any node), and the one dispatcher of the cluster.

Keys (values JSON):
    /aenv/events/e/<team>/<event id>     an event; its position is the key's create revision
    /aenv/events/w/<webhook id>          a webhook (with its secret: etcd's users and TLS guard it)
    /aenv/events/d/<webhook id>          where that webhook's deliveries stand (a position)
    /aenv/events/leader                  the node that delivers, under its lease

Positions are etcd revisions, so a dispatcher that has delivered up to one has seen every event
committed before it, whichever node wrote it. The leader writes a delivery's position only while
it still holds the leader key (one transaction): a node that lost it mid-delivery (paused, cut
off) cannot move a position its successor already moved on from. A receiver may be told an event
twice across such a change (the same event ``id``), never an event not at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Collection
from typing import Any

import aetcd
import aetcd.exceptions
import aetcd.rpc
import grpc

from aenv.cluster.entries import PREFIX
from aenv.cluster.store import TXN, ClusterStore
from aenv.errors import ClusterUnavailable
from aenv.events.model import LifecycleEvent, Webhook

log = logging.getLogger("aenv.events")
EVENTS = PREFIX + "events/"
EVENT_PREFIX = EVENTS + "e/"
WEBHOOK_PREFIX = EVENTS + "w/"
DELIVERED_PREFIX = EVENTS + "d/"
LEADER_KEY = EVENTS + "leader"
CHUNK = 500
LEADER_TTL = 10
MAX_VALUE = 64 * 1024


def _end(prefix: bytes) -> bytes:
    return prefix[:-1] + bytes([prefix[-1] + 1])


class EtcdEventStore:
    def __init__(self, store: ClusterStore, node_id: str) -> None:
        self.etcd = store
        self.node_id = node_id
        # While this node delivers: the create revision of the leader key it made (a key made
        # again by a successor has another), which every position it writes is fenced with.
        self.fence: int | None = None

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        await self.etcd.close()

    async def _range(
        self,
        prefix: str,
        *,
        ascending: bool = True,
        limit: int = CHUNK,
        min_create: int = 0,
        max_create: int = 0,
    ) -> tuple[list[Any], int]:
        """Keys under ``prefix`` by create revision, a chunk at a time; and the store's revision."""

        rpc = aetcd.rpc.RangeRequest
        request = rpc(
            key=prefix.encode(),
            range_end=_end(prefix.encode()),
            sort_order=rpc.ASCEND if ascending else rpc.DESCEND,
            sort_target=rpc.CREATE,
            limit=limit,
            min_create_revision=min_create,
            max_create_revision=max_create,
        )
        timeout = self.etcd.timeout

        async def call(client: Any) -> Any:
            try:
                return await client.kvstub.Range(request, timeout=timeout, metadata=client.metadata)
            except grpc.aio.AioRpcError as exc:  # in aetcd's terms, as its own calls fail
                aetcd.exceptions._handle_exception(exc)

        got = await self.etcd.call("read events", call, again=True)
        return list(got.kvs), int(got.header.revision)

    async def _transaction(self, what: str, compare: list[Any], success: list[Any]) -> bool:
        ok, _ = await self.etcd.call(
            what, lambda c: c.transaction(compare=compare, success=success, failure=[]), again=True
        )
        return bool(ok)

    async def append(self, events: list[LifecycleEvent]) -> None:
        puts = [
            TXN.put(f"{EVENT_PREFIX}{e.team}/{e.id}".encode(), json.dumps(e.to_json(), separators=(",", ":")).encode())
            for e in events
        ]
        # etcd takes up to 128 operations a transaction by default: one revision per chunk
        for start in range(0, len(puts), 100):
            await self._transaction("write events", [], puts[start : start + 100])

    async def query(
        self,
        team: str | None,
        *,
        sandbox_id: str | None,
        types: Collection[str],
        offset: int,
        limit: int,
        ascending: bool,
    ) -> list[LifecycleEvent]:
        prefix = EVENT_PREFIX + (f"{team}/" if team is not None else "")
        found: list[LifecycleEvent] = []
        skip = offset
        bound = 0
        while len(found) < limit:
            kvs, _ = await self._range(
                prefix,
                ascending=ascending,
                min_create=bound + 1 if ascending and bound else 0,
                max_create=bound - 1 if not ascending and bound else 0,
            )
            for kv in kvs:
                event = _event(kv.value)
                if event is None or (sandbox_id is not None and event.sandbox_id != sandbox_id):
                    continue
                if types and event.type not in types:
                    continue
                if skip:
                    skip -= 1
                    continue
                found.append(event)
                if len(found) == limit:
                    break
            if len(kvs) < CHUNK:
                break
            bound = int(kvs[-1].create_revision)
        return found

    async def after(self, position: int, limit: int) -> list[tuple[int, LifecycleEvent | None]]:
        kvs, _ = await self._range(EVENT_PREFIX, min_create=position + 1, limit=limit)
        return [(int(kv.create_revision), _event(kv.value)) for kv in kvs]

    async def last_position(self) -> int:
        _, revision = await self._range(EVENT_PREFIX, limit=1)
        return revision

    async def prune(self, before: float) -> int:
        gone = 0
        while True:
            kvs, _ = await self._range(EVENT_PREFIX, limit=CHUNK)
            old = [kv for kv in kvs if _older(kv.value, before)]
            deletes = [TXN.delete(bytes(kv.key)) for kv in old]
            for start in range(0, len(deletes), 100):
                await self._transaction("remove old events", [], deletes[start : start + 100])
            gone += len(old)
            if len(old) < len(kvs) or len(kvs) < CHUNK:
                return gone

    async def webhooks(self) -> list[Webhook]:
        kvs, _ = await self._range(WEBHOOK_PREFIX, limit=0)
        hooks = []
        for kv in kvs:
            try:
                hooks.append(Webhook.from_json(_json(kv.value)))
            except (ValueError, KeyError, TypeError) as exc:
                log.warning("skipping webhook entry %s: %s", bytes(kv.key)[:120], exc)
        return hooks

    async def put_webhook(self, hook: Webhook) -> None:
        data = json.dumps(hook.to_json(), separators=(",", ":")).encode()
        await self.etcd.call("write a webhook", lambda c: c.put((WEBHOOK_PREFIX + hook.id).encode(), data), again=True)

    async def delete_webhook(self, webhook_id: str) -> None:
        ops = [TXN.delete((WEBHOOK_PREFIX + webhook_id).encode()), TXN.delete((DELIVERED_PREFIX + webhook_id).encode())]
        await self._transaction("delete a webhook", [], ops)

    async def delivered(self, webhook_id: str) -> int | None:
        got = await self.etcd.call(
            "read a delivery position", lambda c: c.get((DELIVERED_PREFIX + webhook_id).encode()), again=True
        )
        if got is None:
            return None
        try:
            return int(bytes(got.value))
        except ValueError:
            return None

    async def set_delivered(self, webhook_id: str, position: int) -> None:
        key, value = (DELIVERED_PREFIX + webhook_id).encode(), str(position).encode()
        if self.fence is None:  # not the dispatcher: a webhook's start, before any delivery
            await self.etcd.call("write a delivery position", lambda c: c.put(key, value), again=True)
            return
        compare = [TXN.create(LEADER_KEY.encode()) == self.fence]
        if not await self._transaction("write a delivery position", compare, [TXN.put(key, value)]):
            raise LostLeadership("another node delivers now")


class LostLeadership(ClusterUnavailable):
    """This node no longer holds the deliverer's key: another delivers from the last position."""


class Leadership:
    """Hold the leader key with a lease while ``lead`` runs; give way when the lease is lost."""

    def __init__(self, store: EtcdEventStore, lead: Callable[[], Any], follow: Callable[[], Any]) -> None:
        self.store = store
        self.lead, self.follow = lead, follow  # start and stop delivering (sync starters, async stoppers)
        self._task: asyncio.Task[None] | None = None
        self._lease: int | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="events leadership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.store.fence = None
        if self._lease is not None:
            with contextlib.suppress(Exception):
                await self.store.etcd.revoke_lease(self._lease)  # the next node need not wait out the TTL
            self._lease = None

    async def _run(self) -> None:
        etcd = self.store.etcd
        key = LEADER_KEY.encode()
        while True:
            try:
                lease = await etcd.grant_lease(LEADER_TTL)
                claim = [TXN.put(key, self.store.node_id.encode(), lease=lease)]
                ok = await self.store._transaction("claim the event dispatcher", [TXN.version(key) == 0], claim)
                if not ok:
                    await etcd.revoke_lease(lease)
                    await asyncio.sleep(LEADER_TTL / 3)
                    continue
                self._lease = lease
                got = await etcd.call("read the event dispatcher's key", lambda c: c.get(key), again=True)
                if got is None:
                    continue  # expired at once: claim again
                self.store.fence = int(got.create_revision)
                log.info("this node delivers the cluster's webhooks")
                self.lead()
                try:
                    await self._keep(lease)
                finally:
                    self.store.fence = None
                    await self.follow()
                log.warning("lost the event dispatcher's lease: another node delivers")
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("event dispatcher election: %s", exc)
                await asyncio.sleep(LEADER_TTL / 3)

    async def _keep(self, lease: int) -> None:
        """Renew the lease until it cannot be."""
        while True:
            if not await self.store.etcd.keep_alive(lease):
                return
            await asyncio.sleep(LEADER_TTL / 3)


def _json(value: bytes) -> dict[str, Any]:
    if len(value) > MAX_VALUE:
        raise ValueError(f"value of {len(value)} bytes")
    body = json.loads(value)
    if not isinstance(body, dict):
        raise ValueError("not an object")
    return body


def _older(value: bytes, before: float) -> bool:
    event = _event(value)
    return event is None or event.timestamp < before


def _event(value: bytes) -> LifecycleEvent | None:
    try:
        return LifecycleEvent.from_json(_json(value))
    except (ValueError, KeyError, TypeError):
        return None
