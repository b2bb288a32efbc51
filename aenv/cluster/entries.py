"""What the cluster store holds: one entry per node (under the node's lease) and one per sandbox.

Keys:
    /aenv/cluster                  ClusterConfig: the cluster's one token secret and its API key's digest,
                                   created once (compare-and-swap) by the first node to join
    /aenv/nodes/<node-id>          NodeEntry, JSON, under the node's lease: gone when the node dies
    /aenv/sandboxes/<sandbox-id>   SandboxEntry, JSON; changed only by compare-and-swap transactions
    /aenv/creates/<create-id>      CreateClaim, under the creating node's lease: a create id taken
    /aenv/tombstones/<sandbox-id>  Tombstone: a sandbox killed while its node was lost, so that node
                                   kills its copy when it comes back instead of writing it again

Values are bounded (a node's entry, a sandbox's entry and its metadata) and decoded strictly: what
comes out of etcd was written by a node, but a bad or oversized value costs its one entry, never
the mirror.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import socket
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from aenv.config import Settings

PREFIX = "/aenv/"
NODES_PREFIX = PREFIX + "nodes/"
SANDBOXES_PREFIX = PREFIX + "sandboxes/"
CREATES_PREFIX = PREFIX + "creates/"
TOMBSTONES_PREFIX = PREFIX + "tombstones/"
CONFIG_KEY = (PREFIX + "cluster").encode()

MAX_NODE_ENTRY = 16 * 1024
MAX_SANDBOX_ENTRY = 16 * 1024
# A sandbox's metadata (E2B's free-form labels) is kept in its entry for lists only while it fits
# in this many bytes of JSON; larger metadata is left out (and said so) rather than refused.
MAX_ENTRY_METADATA = 8 * 1024
# The templates and snapshots a node's entry lists as held on its disk (placement prefers such a
# node): the newest ones, by every name a create may use, each name at most this long.
MAX_CACHED_NAMES = 128
MAX_CACHED_NAME = 64
# Node ids and sandbox ids become key segments: a safe, short alphabet.
ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


class EntryError(ValueError):
    """A value that is not a valid entry (malformed, oversized or with a bad id)."""


def check_id(value: str, what: str) -> str:
    if not ID_PATTERN.fullmatch(value):
        raise EntryError(f"invalid {what} {value[:80]!r}: 1-63 characters of A-Z a-z 0-9 . _ -")
    return value


def node_id_of(settings: Settings) -> str:
    """AENV_NODE_ID, else one made once from the host name and kept in the data dir (a restart
    keeps its id, so it takes its directory entries back). A node alone has one too: its lists
    and the dashboard name it."""
    if settings.node_id:
        return check_id(settings.node_id, "node id")
    path: Path = settings.data_dir / "node-id"
    try:
        return check_id(path.read_text().strip(), "node id")
    except FileNotFoundError:
        pass
    host = re.sub(r"[^A-Za-z0-9._-]", "-", socket.gethostname())[:40].strip("-._") or "node"
    node_id = f"{host}-{secrets.token_hex(3)}"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(node_id + "\n")
    return node_id


def node_key(node_id: str) -> bytes:
    return (NODES_PREFIX + check_id(node_id, "node id")).encode()


def sandbox_key(sandbox_id: str) -> bytes:
    return (SANDBOXES_PREFIX + check_id(sandbox_id, "sandbox id")).encode()


def tombstone_key(sandbox_id: str) -> bytes:
    return (TOMBSTONES_PREFIX + check_id(sandbox_id, "sandbox id")).encode()


def create_key(create_id: str) -> bytes:
    return (CREATES_PREFIX + check_id(create_id, "create id")).encode()


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What every node and gateway of one cluster shares. ``secret`` keys every sandbox's envd
    access token, traffic token and signed URLs (so they are the same on whichever node serves the
    sandbox); ``api_key_digest`` (HMAC of the API key under the secret) lets a node or gateway
    started with another key refuse to join instead of answering 401 to half the requests."""

    secret: str
    api_key_digest: str
    created_at: float = 0.0


def api_key_digest(secret: str, api_key: str) -> str:
    return hmac.new(secret.encode(), b"api-key\0" + api_key.encode(), hashlib.sha256).hexdigest()


def key_matches(config: ClusterConfig, api_key: str) -> bool:
    """Whether ``api_key`` is the one the cluster was started with."""
    return hmac.compare_digest(config.api_key_digest, api_key_digest(config.secret, api_key))


@dataclass(frozen=True, slots=True)
class CreateClaim:
    """A create id taken by a node: a create retried elsewhere is refused while the claim lives."""

    node_id: str
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class Tombstone:
    """A sandbox killed through a gateway while its node was lost: ``node_id`` (the node that held
    it) kills its copy when it comes back, and no node writes the sandbox's entry again."""

    node_id: str
    epoch: int = 1  # the killed entry's
    at: float = 0.0


@dataclass(frozen=True, slots=True)
class NodeEntry:
    """A node's registration and load, rewritten about once a second while it lives."""

    node_id: str
    address: str  # the URL gateways forward to
    driver: str
    version: str
    # The sandbox runtime, "runsc <version> <platform>": a memory image restores only under the
    # runsc that wrote it.
    runtime: str = ""
    running: int = 0
    paused: int = 0
    starting: int = 0  # sandboxes in an operation (creating, pausing, resuming, forking, ...)
    max_sandboxes: int = 0
    cpu_count: float = 0.0  # the host's cores
    memory_mb: int = 0  # the host's memory
    cpu_committed: float = 0.0  # the running sandboxes' CPU limits added up
    memory_committed_mb: int = 0  # the running sandboxes' memory limits added up
    cpu_used: float = 0.0  # cores the running sandboxes used, by their last usage samples
    load1: float = 0.0
    draining: bool = False
    started_at: float = 0.0
    updated_at: float = 0.0
    # Names (ids, names, aliases) of templates and snapshots whose layers and image are on this
    # node's disk: a create from one starts here without a fetch. Bounded (MAX_CACHED_NAMES).
    cached: list[str] = field(default_factory=list)
    create_successes: int = 0  # creates finished since the node started (E2B's createSuccesses)
    create_fails: int = 0

    @property
    def room(self) -> int:
        """Sandboxes this node may still start (placement skips nodes with none)."""
        return self.max_sandboxes - self.running - self.starting


@dataclass(frozen=True, slots=True)
class SandboxEntry:
    """Where a sandbox lives. ``epoch`` counts ownership changes: every change of ``node`` is one
    transaction that compares it, so two writers never both win."""

    sandbox_id: str
    node_id: str
    state: str  # the public state: running or paused
    epoch: int = 1
    template_id: str = ""
    alias: str = ""
    started_at: float = 0.0
    end_at: float = 0.0
    metadata: dict[str, str] = field(default_factory=dict)
    metadata_omitted: bool = False  # the sandbox has metadata too large for its entry
    # What the node's list shows for the sandbox (E2B's ListedSandbox: state, limits, lifecycle,
    # network, aenvState, ...) but its metadata (above), tokens and domain (the gateway's to add):
    # gateways answer lists from it. Empty when it did not fit, or from a node of an older version.
    listed: dict[str, object] = field(default_factory=dict)
    # The sandbox's template by every name a list's ``template`` filter may use (id, name, aliases).
    template_names: list[str] = field(default_factory=list)

    # Paused, and the pause is in the snapshot repository: if its node is lost, another takes it.
    durable: bool = False
    # The runtime of the node that holds it ("runsc <version> <platform>", as NodeEntry.runtime):
    # its memory image restores only under that runtime, so a takeover goes to a node that has it.
    runtime: str = ""
    team: str = ""  # the team it belongs to ("": the default team's; aenv/teams)

    @property
    def listable(self) -> bool:
        """Whether a list can be answered from this entry alone."""
        return bool(self.listed) and not self.metadata_omitted


@dataclass(frozen=True, slots=True)
class Versioned:
    """An entry as read: its value plus etcd's revisions of its key (the CAS token)."""

    entry: Any
    mod_revision: int
    create_revision: int


E = TypeVar("E", NodeEntry, SandboxEntry, ClusterConfig, CreateClaim, Tombstone)
Entry = NodeEntry | SandboxEntry | ClusterConfig | CreateClaim | Tombstone


def encode(entry: Entry) -> bytes:
    data = json.dumps(asdict(entry), separators=(",", ":"), allow_nan=False).encode()
    limit = MAX_SANDBOX_ENTRY if isinstance(entry, SandboxEntry) else MAX_NODE_ENTRY
    if len(data) > limit:
        raise EntryError(f"{type(entry).__name__} of {len(data)} bytes is over the {limit}-byte bound")
    return data


def decode(cls: type[E], data: bytes) -> E:
    limit = MAX_SANDBOX_ENTRY if cls is SandboxEntry else MAX_NODE_ENTRY
    if len(data) > limit:
        raise EntryError(f"{cls.__name__} of {len(data)} bytes is over the {limit}-byte bound")
    try:
        raw = json.loads(data)
    except ValueError as exc:
        raise EntryError(f"{cls.__name__} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise EntryError(f"{cls.__name__} is not an object")
    known = {f.name: f.type for f in fields(cls)}
    values = {k: v for k, v in raw.items() if k in known}  # newer writers may add fields
    try:
        entry = cls(**values)
    except TypeError as exc:
        raise EntryError(f"{cls.__name__}: {exc}") from None
    _check_types(entry)
    return entry


def _check_types(entry: Entry) -> None:
    for f in fields(entry):
        value = getattr(entry, f.name)
        expected = _PY_TYPES[str(f.type)]
        if isinstance(value, bool) and expected is not bool:
            raise EntryError(f"{type(entry).__name__}.{f.name} is not {f.type}")
        if expected is float and isinstance(value, int):
            continue
        if not isinstance(value, expected):
            raise EntryError(f"{type(entry).__name__}.{f.name} is not {f.type}")
    if isinstance(entry, SandboxEntry):
        check_id(entry.sandbox_id, "sandbox id")
        check_id(entry.node_id, "node id")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in entry.metadata.items()):
            raise EntryError("SandboxEntry.metadata is not a map of strings")
        if not all(isinstance(name, str) for name in entry.template_names):
            raise EntryError("SandboxEntry.template_names is not a list of strings")
    elif isinstance(entry, NodeEntry):
        check_id(entry.node_id, "node id")
        if len(entry.cached) > MAX_CACHED_NAMES or not all(
            isinstance(name, str) and len(name) <= MAX_CACHED_NAME for name in entry.cached
        ):
            raise EntryError(f"NodeEntry.cached is not a list of at most {MAX_CACHED_NAMES} short names")
    elif isinstance(entry, ClusterConfig):
        if not all(
            len(v) == 64 and all(c in "0123456789abcdef" for c in v) for v in (entry.secret, entry.api_key_digest)
        ):
            raise EntryError("ClusterConfig holds something else than 64 hex digits")
    else:
        check_id(entry.node_id, "node id")


_PY_TYPES: dict[str, type] = {
    "str": str,
    "int": int,
    "float": float,
    "bool": bool,
    "dict[str, str]": dict,
    "dict[str, object]": dict,
    "list[str]": list,
}


def bounded_metadata(metadata: dict[str, str]) -> tuple[dict[str, str], bool]:
    """The metadata an entry keeps, and whether any was left out for size."""
    if len(json.dumps(metadata, separators=(",", ":"))) <= MAX_ENTRY_METADATA:
        return dict(metadata), False
    return {}, True
