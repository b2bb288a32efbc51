"""The cluster store: what the cluster keeps in etcd (nodes, sandboxes, tombstones, its configuration,
create ids), read and written through typed operations.

Sandbox entries change only through transactions that compare the key's revision (read, then write
if nobody wrote in between); the loser of a race gets the winner's entry back. The connection,
deadlines and logins under these operations are :mod:`aenv.cluster.etcd`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

import aetcd
import aetcd.exceptions
import aetcd.rtypes

from aenv.cluster.entries import (
    CONFIG_KEY,
    NODES_PREFIX,
    PREFIX,
    SANDBOXES_PREFIX,
    TOMBSTONES_PREFIX,
    ClusterConfig,
    CreateClaim,
    E,
    EntryError,
    NodeEntry,
    SandboxEntry,
    Tombstone,
    Versioned,
    create_key,
    decode,
    encode,
    node_key,
    sandbox_key,
    tombstone_key,
)
from aenv.cluster.etcd import (
    DEFAULT_TIMEOUT,
    Endpoint,
    EtcdConnection,
    EtcdTls,
    EtcdUser,
    WatchCompacted,
    _Client,
    _reason,
    parse_cluster_url,
)
from aenv.config import Settings
from aenv.errors import ClusterUnavailable

__all__ = [
    "CLAIM_ATTEMPTS",
    "DEFAULT_TIMEOUT",
    "TXN",
    "CasResult",
    "Change",
    "ClusterStore",
    "Endpoint",
    "EtcdTls",
    "EtcdUser",
    "Listing",
    "WatchCompacted",
    "parse_cluster_url",
]

log = logging.getLogger("aenv.cluster")

GETS_PER_TRANSACTION = 64  # etcd refuses transactions of more than 128 operations by default
TXN = aetcd.client.Transactions()  # builds compares and operations; bound to no connection
CLAIM_ATTEMPTS = 5  # reads of an entry its owner keeps rewriting, before a claim gives up


@dataclass(frozen=True, slots=True)
class CasResult:
    """A compare-and-swap's outcome: whether it was applied, and the key's entry afterwards (the
    one written, or the one that was there and made it fail; None when there is none)."""

    ok: bool
    current: Versioned | None


@dataclass(frozen=True, slots=True)
class Listing:
    """Everything under /aenv/ at one revision."""

    revision: int
    nodes: dict[str, Versioned]
    sandboxes: dict[str, Versioned]


@dataclass(frozen=True, slots=True)
class Change:
    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    create_revision: int


class ClusterStore(EtcdConnection):
    """The cluster's entries in etcd. Safe to share between tasks of one event loop."""

    # -- nodes ---------------------------------------------------------------------------------------
    async def grant_lease(self, ttl: int) -> int:
        lease = await self._call("grant a lease", lambda c: c.lease(ttl))
        return int(lease.id)

    async def keep_alive(self, lease_id: int) -> bool:
        """Renew a lease once; False when it has already expired."""
        reply = await self._call("renew a lease", lambda c: c.refresh_lease(lease_id), again=True)
        return reply is not None and int(reply.TTL) > 0

    async def revoke_lease(self, lease_id: int) -> None:
        await self._call("revoke a lease", lambda c: c.revoke_lease(lease_id))

    async def put_node(self, entry: NodeEntry, lease_id: int) -> None:
        await self._call(
            "register a node", lambda c: c.put(node_key(entry.node_id), encode(entry), lease=lease_id), again=True
        )

    async def node_ids(self) -> list[str]:
        """The ids of the nodes registered now (their keys only: no entry is read)."""
        got = await self._call(
            "read the nodes", lambda c: c.get_prefix(NODES_PREFIX.encode(), keys_only=True), again=True
        )
        return [kv.key.decode(errors="replace")[len(NODES_PREFIX) :] for kv in got]

    async def nodes(self) -> list[NodeEntry]:
        return [v.entry for v in (await self.read_all()).nodes.values()]

    # -- sandboxes --------------------------------------------------------------------------------------
    async def get_sandbox(self, sandbox_id: str) -> Versioned | None:
        got = await self._call("read a sandbox", lambda c: c.get(sandbox_key(sandbox_id)), again=True)
        return None if got is None else _versioned(SandboxEntry, got)

    async def create_sandbox(self, entry: SandboxEntry) -> CasResult:
        """Write a sandbox's first entry; fails (with the entry there) if the id is taken, or
        (with no entry) if the sandbox was killed while its node was lost (a tombstone)."""
        key = sandbox_key(entry.sandbox_id)
        t = TXN
        compare = [t.create(key) == 0, t.version(tombstone_key(entry.sandbox_id)) == 0]
        return await self._cas("create a sandbox entry", key, compare, t.put(key, encode(entry)))

    async def bury_sandbox(self, current: Versioned, keep_seconds: int) -> bool:
        """Kill a sandbox whose node is lost: its entry goes and a tombstone (kept ``keep_seconds``)
        takes its place, in one transaction, if the entry is still ``current`` and its node still
        has no entry. False if either changed (it was taken over, or its node came back)."""
        entry: SandboxEntry = current.entry
        key = sandbox_key(entry.sandbox_id)
        t = TXN
        lease = await self.grant_lease(keep_seconds)
        stone = Tombstone(entry.node_id, entry.epoch, round(time.time(), 3))
        compare = [t.mod(key) == current.mod_revision, t.version(node_key(entry.node_id)) == 0]
        success = [t.delete(key), t.put(tombstone_key(entry.sandbox_id), encode(stone), lease=lease)]
        ok = False
        try:
            ok, _ = await self._call("bury a sandbox", _transaction(compare=compare, success=success))
        finally:
            if not ok:  # no tombstone holds it: a lease of 30 days would outlive nothing
                with contextlib.suppress(ClusterUnavailable):
                    await self.revoke_lease(lease)
        return bool(ok)

    async def tombstones(self, sandbox_ids: list[str]) -> dict[str, Tombstone]:
        """The tombstones of these sandboxes (those killed while their node was lost)."""
        return {s: v.entry for s, v in (await self._get_many(sandbox_ids, tombstone_key, Tombstone)).items()}

    async def all_tombstones(self) -> dict[str, Tombstone]:
        """Every tombstone: the sandboxes killed while their node was lost (kept 30 days)."""
        got = await self._call("read the tombstones", lambda c: c.get_prefix(TOMBSTONES_PREFIX.encode()), again=True)
        found: dict[str, Tombstone] = {}
        for kv in got:
            try:
                found[kv.key.decode(errors="replace")[len(TOMBSTONES_PREFIX) :]] = decode(Tombstone, kv.value)
            except EntryError as exc:
                log.warning("skipping a tombstone: %s", exc)
        return found

    async def drop_tombstone(self, sandbox_id: str) -> None:
        await self._call("drop a tombstone", lambda c: c.delete(tombstone_key(sandbox_id)))

    async def replace_sandbox(self, entry: SandboxEntry, mod_revision: int) -> CasResult:
        """Rewrite an entry if nobody changed it since it was read at ``mod_revision``."""
        key = sandbox_key(entry.sandbox_id)
        t = TXN
        return await self._cas("update a sandbox entry", key, [t.mod(key) == mod_revision], t.put(key, encode(entry)))

    async def delete_sandbox(self, sandbox_id: str, mod_revision: int) -> CasResult:
        key = sandbox_key(sandbox_id)
        t = TXN
        return await self._cas("delete a sandbox entry", key, [t.mod(key) == mod_revision], t.delete(key))

    async def claim_sandbox(
        self,
        sandbox_id: str,
        node_id: str,
        *,
        epoch: int,
        from_lost: str | None = None,
        durable_only: bool = False,
    ) -> CasResult:
        """Move a sandbox to ``node_id`` if its entry is still at ``epoch`` (and, with ``from_lost``,
        that node has no entry: its lease is gone; with ``durable_only``, the entry as it is now
        still says durably paused: its owner may have resumed it since it was read). Of two
        claimants of the same epoch exactly one wins, the other gets the winner's entry.

        The owner rewrites its entry at the same epoch whenever what a list shows of the sandbox
        changes; such a rewrite between the read and the transaction is not a lost race, so the
        claim reads again and retries (a few times: an owner writes at most once a tick)."""
        for _ in range(CLAIM_ATTEMPTS):
            current = await self.get_sandbox(sandbox_id)
            if current is None or current.entry.epoch != epoch:
                return CasResult(False, current)
            if durable_only and not (current.entry.durable and current.entry.state == "paused"):
                return CasResult(False, current)
            moved = replace(current.entry, node_id=node_id, epoch=epoch + 1)
            key = sandbox_key(sandbox_id)
            t = TXN
            compare = [t.mod(key) == current.mod_revision]
            if from_lost is not None:
                compare.append(t.version(node_key(from_lost)) == 0)
            result = await self._cas("claim a sandbox", key, compare, t.put(key, encode(moved)))
            if result.ok or result.current is None or result.current.mod_revision == current.mod_revision:
                return result  # won; gone; or the entry is as read (the lost node is back)
        return result

    async def get_sandboxes(self, sandbox_ids: list[str]) -> dict[str, Versioned]:
        """The entries of these sandboxes (those that have one), read in transactions of 64."""
        return await self._get_many(sandbox_ids, sandbox_key, SandboxEntry)

    async def _get_many(
        self, sandbox_ids: list[str], key_of: Callable[[str], bytes], cls: type[E]
    ) -> dict[str, Versioned]:
        t = TXN
        found: dict[str, Versioned] = {}
        for i in range(0, len(sandbox_ids), GETS_PER_TRANSACTION):
            chunk = sandbox_ids[i : i + GETS_PER_TRANSACTION]
            gets = [t.get(key_of(s)) for s in chunk]
            _, responses = await self._call("read sandbox entries", _transaction(compare=[], success=gets), again=True)
            for sandbox_id, response in zip(chunk, responses, strict=True):
                for _, kv in response:
                    try:
                        found[sandbox_id] = _versioned(cls, kv)
                    except EntryError as exc:
                        log.warning("skipping the entry of sandbox %s: %s", sandbox_id, exc)
        return found

    # -- the cluster's configuration and create ids ------------------------------------------------------
    async def ensure_config(self, proposed: ClusterConfig) -> ClusterConfig:
        """The cluster's configuration: ``proposed`` if there was none (the first node to join
        writes it), else the one there. One transaction: of two first nodes exactly one wins."""
        t = TXN
        result = await self._cas(
            "write the cluster configuration",
            CONFIG_KEY,
            [t.create(CONFIG_KEY) == 0],
            t.put(CONFIG_KEY, encode(proposed)),
            ClusterConfig,
        )
        assert result.current is not None  # just written, or there before
        return result.current.entry  # type: ignore[no-any-return]

    async def get_config(self) -> ClusterConfig | None:
        got = await self._call("read the cluster configuration", lambda c: c.get(CONFIG_KEY), again=True)
        return None if got is None else decode(ClusterConfig, got.value)

    async def claim_create(self, create_id: str, claim: CreateClaim, lease_id: int) -> CasResult:
        """Take a create id for a node (under its lease) if nobody holds it; the loser gets the
        holder's claim back."""
        key = create_key(create_id)
        t = TXN
        return await self._cas(
            "claim a create id", key, [t.create(key) == 0], t.put(key, encode(claim), lease=lease_id), CreateClaim
        )

    async def get_create(self, create_id: str) -> Versioned | None:
        got = await self._call("read a create id", lambda c: c.get(create_key(create_id)), again=True)
        return None if got is None else _versioned(CreateClaim, got)

    async def release_create(self, create_id: str, create_revision: int) -> None:
        """Drop a create id's claim if it is still the one made at ``create_revision``."""
        key = create_key(create_id)
        t = TXN
        await self._cas("release a create id", key, [t.create(key) == create_revision], t.delete(key), CreateClaim)

    async def _cas(
        self,
        what: str,
        key: bytes,
        compare: list[Any],
        success: Any,
        cls: type[E] = SandboxEntry,  # type: ignore[assignment]
    ) -> CasResult:
        t = TXN
        ok, responses = await self._call(
            what, _transaction(compare=compare, success=[success, t.get(key)], failure=[t.get(key)])
        )
        found = responses[-1] if responses else []
        if not found:
            return CasResult(ok, None)
        _, kv = found[0]
        return CasResult(ok, _versioned(cls, kv))

    # -- everything, and changes -------------------------------------------------------------------------
    async def read_all(self) -> Listing:
        """One consistent read of every node and sandbox entry (entries that do not decode are
        logged and left out)."""
        got = await self._call("read the directory", lambda c: c.get_prefix(PREFIX.encode()), again=True)
        nodes: dict[str, Versioned] = {}
        sandboxes: dict[str, Versioned] = {}
        for kv in got:
            key = kv.key.decode(errors="replace")
            try:
                if key.startswith(NODES_PREFIX):
                    nodes[key[len(NODES_PREFIX) :]] = _versioned(NodeEntry, kv)
                elif key.startswith(SANDBOXES_PREFIX):
                    sandboxes[key[len(SANDBOXES_PREFIX) :]] = _versioned(SandboxEntry, kv)
            except EntryError as exc:
                log.warning("skipping cluster entry %s: %s", key[:200], exc)
        return Listing(int(got.header.revision), nodes, sandboxes)

    async def watch(self, start_revision: int) -> AsyncIterator[Change]:
        """Every change under /aenv/ from ``start_revision`` on, until the stream fails
        (``ClusterUnavailable``) or that history is compacted (``WatchCompacted``)."""
        watch = await self._call(
            "watch the directory", lambda c: c.watch_prefix(PREFIX.encode(), start_revision=start_revision)
        )
        try:
            async for event in _translated(watch):
                kind: Literal["put", "delete"] = "put" if event.kind == aetcd.rtypes.EventKind.PUT else "delete"
                kv = event.kv
                yield Change(kind, kv.key.decode(errors="replace"), kv.value, kv.mod_revision, kv.create_revision)
        finally:
            try:
                await asyncio.wait_for(watch.cancel(), self.timeout)
            except (TimeoutError, aetcd.exceptions.ClientError):
                pass


async def _translated(watch: Any) -> AsyncIterator[Any]:
    try:
        async for event in watch:
            yield event
    except aetcd.exceptions.RevisionCompactedError as exc:
        raise WatchCompacted(f"cluster store watch: {exc}") from None
    except aetcd.exceptions.ClientError as exc:
        raise ClusterUnavailable(f"the cluster store watch ended: {_reason(exc)}") from None


def _transaction(
    *, compare: list[Any], success: list[Any], failure: list[Any] | None = None
) -> Callable[[_Client], Awaitable[Any]]:
    """A transaction to make on whichever client ``_call`` hands it (made again after a login)."""
    return lambda client: client.transaction(compare=compare, success=success, failure=failure or [])


def _versioned(cls: type[E], kv: Any) -> Versioned:
    return Versioned(decode(cls, kv.value), int(kv.mod_revision), int(kv.create_revision))


def cluster_store(settings: Settings) -> ClusterStore:
    """The store for a node's cluster settings (URL, TLS files, etcd user), checked; not connected."""
    assert settings.cluster
    tls = EtcdTls(settings.cluster_ca, settings.cluster_cert, settings.cluster_key)
    user = EtcdUser.load(settings.cluster_user, settings.cluster_password_file, settings.cluster_password)
    return ClusterStore.from_url(settings.cluster, tls=tls, user=user)
