"""Teams at a gateway: who a request is, what of the directory it sees, and creates counted
against the team's quotas across every gateway.

Keys are checked here already (the nodes check them again: the gateway forwards the client's key).
Lists answered from the directory show the team's sandboxes only, and a sandbox of another team is
answered as the gateway answers an id it does not know, before anything is forwarded.

A create is admitted by one etcd transaction per team (``/aenv/teams/q/<team>/``): it reads the
team's reservations, counts the team's running sandboxes in the directory plus the creates under
way through any gateway (a reservation names its sandbox once made, and counts until the
directory shows that sandbox, then its entry counts, or shows it gone: a kill frees the slot at
once; the reservation itself expires after DONE_KEEP), checks the
running quota and the creates-per-second window, and writes its own reservation only if no other
gateway wrote one meanwhile (compare-and-swap on the team's counter key; else it reads again).
Stale reservations go in the same transaction. So a burst through several gateways never makes
more than the quota, and each refusal is a 429 with Retry-After, or (``?wait=``) waits for room.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from aenv.cluster.mirror import Mirror
from aenv.cluster.store import TXN, Change, ClusterStore
from aenv.errors import ClusterUnavailable, QuotaExceeded, SandboxNotFound, Unauthenticated
from aenv.teams import guard
from aenv.teams.cluster import KEY_PREFIX, QUOTA_PREFIX, TEAM_PREFIX, ClusterTeams
from aenv.teams.model import DEFAULT_TEAM, PRINCIPAL, Principal
from aenv.teams.quotas import RATE_MESSAGE, rate_window, running_message
from aenv.teams.registry import UNAUTHENTICATED, Teams
from aenv.teams.tenancy import max_create_wait

log = logging.getLogger("aenv.teams")
DONE_KEEP = 15.0  # seconds a made create's reservation still counts (the directory shows it by then)
PENDING_KEEP = 300.0  # a reservation whose gateway never said how its create ended
LEASE_TTL = 30
ATTEMPTS = 8


@dataclass(frozen=True, slots=True)
class Reservation:
    key: str
    at: float  # wall-clock time it was made
    sandbox: str  # the sandbox made ("" while the create is under way)
    done_at: float


class GatewayTeams:
    def __init__(self, store: ClusterStore, mirror: Mirror, admin_key: str | None) -> None:
        self.cluster = ClusterTeams(store)
        self.teams = Teams(self.cluster.store, admin_key, make_default=False)
        self.mirror = mirror
        self.etcd = store
        self.max_wait = max_create_wait()
        self.lease = 0
        self._keeper: asyncio.Task[None] | None = None
        mirror.on_change(self._changed)

    async def start(self) -> None:
        self.cluster.teams = self.teams
        try:
            await self.teams.start()
        except ClusterUnavailable as exc:
            log.warning("teams not read yet (%s): read at the first request", exc.message)

    async def stop(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            self._keeper = None

    def _changed(self, change: Change) -> None:
        if change.key.startswith((KEY_PREFIX, TEAM_PREFIX)):
            self.cluster._apply(change.key, change.value if change.kind == "put" else b"")

    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        if not any(headers.get(name) for name in ("x-api-key", "authorization", "x-admin-token")):
            raise Unauthenticated(UNAUTHENTICATED)  # no key: the API's 401, with no read of etcd
        if not self.teams.started:
            await self.teams.start()
        who = await self.teams.authenticate(headers)
        PRINCIPAL.set(who)
        return who

    # -- what a team sees of the directory ----------------------------------------------------------
    def check_sandbox(self, sandbox_id: str) -> None:
        """Another team's sandbox is answered as the gateway answers an id it does not know."""
        short = sandbox_id.split("-", 1)[0]
        entry = self.mirror.sandboxes.get(short)
        if entry is not None and not guard.visible_team(entry.team):
            raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])

    # -- creates ------------------------------------------------------------------------------------
    @asynccontextmanager
    async def admitted(self, query: Mapping[str, str]) -> AsyncIterator[dict[str, str]]:
        """Reserve room for one create of the request's team (waiting up to ``?wait`` for it);
        the block sets ``made["sandbox"]`` once the create answered with its sandbox."""
        who = PRINCIPAL.get()
        team = who.team if who is not None and not who.all_teams else DEFAULT_TEAM
        quotas = self.teams.quotas(team)
        made: dict[str, str] = {}
        if not quotas.running and not quotas.creates_per_second:
            yield made
            return
        key = await self._reserve(team, _wait_of(query, self.max_wait))
        try:
            yield made
        finally:
            await self._finish(key, made.get("sandbox", ""))

    async def _reserve(self, team: str, wait: float) -> str:
        deadline = time.monotonic() + wait
        while True:
            try:
                return await self._try_reserve(team)
            except QuotaExceeded as exc:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
                await self._next_change(min(left, float(exc.retry_after)))

    async def _next_change(self, most: float) -> None:
        """Until the directory changes (a sandbox gone, a create done: room may open), or ``most``."""
        revision = self.mirror.revision
        await self.mirror.wait_for(lambda m: m.revision != revision, most)

    async def _try_reserve(self, team: str) -> str:
        q = self.teams.quotas(team)
        prefix = f"{QUOTA_PREFIX}{team}/"
        counter = (prefix + "count").encode()
        for _ in range(ATTEMPTS):
            got = await self.etcd.call("read a team's creates", lambda c: c.get_prefix(prefix.encode()), again=True)
            now = time.time()
            seen_revision, reservations, stale = 0, [], []
            for kv in got:
                name = kv.key.decode(errors="replace")
                if name == prefix + "count":
                    seen_revision = int(kv.mod_revision)
                    continue
                r = _reservation(name, bytes(kv.value))
                if r is None or (r.sandbox and now - r.done_at > DONE_KEEP) or now - r.at > PENDING_KEEP:
                    stale.append(name)
                else:
                    reservations.append(r)
            if q.running:
                running = {
                    e.sandbox_id
                    for e in self.mirror.sandboxes.values()
                    if (e.team or DEFAULT_TEAM) == team and e.state != "paused" and e.node_id in self.mirror.nodes
                }
                # a create's sandbox counts until the directory shows it (then its entry counts,
                # while it runs) or shows it gone: a kill frees its slot at once, not 15 s later
                running |= {r.sandbox for r in reservations if r.sandbox and self._not_yet_listed(r.sandbox)}
                if len(running) + sum(1 for r in reservations if not r.sandbox) >= q.running:
                    raise QuotaExceeded(running_message(q.running))
            if q.creates_per_second:
                window, most = rate_window(q)
                recent = sorted(r.at for r in reservations if r.at > now - window)
                if len(recent) >= most:
                    raise QuotaExceeded(RATE_MESSAGE, retry_after=math.ceil(recent[-most] + window - now))
            key = f"{prefix}r/{uuid.uuid4().hex}"
            ok = await self._write(counter, seen_revision, key, now, stale)
            if ok:
                return key
        raise ClusterUnavailable("too many gateways admitted creates of this team at once: try again")

    def _not_yet_listed(self, sandbox_id: str) -> bool:
        short = sandbox_id.split("-", 1)[0]
        return short not in self.mirror.sandboxes and short not in self.mirror.gone

    async def _write(self, counter: bytes, seen: int, key: str, now: float, stale: list[str]) -> bool:
        lease = await self._lease()
        value = json.dumps({"at": now, "sandbox": "", "done_at": 0.0}).encode()

        async def txn(client: Any) -> Any:
            t = TXN
            compare = [t.mod(counter) == seen] if seen else [t.create(counter) == 0]
            success = [t.put(counter, str(now).encode()), t.put(key.encode(), value, lease=lease)]
            success += [t.delete(name.encode()) for name in stale[:32]]
            return await client.transaction(compare=compare, success=success, failure=[])

        ok, _ = await self.etcd.call("admit a create", txn)
        return bool(ok)

    async def _finish(self, key: str, sandbox: str) -> None:
        try:
            if sandbox:
                value = json.dumps({"at": time.time(), "sandbox": sandbox, "done_at": time.time()}).encode()
                lease = await self._lease()
                await self.etcd.call("note a create", lambda c: c.put(key.encode(), value, lease=lease), again=True)
            else:
                await self.etcd.call("drop a reservation", lambda c: c.delete(key.encode()), again=True)
        except ClusterUnavailable as exc:
            log.warning("a create's reservation %s stays until it expires: %s", key, exc.message)

    async def _lease(self) -> int:
        """This gateway's lease for its reservations (a gateway that dies leaves none behind)."""
        if not self.lease:
            self.lease = await self.etcd.grant_lease(LEASE_TTL)
            self._keeper = asyncio.ensure_future(self._keep())
        return self.lease

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(LEASE_TTL / 3)
            try:
                if not await self.etcd.keep_alive(self.lease):
                    self.lease = 0  # expired: a new one for the next reservation
                    return
            except ClusterUnavailable:
                continue


def _reservation(key: str, value: bytes) -> Reservation | None:
    try:
        body = json.loads(value)
        return Reservation(key, float(body["at"]), str(body.get("sandbox", "")), float(body.get("done_at", 0.0)))
    except (ValueError, KeyError, TypeError):
        return None


def _wait_of(query: Mapping[str, str], most: float) -> float:
    raw = query.get("wait")
    try:
        wait = float(raw) if raw is not None else 0.0
    except ValueError:
        return 0.0  # the node answers the 400
    return min(max(wait, 0.0), most) if math.isfinite(wait) else 0.0
