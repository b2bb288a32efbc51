"""The teams and key digests in memory, in front of their store, and who a request's key is.

On a node alone the memory is the truth (one writer). In a cluster other gateways and nodes
change the store too: a key this process has not seen is read from the store at once (a key made
through one gateway works on every other at once), a watch drops deleted keys as they go, and a
key held in memory is read again once it is ``KEY_RECHECK`` seconds old (a deleted key stops
working everywhere within that, even if a watch event is lost). When the store cannot be read, a
key confirmed within ``KEY_GRACE`` seconds keeps working; past that its requests get 503.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Mapping

from aenv.errors import ClusterUnavailable, Conflict, InvalidRequest, NotFound, Unauthenticated
from aenv.teams.model import (
    ADMIN_KEY_ID,
    ALL_TEAMS,
    DEFAULT_TEAM,
    MAX_KEYS_PER_TEAM,
    MAX_TEAMS,
    TEAM_ID,
    ApiKey,
    Principal,
    Quotas,
    Team,
    digest,
    masked,
    new_key,
    same_digest,
)
from aenv.teams.store import TeamStore

log = logging.getLogger("aenv.teams")
KEY_RECHECK = 5.0
KEY_GRACE = 60.0
MISS_MEMORY = 1.0  # seconds an unknown digest is remembered as unknown (a flood of bad keys: one read each)
MAX_MISSES = 4096
UNAUTHENTICATED = "invalid or missing API key (X-API-Key header)"


class Teams:
    def __init__(self, store: TeamStore, admin_key: str | None, *, make_default: bool = True) -> None:
        self.store = store
        self.admin_key = admin_key
        self.make_default = make_default  # a gateway writes no team: the nodes make the default one
        self.teams: dict[str, Team] = {}
        self.keys: dict[str, ApiKey] = {}  # digest -> key
        self.confirmed: dict[str, float] = {}  # digest -> when the store last said it exists
        self.misses: OrderedDict[str, float] = OrderedDict()
        self.started_at = time.time()
        self._lock = asyncio.Lock()
        self.started = False

    # -- start and stop -------------------------------------------------------------------------------
    async def start(self) -> None:
        async with self._lock:
            if self.started:
                return
            await self.store.open()
            await self.reload()
            if DEFAULT_TEAM not in self.teams and self.make_default:
                team = Team(DEFAULT_TEAM, DEFAULT_TEAM, time.time())
                await self.store.put_team(team)
                self.teams[team.id] = team
            self.started = True

    async def stop(self) -> None:
        await self.store.close()
        self.started = False

    async def reload(self) -> None:
        teams, keys = await self.store.load()
        now = time.monotonic()
        self.teams = {t.id: t for t in teams}
        self.keys = {k.digest: k for k in keys}
        self.confirmed = {k.digest: now for k in keys}

    # -- what the store's watch says (cluster) --------------------------------------------------------
    def seen_team(self, team: Team | None, team_id: str) -> None:
        if team is None:
            self.teams.pop(team_id, None)
            for d in [d for d, k in self.keys.items() if k.team == team_id]:
                self._forget(d)
        else:
            self.teams[team.id] = team

    def seen_key(self, key: ApiKey | None, key_digest: str) -> None:
        if key is None:
            self._forget(key_digest)
        else:
            self.keys[key.digest] = key
            self.confirmed[key.digest] = time.monotonic()
            self.misses.pop(key.digest, None)

    def _forget(self, key_digest: str) -> None:
        self.keys.pop(key_digest, None)
        self.confirmed.pop(key_digest, None)

    # -- who a request is -----------------------------------------------------------------------------
    async def authenticate(self, headers: Mapping[str, str]) -> Principal:
        """The principal of a request's headers (lowercase names), or Unauthenticated.
        The key: X-API-Key, else ``Authorization: Bearer``, else E2B's admin X-Admin-Token.
        X-Team-ID picks the team only for the admin key (``*``: every team, for the deployment's
        own calls); a team key with another team's id is refused like a wrong key."""
        key = headers.get("x-api-key") or _bearer(headers.get("authorization", "")) or headers.get("x-admin-token")
        asked = headers.get("x-team-id", "").strip()
        if not key:
            raise Unauthenticated(UNAUTHENTICATED)
        if self.admin_key is not None and hmac.compare_digest(key.encode(), self.admin_key.encode()):
            if asked in ("", DEFAULT_TEAM):
                return Principal(DEFAULT_TEAM, admin=True, key_id=ADMIN_KEY_ID)
            if asked == ALL_TEAMS:
                return Principal(DEFAULT_TEAM, admin=True, all_teams=True, key_id=ADMIN_KEY_ID)
            if await self.find_team(asked) is None:
                raise Unauthenticated(f"no team {asked[:64]!r} (X-Team-ID)")
            return Principal(asked, admin=True, key_id=ADMIN_KEY_ID)
        rec = await self._key(digest(key))
        if rec is None or (asked and asked != rec.team):
            raise Unauthenticated(UNAUTHENTICATED)
        return Principal(rec.team, key_id=rec.id)

    async def _key(self, key_digest: str) -> ApiKey | None:
        rec = self.keys.get(key_digest)
        now = time.monotonic()
        if rec is not None and same_digest(rec.digest, key_digest):
            if not self.store.shared or now - self.confirmed.get(key_digest, 0.0) < KEY_RECHECK:
                return rec
            try:
                fresh = await self.store.find_key(key_digest)
            except ClusterUnavailable:
                if now - self.confirmed.get(key_digest, 0.0) < KEY_GRACE:
                    return rec
                raise
            self.seen_key(fresh, key_digest)
            return fresh if fresh is not None and fresh.team in self.teams else None
        if not self.store.shared:
            return None
        missed = self.misses.get(key_digest)
        if missed is not None and now - missed < MISS_MEMORY:
            return None
        fresh = await self.store.find_key(key_digest)
        if fresh is None:
            self.misses[key_digest] = now
            self.misses.move_to_end(key_digest)
            while len(self.misses) > MAX_MISSES:
                self.misses.popitem(last=False)
            return None
        if fresh.team not in self.teams:
            team = await self.store.find_team(fresh.team)
            if team is None:
                return None
            self.teams[team.id] = team
        self.seen_key(fresh, key_digest)
        return fresh

    async def find_team(self, team_id: str) -> Team | None:
        team = self.teams.get(team_id)
        if team is None and self.store.shared and TEAM_ID.fullmatch(team_id):
            team = await self.store.find_team(team_id)
            if team is not None:
                self.teams[team.id] = team
        return team

    def quotas(self, team_id: str) -> Quotas:
        team = self.teams.get(team_id or DEFAULT_TEAM)
        return team.quotas if team is not None else Quotas()

    # -- teams ----------------------------------------------------------------------------------------
    async def create_team(self, name: str, quotas: Quotas, team_id: str | None = None) -> tuple[Team, str]:
        """A new team and its first key (returned once)."""
        if len(self.teams) >= MAX_TEAMS:
            raise Conflict(f"this deployment has {MAX_TEAMS} teams, the most it keeps")
        team_id = team_id or str(uuid.uuid4())
        if not TEAM_ID.fullmatch(team_id) or team_id == ALL_TEAMS:
            raise InvalidRequest("a team id is 1-63 characters of A-Z a-z 0-9 . _ - (starting with a letter or digit)")
        if await self.find_team(team_id) is not None:
            raise Conflict(f"team {team_id!r} exists already")
        team = Team(team_id, name, time.time(), quotas)
        await self.store.put_team(team)
        self.teams[team.id] = team
        raw, _ = await self.create_key(team.id, "default")
        return team, raw

    async def update_team(self, team_id: str, *, name: str | None = None, quotas: Quotas | None = None) -> Team:
        team = await self._team(team_id)
        fresh = Team(team.id, name if name is not None else team.name, team.created_at, quotas or team.quotas)
        await self.store.put_team(fresh)
        self.teams[fresh.id] = fresh
        return fresh

    async def delete_team(self, team_id: str) -> None:
        if team_id == DEFAULT_TEAM:
            raise InvalidRequest("the default team is the admin key's and cannot be deleted")
        await self._team(team_id)
        await self.store.delete_team(team_id)
        self.seen_team(None, team_id)

    async def _team(self, team_id: str) -> Team:
        team = await self.find_team(team_id)
        if team is None:
            raise NotFound(f"team {team_id[:64]!r} not found")
        return team

    # -- keys -----------------------------------------------------------------------------------------
    def team_keys(self, team_id: str) -> list[ApiKey]:
        keys = sorted((k for k in self.keys.values() if k.team == team_id), key=lambda k: k.created_at)
        if team_id == DEFAULT_TEAM and self.admin_key:
            admin = masked(
                self.admin_key,
                key_id=ADMIN_KEY_ID,
                team=DEFAULT_TEAM,
                name="admin (AENV_API_KEY)",
                created_at=self.started_at,
            )
            keys.insert(0, admin)
        return keys

    async def list_keys(self, team_id: str) -> list[ApiKey]:
        if self.store.shared:  # others may have made or deleted some
            await self.reload()
        return self.team_keys(team_id)

    async def create_key(self, team_id: str, name: str) -> tuple[str, ApiKey]:
        await self._team(team_id)
        if sum(1 for k in self.keys.values() if k.team == team_id) >= MAX_KEYS_PER_TEAM:
            raise Conflict(f"a team has at most {MAX_KEYS_PER_TEAM} API keys: delete one first")
        raw, rec = new_key(team_id, name, time.time())
        await self.store.put_key(rec)
        self.seen_key(rec, rec.digest)
        return raw, rec

    async def delete_key(self, team_id: str, key_id: str) -> None:
        if key_id == ADMIN_KEY_ID and team_id == DEFAULT_TEAM:
            raise InvalidRequest("the admin key is the deployment's (AENV_API_KEY): it is changed there, not deleted")
        if self.store.shared:
            await self.reload()
        found = next((k for k in self.keys.values() if k.id == key_id and k.team == team_id), None)
        if found is None:
            raise NotFound("id not found")  # E2B's words, for an id of another team's too
        await self.store.delete_key(found)
        self._forget(found.digest)

    async def rename_key(self, team_id: str, key_id: str, name: str) -> ApiKey:
        found = next((k for k in self.keys.values() if k.id == key_id and k.team == team_id), None)
        if found is None:
            raise NotFound("id not found")
        renamed = ApiKey(**{**found.to_json(), "name": name})
        await self.store.delete_key(found)
        await self.store.put_key(renamed)
        self.seen_key(renamed, renamed.digest)
        return renamed


def _bearer(value: str) -> str:
    scheme, _, token = value.partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""
