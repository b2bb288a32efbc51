"""Which node serves a sandbox: its owner from the mirror (or etcd), or, for a durable pause whose
node is gone, draining or full, the node that takes it over, woken there first when traffic may
wake it (auto-resume)."""

from __future__ import annotations

import asyncio
import hmac
import time

import httpx
from starlette.types import Scope

from aenv.api import envd
from aenv.api.proxy import TRAFFIC_TOKEN_HEADER
from aenv.cluster.entries import ID_PATTERN, NodeEntry, SandboxEntry
from aenv.cluster.gateway.directory import Directory
from aenv.cluster.gateway.helpers import (
    Traffic,
    auto_resumes,
    becoming_durable,
    cluster_paused,
    full_owner,
    movable,
    wakes,
)
from aenv.cluster.gateway.relay import NODE_SCOPE, TAKEOVER_SCOPE, NodeSilent
from aenv.cluster.gateway.settings import HINT_SECONDS, MAX_CANDIDATES, WAKE_SECONDS, GatewaySettings
from aenv.errors import SandboxNotFound, UpstreamError
from aenv.node import tokens
from aenv.node.service import OWNER_FULL_HEADER
from aenv.teams.model import ALL_TEAMS


class Owners:
    def __init__(self, settings: GatewaySettings, directory: Directory, client: httpx.AsyncClient) -> None:
        self.settings = settings
        self.directory = directory
        self.mirror = directory.mirror
        self.client = client
        self._waking: dict[str, asyncio.Future[NodeEntry]] = {}  # auto-resumes on another node under way

    async def owner(
        self, sandbox_id: str, scope: Scope, *, resume: bool = False, wake: Traffic | None = None
    ) -> NodeEntry:
        """The node serving ``sandbox_id``: from the mirror; a miss costs one read of etcd. Its id
        is noted in ``scope`` (for the answer's header) even when the node is gone. For a
        ``resume``, a sandbox durably paused on a node that is gone or draining goes to the best
        node with room, which takes it over from the repository. With ``wake`` (sandbox traffic),
        such a sandbox with auto-resume is resumed there first (see ``wake_elsewhere``), if the
        traffic carries what the sandbox's node would ask of it (a secure sandbox's access token,
        a private one's traffic token): a stranger wakes nothing, as on one node."""
        hints = self.directory.hints
        entry, node = self.mirror.owner(sandbox_id)
        if entry is not None:
            hints.pop(sandbox_id, None)  # the directory has it now
        else:
            hint = hints.pop(sandbox_id, None)
            if hint is not None and hint[0] in self.mirror.nodes and time.monotonic() - hint[1] < HINT_SECONDS:
                hints[sandbox_id] = hint
                scope[NODE_SCOPE] = hint[0]
                return self.mirror.nodes[hint[0]]
            if ID_PATTERN.fullmatch(sandbox_id):
                read = await self.mirror.store.get_sandbox(sandbox_id)
                entry = read.entry if read is not None else None
                node = self.mirror.nodes.get(entry.node_id) if entry is not None else None
        if entry is None:
            raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])
        scope[NODE_SCOPE] = entry.node_id
        if wake is not None and not await self.may_wake(entry, wake):
            wake = None  # forwarded as it is: the node answers its 401 or 403
        if (resume or (wake and auto_resumes(entry))) and becoming_durable(entry, node):
            # Being paused by a drain: wait for its pause to be durable (then it resumes elsewhere)
            # or for its move, rather than wake it where it is leaving.
            await self.mirror.wait_for(lambda m: not becoming_durable(*m.owner(sandbox_id)), WAKE_SECONDS)
            entry, node = self.mirror.owner(sandbox_id)
            if entry is None:
                raise SandboxNotFound(f"sandbox {sandbox_id[:80]!r} not found", sandbox_id=sandbox_id[:80])
            scope[NODE_SCOPE] = entry.node_id
        if resume and movable(entry, node):
            # a node with its runtime (its memory image's), holding its template's layers first
            node = self.directory.candidates(entry.template_id or None, entry.runtime)[0]
            scope[NODE_SCOPE], scope[TAKEOVER_SCOPE] = node.node_id, True
        elif wake and wakes(entry) and (movable(entry, node) or full_owner(entry, node)):
            node = await self.wake_elsewhere(sandbox_id, owner_full=node is not None)
            scope[NODE_SCOPE] = node.node_id
        if node is None:
            raise SandboxNotFound(
                f"sandbox {sandbox_id} was on node {entry.node_id}, which left the cluster (lost)",
                sandbox_id=sandbox_id,
            )
        return node

    async def may_wake(self, entry: SandboxEntry, traffic: Traffic) -> bool:
        """Whether ``traffic`` may resume the sandbox: it has the token its node would check first
        (nothing for an open sandbox). An entry that says neither way wakes nothing."""
        listed = entry.listed
        if not listed:
            return False
        protected = listed.get("secure") if traffic.port == envd.ENVD_PORT else listed.get("private")
        if not protected or traffic.signed:
            return True
        config = await self.directory.cluster_config()
        if config is None:
            return False
        secret = config.secret.encode()
        if traffic.port == envd.ENVD_PORT:
            given, expected = traffic.headers.get("x-access-token", ""), tokens.access_token(secret, entry.sandbox_id)
        else:
            given = traffic.headers.get(TRAFFIC_TOKEN_HEADER, "")
            expected = tokens.traffic_token(secret, entry.sandbox_id)
        return bool(given) and hmac.compare_digest(given.encode(), expected.encode())

    async def wake_from_silent(self, sandbox_id: str, traffic: Traffic, silent: NodeSilent) -> NodeEntry:
        """Traffic whose node did not answer: a durable pause it may wake (auto-resume, with
        memory, and the traffic has the sandbox's token where one is asked) is resumed on another
        node, as if that node were gone. Anything else is the silent node's: a sandbox that ran
        there is unreachable with it (E2B's "not found"); a pause that wakes nothing is one too."""
        entry, _ = self.mirror.owner(sandbox_id)
        if entry is None or entry.node_id != silent.node_id:
            raise silent  # moved meanwhile: the mirror's next look sends it there, once
        if not (cluster_paused(entry) and wakes(entry) and await self.may_wake(entry, traffic)):
            raise SandboxNotFound(
                f"sandbox {sandbox_id} is on node {silent.node_id}, which does not answer", sandbox_id=sandbox_id
            )
        return await self.wake_elsewhere(sandbox_id, owner_full=True, avoid=silent.node_id)

    async def wake_elsewhere(self, sandbox_id: str, *, owner_full: bool = False, avoid: str = "") -> NodeEntry:
        """Auto-resume through the gateway: traffic to a sandbox with auto-resume, durably paused
        on a node that is gone, draining or full, resumes it on the best node with room (a connect, so
        it takes the sandbox over as a client's connect would) and then proceeds there, waiting
        up to WAKE_SECONDS. Concurrent traffic joins one wake; a node that lost the claim to
        another (409, or 404 once it saw the move) sends the traffic to the winner. ``avoid``: its
        node, which did not answer (``owner_full`` then says so to the node that takes it over)."""
        waking = self._waking.get(sandbox_id)
        if waking is None:
            waking = asyncio.ensure_future(self._wake(sandbox_id, owner_full, avoid))
            self._waking[sandbox_id] = waking
            waking.add_done_callback(lambda _: self._waking.pop(sandbox_id, None))
        return await asyncio.shield(waking)

    async def _wake(self, sandbox_id: str, owner_full: bool, avoid: str = "") -> NodeEntry:
        headers = {"X-API-Key": self.settings.api_key or "", "X-Team-ID": ALL_TEAMS}  # whoever's it is
        if owner_full:
            headers[OWNER_FULL_HEADER] = "1"
        timeout = httpx.Timeout(self.settings.connect_timeout, read=WAKE_SECONDS, write=10.0, pool=10.0)
        failures = []
        entry, _ = self.mirror.owner(sandbox_id)
        source = (entry.template_id or None) if entry is not None else None  # its template's layers: fetched least
        runtime = entry.runtime if entry is not None else ""  # its memory image restores only there
        ranked = [n for n in self.directory.candidates(source, runtime) if n.node_id != avoid]
        if owner_full and runtime:  # its owner is up: only where its memory image restores
            ranked = [n for n in ranked if n.runtime == runtime]
        owner = self.mirror.nodes.get(entry.node_id) if entry is not None else None
        if owner_full and not ranked and owner is not None and owner.node_id != avoid:
            return owner  # nowhere else to go: its owner's answer (429 while it is full)
        for node in ranked[:MAX_CANDIDATES]:
            url = f"{node.address}/sandboxes/{sandbox_id}/connect"
            try:
                r = await self.client.post(url, json={}, headers=headers, timeout=timeout)
            except httpx.TransportError as exc:
                failures.append(f"{node.node_id}: {exc!r}"[:200])
                continue
            if r.status_code in (200, 201):
                self.directory.expect(sandbox_id, "running")
                return node
            read = await self.mirror.store.get_sandbox(sandbox_id)
            winner = self.mirror.nodes.get(read.entry.node_id) if read is not None else None
            if r.status_code in (404, 409) and winner is not None and not winner.draining:
                return winner
            failures.append(f"{node.node_id}: {r.status_code} {r.text[:200]}")
        raise UpstreamError(f"sandbox {sandbox_id} could not be resumed on another node: " + "; ".join(failures))
