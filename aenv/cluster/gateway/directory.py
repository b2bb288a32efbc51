"""What one gateway knows of the cluster: the mirror of etcd's directory, plus what it learned from
the answers it forwarded and the directory does not show yet (a create's sandbox, a snapshot's
node, a change a list should wait for). The one state the gateway's parts share: each part is
given this object rather than reaching into another part."""

from __future__ import annotations

import asyncio
import logging
import random
import time

from aenv.api.listing import short_sandbox_id
from aenv.cluster.entries import ClusterConfig, NodeEntry, SandboxEntry, key_matches
from aenv.cluster.gateway.helpers import SANDBOX_INFO, cluster_paused, note
from aenv.cluster.gateway.settings import (
    ELECTION_RETRY,
    ELECTION_SECONDS,
    GONE,
    HINT_SECONDS,
    LIST_SETTLE,
    MAX_CANDIDATES,
    MEMBER_CONNECT_TIMEOUT,
    PRESENT,
    QUORUM_CHECK_KEEP,
    SETTLE_SECONDS,
    SILENT_SECONDS,
    SNAPSHOT_HINT_SECONDS,
    GatewaySettings,
)
from aenv.cluster.mirror import Mirror
from aenv.cluster.placement import Placement
from aenv.errors import AenvError, ClusterUnavailable, InvalidRequest, LimitExceeded, NotFound

log = logging.getLogger("aenv.gateway")


class Directory:
    def __init__(self, settings: GatewaySettings, mirror: Mirror) -> None:
        self.settings = settings
        self.mirror = mirror
        self.placement = Placement()  # creates this gateway sent that the nodes' entries may not show yet
        # sandbox id -> node id from creates this gateway forwarded, until the directory has them
        self.hints: dict[str, tuple[str, float]] = {}
        # sandbox id -> what the directory should show after a change forwarded here (lists wait for it)
        self.expected: dict[str, tuple[str, float]] = {}
        # snapshot id -> node id for snapshots made through this gateway (creates from one go there)
        self.made_on: dict[str, tuple[str, float]] = {}
        self.building: dict[str, tuple[str, float]] = {}  # template id -> the node building it
        # node id -> when it last did not answer: placed on last, until its lease runs out or it answers
        self.silent: dict[str, float] = {}
        self.config: ClusterConfig | None = None  # read once a node has joined (it writes it)
        # Set when this gateway's key turns out not to be the cluster's: it stops serving (exit 2).
        self.wrong_key = asyncio.Event()
        self._quorum: tuple[float, asyncio.Task[bool]] | None = None  # the last check that etcd answers
        self._recovers: tuple[float, asyncio.Task[bool]] | None = None  # the last: answers or elects

    # -- etcd ---------------------------------------------------------------------------------------
    async def cluster_config(self) -> ClusterConfig | None:
        """The cluster's secret and key digest (None until a node has joined and written them).
        A gateway started with another API key than the cluster's serves nothing."""
        if self.config is None:
            config = await self.mirror.store.get_config()
            if config is not None and self.settings.api_key and not key_matches(config, self.settings.api_key):
                self.wrong_key.set()
                raise ClusterUnavailable("this gateway's AENV_API_KEY is not the one the cluster was started with")
            self.config = config
        return self.config

    async def etcd_answers(self) -> bool:
        """Whether etcd has a leader and answers this gateway now (one read, shared by every
        request asking within QUORUM_CHECK_KEEP seconds)."""
        now = time.monotonic()
        if self._quorum is None or now - self._quorum[0] > QUORUM_CHECK_KEEP:
            self._quorum = (now, asyncio.create_task(self._read_config_answers()))
        return await asyncio.shield(self._quorum[1])

    async def store_recovers(self) -> bool:
        """Whether etcd answers here, or is only electing a leader: most members this gateway was
        given (its cluster URL's) still listen, so an election (4-8 s on a saturated host, longer
        than etcd_answers waits) will end. Without a quorum most members refuse connections and
        the answer is False at once. One check serves every request asking within
        QUORUM_CHECK_KEEP seconds: a few hundred waiting creates make no storm of probes."""
        now = time.monotonic()
        if self._recovers is None or now - self._recovers[0] > QUORUM_CHECK_KEEP:
            self._recovers = (now, asyncio.create_task(self._answers_or_electing()))
        return await asyncio.shield(self._recovers[1])

    async def _answers_or_electing(self) -> bool:
        return await self.etcd_answers() or await self._most_members_listen()

    async def _read_config_answers(self) -> bool:
        """One read, again and again while etcd is electing: a read fails for the second or more
        an election takes (the member that was leader went), and a client must not get "no quorum"
        for that. Without a quorum most members refuse connections and the answer is False at once."""
        deadline = time.monotonic() + ELECTION_SECONDS
        while True:
            try:
                await self.mirror.store.get_config()
                return True
            except ClusterUnavailable:
                if time.monotonic() + ELECTION_RETRY >= deadline or not await self._most_members_listen():
                    return False
            except Exception:  # noqa: BLE001 - etcd answered, with what this gateway cannot read
                log.warning("reading the cluster configuration", exc_info=True)
                return True
            await asyncio.sleep(ELECTION_RETRY)

    async def _most_members_listen(self) -> bool:
        """Whether more than half of the members this gateway knows accept a connection now."""

        async def listens(host: str, port: int) -> bool:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), MEMBER_CONNECT_TIMEOUT)
            except (OSError, TimeoutError):
                return False
            writer.close()  # a probe: nothing to say, and nothing to wait for on the way out
            return True

        endpoints = self.mirror.store.endpoints
        up = await asyncio.gather(*(listens(ep.host, ep.port) for ep in endpoints))
        return 2 * sum(up) > len(endpoints)

    async def moved_to(self, sandbox_id: str, node: NodeEntry) -> NodeEntry | None:
        """The node etcd says holds ``sandbox_id`` now, if another than ``node`` (which said it
        has no such sandbox) and up."""
        try:
            read = await self.mirror.store.get_sandbox(short_sandbox_id(sandbox_id))
        except (ClusterUnavailable, InvalidRequest):
            return None
        if read is None or read.entry.node_id == node.node_id:
            return None
        return self.mirror.nodes.get(read.entry.node_id)

    async def create_holder(self, create_id: str) -> str:
        held = await self.mirror.store.get_create(create_id)
        return held.entry.node_id if held is not None else ""

    # -- nodes ----------------------------------------------------------------------------------------
    def candidates(self, source: str | None = None, runtime: str = "") -> list[NodeEntry]:
        """Ready nodes with room, best first for a create from ``source`` (see placement.py),
        those running ``runtime`` only while any has room."""
        ranked = self.placement.rank(list(self.mirror.nodes.values()), source, runtime)
        now = time.monotonic()
        quiet = {node_id for node_id, at in self.silent.items() if now - at < SILENT_SECONDS}
        if quiet:  # dead, perhaps, until its lease runs out: tried last
            ranked = [n for n in ranked if n.node_id not in quiet] + [n for n in ranked if n.node_id in quiet]
        if not ranked:
            if not self.mirror.loaded.is_set():
                raise ClusterUnavailable("the gateway has not read the cluster directory yet")
            raise LimitExceeded("no node in the cluster has room for another sandbox")
        return ranked

    def any_node(self) -> NodeEntry:
        """The least loaded node, for what any node answers alike (templates, snapshots)."""
        nodes = [n for n in self.mirror.nodes.values() if not n.draining]
        if not nodes:
            raise ClusterUnavailable("no node in the cluster is up")
        return min(nodes, key=lambda n: (self.placement.score(n), random.random()))

    def node_named(self, node_id: str) -> NodeEntry:
        node = self.mirror.nodes.get(node_id)
        if node is None:
            raise NotFound(f"no node {node_id[:80]!r} in the cluster")
        return node

    def takeover_candidates(self, entry: SandboxEntry, *, avoid: str, same_runtime: bool = False) -> list[NodeEntry]:
        """Nodes to take a durable pause over, best first: its memory image's runtime, then
        those holding its template's layers (see placement.py). With ``same_runtime`` only nodes
        whose runtime can restore its memory image (an owner that is up and full: better to wait
        for its room than to be told to reboot it elsewhere)."""
        try:
            ranked = self.candidates(entry.template_id or None, entry.runtime)
        except AenvError:
            return []  # none with room: the owner's own answer stands
        if same_runtime and entry.runtime:
            ranked = [n for n in ranked if n.runtime == entry.runtime]
        return [n for n in ranked if n.node_id != avoid][:MAX_CANDIDATES]

    # -- sandboxes --------------------------------------------------------------------------------------
    def paused_here(self, sandbox_id: str) -> bool:
        """Whether the cluster holds ``sandbox_id`` durably paused (its node lost or silent):
        traffic it does not wake is told so, as its node would tell it."""
        entry, _ = self.mirror.owner(sandbox_id)
        return entry is not None and cluster_paused(entry)

    def knows(self, sandbox_id: str) -> bool:
        return sandbox_id in self.mirror.sandboxes or sandbox_id in self.hints

    def known(self) -> list[str]:
        return list(self.mirror.sandboxes) + [h for h in self.hints if h not in self.mirror.sandboxes]

    def remember(self, sandbox_id: object, node: NodeEntry) -> None:
        """The node's directory write may land after the client's next request: bridge it."""
        if isinstance(sandbox_id, str):
            note(self.hints, sandbox_id, node.node_id, HINT_SECONDS)
            self.expect(sandbox_id, PRESENT)

    def note_fork(self, answer: object, node: NodeEntry) -> None:
        """A fork's children live on the source's node: known there before the directory says so."""
        for result in answer if isinstance(answer, list) else []:
            child = result.get("sandbox") if isinstance(result, dict) else None
            if isinstance(child, dict):
                self.remember(child.get("sandboxID"), node)

    def note_template(self, answer: object, node: NodeEntry) -> None:
        template_id = answer.get("templateID") if isinstance(answer, dict) else None
        if isinstance(template_id, str):
            note(self.building, template_id, node.node_id, SNAPSHOT_HINT_SECONDS)

    def note_snapshot(self, answer: object, node: NodeEntry) -> None:
        """A snapshot is on its node at once, in the repository later: creates from it go there."""
        snapshot_id = answer.get("snapshotID") if isinstance(answer, dict) else None
        if isinstance(snapshot_id, str):
            note(self.made_on, snapshot_id, node.node_id, SNAPSHOT_HINT_SECONDS)

    # -- what lists wait for ------------------------------------------------------------------------------
    def expect(self, sandbox_id: str, outcome: str) -> None:
        """Lists wait for the directory to show ``outcome`` of a change this gateway forwarded
        (PRESENT, GONE or the sandbox's aenvState)."""
        note(self.expected, sandbox_id, outcome, SETTLE_SECONDS)

    def note_change(self, method: str, path: str, sandbox_id: str, status: int) -> None:
        """A change to a sandbox forwarded here that the node took (2xx): lists wait for it."""
        if not 200 <= status < 300:
            return
        sandbox_id = short_sandbox_id(sandbox_id)  # answered 2xx: a valid id, perhaps with its client id
        if method == "DELETE" and SANDBOX_INFO.match(path):
            self.expect(sandbox_id, GONE)
        elif method == "POST" and path.endswith("/pause"):
            self.expect(sandbox_id, "paused")
        elif method == "POST" and path.endswith(("/resume", "/connect")):
            self.expect(sandbox_id, "running")

    def _shown(self, sandbox_id: str, outcome: str) -> bool:
        entry = self.mirror.sandboxes.get(sandbox_id)
        if outcome == GONE:
            return entry is None
        return entry is not None and (outcome == PRESENT or entry.listed.get("aenvState") == outcome)

    async def settle(self) -> None:
        now = time.monotonic()
        for sandbox_id, (outcome, at) in list(self.expected.items()):
            if now - at > SETTLE_SECONDS or self._shown(sandbox_id, outcome):
                del self.expected[sandbox_id]
        if self.expected:
            pending = list(self.expected.items())
            await self.mirror.wait_for(lambda _: all(self._shown(i, o) for i, (o, _) in pending), LIST_SETTLE)
