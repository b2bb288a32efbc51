"""Create ids in a cluster: a create sent again with its id (a gateway's retry, an SDK's
Idempotency-Key) is made once across every node, by a claim on the id under the node's lease.

This is :class:`aenv.node.create_ids.Claims` on the cluster store; apart from the agent because it
shares nothing with the directory's entries but the lease.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable

from aenv.cluster.entries import CreateClaim
from aenv.cluster.store import ClusterStore
from aenv.errors import ClusterUnavailable, CreateElsewhere
from aenv.node.create_ids import KEEP_SECONDS

WRITES_IN_FLIGHT = 16  # claims one tick releases at most


class CreateClaims:
    """This node's claims: create id -> (its key's create revision, when taken). ``lease`` is the
    node's lease now (a claim lives under it; it changes when the node registers again)."""

    def __init__(self, store: ClusterStore, node_id: str, lease: Callable[[], int]) -> None:
        self.store = store
        self.node_id = node_id
        self._lease = lease
        self.claims: dict[str, tuple[int, float]] = {}

    async def claim(self, create_id: str) -> None:
        result = await self.store.claim_create(
            create_id, CreateClaim(self.node_id, round(time.time(), 3)), self._lease()
        )
        held = result.current
        if held is None:  # gone already (our lease expired in between): nobody holds it, try again
            raise ClusterUnavailable(f"create id {create_id} could not be taken; try again")
        if not result.ok and held.entry.node_id != self.node_id:
            raise CreateElsewhere(f"create id {create_id} is node {held.entry.node_id}'s")
        # ours: just taken, or taken before a restart of this node (that create died with it)
        self.claims[create_id] = (held.create_revision, time.monotonic())

    async def confirm(self, create_id: str) -> None:
        held = await self.store.get_create(create_id)
        mine = self.claims.get(create_id)
        if held is not None and mine is not None and held.create_revision == mine[0]:
            return
        if held is None:  # our lease ran out while cut off, and nobody took the id since: take it again
            self.claims.pop(create_id, None)
            await self.claim(create_id)
            return
        raise CreateElsewhere(f"create id {create_id} went to node {held.entry.node_id} while this node was cut off")

    async def release(self, create_id: str) -> None:
        mine = self.claims.pop(create_id, None)
        if mine is not None:
            with contextlib.suppress(ClusterUnavailable):  # it goes with the lease otherwise
                await self.store.release_create(create_id, mine[0])

    async def release_old(self) -> None:
        """Claims live while a retry may come (KEEP_SECONDS); then they go (few per second)."""
        now = time.monotonic()
        old = [c for c, (_, at) in self.claims.items() if now - at > KEEP_SECONDS][:WRITES_IN_FLIGHT]
        for create_id in old:
            await self.release(create_id)
