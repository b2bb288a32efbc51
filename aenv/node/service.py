"""The one boundary of a node: what the API routes, the cluster's node agent and template builds
may ask of it. ``Node`` (aenv/node/orchestrator.py) implements both protocols; nothing outside
aenv/node reaches past them (tests/test_boundary.py checks it).

``NodeService`` is the narrow one: sandbox lifecycle (create, pause, resume, snapshot, fork, kill,
timeout, network), lookups and read-only views of sandboxes, templates and snapshots, tokens,
usage, capacity, cached artifacts, and the hooks the cluster agent sets. The routes' types come from
here too, so an API module imports nothing else of aenv.node.

``BuildHost`` adds what building a template needs on the node itself (it boots instances on the
node's runtime and writes layers into its store): node-local code (aenv/templates, aenv/images),
never the cluster.
"""

from __future__ import annotations

import builtins
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aenv.config import Settings
from aenv.node.agentlink import AgentLink
from aenv.node.artifacts import ArtifactCache
from aenv.node.commands import CommandRecord
from aenv.node.create_ids import CREATE_ID_HEADER, CreateIds, create_id_of
from aenv.node.egress import build_guest
from aenv.node.grace import SCORING_HEADER
from aenv.node.grace import refusal as grace_refusal
from aenv.node.rollout import RolloutLogs
from aenv.node.sandbox import ForkResult, LiveSandbox
from aenv.node.spawns import Spawned, Spawns
from aenv.node.spec import DEFAULT_SPEC, SandboxSpec, VolumeClones
from aenv.node.state import PUBLIC_STATE, SandboxState
from aenv.node.store import SandboxRecord, SnapshotRecord, Store, TemplateRecord
from aenv.node.tokens import access_token  # a secure sandbox's envd token, from the node's secret (signed URLs)
from aenv.node.transforms import SecretLookup, Transforms
from aenv.node.usage import Bucket, History, Sample, in_range
from aenv.runtime.base import Driver, Instance, Limits, RootfsSpec
from aenv.storage.layers import LayerStore
from aenv.templates.uploads import UploadCache

__all__ = [
    "Transforms",
    "Spawned",
    "Spawns",
    "CREATE_ID_HEADER",
    "PUBLIC_STATE",
    "SCORING_HEADER",
    "RolloutLogs",
    "grace_refusal",
    "AgentLink",
    "BuildHost",
    "FirstSandboxes",
    "Bucket",
    "CachedArtifacts",
    "Capacity",
    "CommandRecord",
    "ForkResult",
    "History",
    "Limits",
    "LiveSandbox",
    "NodeService",
    "Sample",
    "DEFAULT_SPEC",
    "SandboxRecord",
    "SandboxSpec",
    "SandboxState",
    "SnapshotRecord",
    "TemplateRecord",
    "access_token",
    "build_guest",
    "create_id_of",
    "in_range",
]


# A gateway's word to a node asked to resume a durable pause it does not hold: the sandbox's own
# node (up) refused the resume for room, or did not answer at all (killed, its lease not run out),
# so this one may take it over (aenv/cluster/gateway/).
OWNER_FULL_HEADER = "x-aenv-owner-full"


@dataclass(frozen=True)
class Capacity:
    """A node's load: what placement compares (docs/cluster.md)."""

    running: int
    paused: int
    starting: int  # sandboxes in an operation (creating, pausing, resuming, forking, ...)
    max_sandboxes: int
    cpu_committed: float  # the CPU limits of every sandbox not paused, added up
    memory_committed_mb: int  # their memory limits, added up
    cpu_used: float = 0.0  # cores the running ones used at their last usage sample


@dataclass(frozen=True)
class CachedArtifacts:
    """Templates and snapshots (ids) whose layers and image are all on this node's disk."""

    templates: frozenset[str]
    snapshots: frozenset[str]


class NodeService(Protocol):
    # -- what the node is ----------------------------------------------------------------------------
    @property
    def settings(self) -> Settings: ...

    @property
    def started_at(self) -> float:
        """When the node started (epoch seconds)."""
        ...

    async def start(self) -> None: ...

    async def stop(self, *, pause_running: bool = True) -> None: ...

    # -- lifecycle -----------------------------------------------------------------------------------
    async def create(
        self,
        template: str = "base",
        spec: SandboxSpec = DEFAULT_SPEC,
    ) -> SandboxRecord: ...

    async def pause(
        self, sandbox_id: str, *, keep_memory: bool = True, settle_streams: bool = False
    ) -> SandboxRecord: ...

    async def resume(
        self, sandbox_id: str, *, timeout: int | None = None, memory: bool = True, owner_full: bool = False
    ) -> tuple[SandboxRecord, bool]: ...

    async def ensure_running(self, sandbox_id: str) -> LiveSandbox: ...

    async def snapshot(self, sandbox_id: str, *, name: str | None = None, durable: bool = False) -> SnapshotRecord: ...

    async def fork(
        self,
        sandbox_id: str,
        *,
        count: int = 1,
        timeout: int | None = None,
        metadata: builtins.list[dict[str, str]] | None = None,
        volume_clones: VolumeClones | None = None,
    ) -> builtins.list[ForkResult]: ...

    async def kill(self, sandbox_id: str) -> None: ...

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord: ...

    async def set_network(self, sandbox_id: str, network: dict[str, Any], internet: bool | None = None) -> None: ...

    # -- sandboxes -----------------------------------------------------------------------------------
    @property
    def sandboxes(self) -> Mapping[str, LiveSandbox]: ...

    def get(self, sandbox_id: str) -> LiveSandbox: ...

    def list(
        self, *, states: set[str] | None = None, metadata: dict[str, str] | None = None
    ) -> builtins.list[LiveSandbox]: ...

    def limits_of(self, rec: SandboxRecord) -> Limits: ...

    def usage_of(self, sandbox_id: str) -> History | None: ...

    def capacity(self) -> Capacity: ...

    def observe_metrics(self) -> None: ...

    @property
    def rollouts(self) -> RolloutLogs:
        """The sandboxes' rollout logs: their commands with output and exit codes (aenv/node/rollout.py)."""
        ...

    def runtime_calibration(self) -> dict[str, Any] | None:
        """How the runtime chose its options on this host (runsc's platform) and what it measured."""
        ...

    def runtime_info(self) -> dict[str, str]:
        """The sandbox runtime this node runs: driver, runsc version, platform."""
        ...

    # -- credentials ---------------------------------------------------------------------------------
    def access_token(self, sandbox_id: str) -> str: ...

    def traffic_token(self, sandbox_id: str) -> str: ...

    @property
    def token_secret(self) -> str: ...

    async def use_token_secret(self, secret: str) -> None: ...

    # -- templates and snapshots ---------------------------------------------------------------------
    @property
    def templates(self) -> Mapping[str, TemplateRecord]: ...

    @property
    def snapshots(self) -> Mapping[str, SnapshotRecord]: ...

    def find_template(self, ref: str) -> TemplateRecord: ...

    def find_snapshot(self, ref: str) -> SnapshotRecord: ...

    async def delete_snapshot(self, ref: str) -> None: ...

    def cached_artifacts(self) -> CachedArtifacts: ...

    async def images(self) -> builtins.list[dict[str, Any]]:
        """The images this node holds as templates (or evicted), with their sizes against what it
        stores, last use (epoch seconds), use and state (aenv/node/imagecache.py)."""
        ...

    def warm_pool(self, ref: str) -> dict[str, Any]:
        """A template's warm pool: its size, target now, members ready, recent creates."""
        ...

    async def set_warm_pool(self, ref: str, size: int | None) -> dict[str, Any]:
        """Set the most members a template's warm pool keeps (None: the node's default)."""
        ...

    async def repository_status(self) -> dict[str, Any]: ...

    def durable_reason(self, rec: SandboxRecord) -> str:
        """Why a paused sandbox stays on this node ("" if its pause is, or is being made, durable)."""
        ...

    async def wait_durable(self, sandbox_id: str) -> bool:
        """Until the pause's commit to the repository is done; whether the sandbox is durably paused."""
        ...

    async def gc_repository(self) -> dict[str, Any]: ...

    def use_secrets(self, lookup: SecretLookup) -> None:
        """Where network.rules' ``${e2b.secrets.NAME}`` values come from (the app's secrets)."""
        ...

    # -- the cluster agent's hooks -------------------------------------------------------------------
    @property
    def state_listeners(self) -> builtins.list[Callable[[LiveSandbox], None]]: ...

    @property
    def transition_listeners(self) -> builtins.list[Callable[[LiveSandbox, SandboxState, SandboxState], None]]: ...

    @property
    def update_listeners(self) -> builtins.list[Callable[[LiveSandbox, dict[str, Any]], None]]: ...

    @property
    def admission_checks(self) -> builtins.list[Callable[[], None]]: ...

    @property
    def create_ids(self) -> CreateIds: ...

    adopter: Callable[[str, bool], Awaitable[None]] | None
    durable_in_directory: Callable[[str], bool] | None
    resume_guard: Callable[[str], Awaitable[None]] | None
    wake_refusal: Callable[[LiveSandbox], str | None] | None
    announce: Callable[[builtins.list[str]], Awaitable[None]] | None
    team_room: Callable[[SandboxRecord, int], tuple[int, str]] | None

    def is_dozing(self, sb: LiveSandbox) -> bool:
        """A running sandbox is frozen on the host while idle (aenv/node/doze.py)."""
        ...

    def is_durable(self, rec: SandboxRecord) -> bool:
        """A paused sandbox's state is in the repository (and, in a cluster, its directory entry
        says so): it survives this node."""
        ...

    async def adopt_paused(self, sandbox_id: str) -> None:
        """Hold a sandbox durably paused by another node, from the repository (paused here)."""
        ...

    async def let_go(self, sandbox_id: str) -> None:
        """Kill this node's copy of a sandbox the directory gave to another node (a stale copy,
        or one ``adopt_paused`` took while another node won): its repository entry stays."""
        ...

    @property
    def has_repository(self) -> bool:
        """Whether this node commits to a snapshot repository (AENV_REPO is not none)."""
        ...

    async def forget_durable_pause(self, sandbox_id: str) -> bool:
        """Remove the durable pause of a sandbox this node does not hold from the repository (it
        was killed while its node was lost); whether there was one."""
        ...


class FirstSandboxes(Protocol):
    """Where a new image's template is snapshotted from the sandbox its first create then takes
    (aenv/node/warmpool.py): booted as that create's sandbox, checkpointed leaving it running."""

    async def boot_first(self, layers: builtins.list[str]) -> LiveSandbox: ...

    async def snapshot_first(self, sb: LiveSandbox) -> tuple[str, str | None]: ...

    def offer_first(self, sb: LiveSandbox, rec: TemplateRecord) -> None: ...

    def drop_first(self, sb: LiveSandbox, reason: str) -> None: ...


class BuildHost(NodeService, Protocol):
    """A node as a template build uses it: its runtime, layer store, records and artifact cache."""

    @property
    def files(self) -> LayerStore: ...

    @property
    def driver(self) -> Driver: ...

    @property
    def store(self) -> Store: ...

    @property
    def artifacts(self) -> ArtifactCache: ...

    @property
    def uploads(self) -> UploadCache: ...

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` as the node's background work: a stopping node cancels and awaits it."""

    def kill_later(self, instance: Instance) -> None:
        """Finish a halted instance's teardown (the driver's kill) in the background; the node's
        settle waits for it."""

    def rootfs(self, layers: builtins.list[str], upper: str, guest: str = "") -> RootfsSpec: ...

    async def add_template(self, rec: TemplateRecord) -> None: ...

    async def save_template(self, rec: TemplateRecord) -> None: ...

    async def drop_template(self, rec: TemplateRecord) -> None: ...

    async def collect_garbage(self, *, min_age: float = 0.0) -> None: ...

    @property
    def first_sandboxes(self) -> FirstSandboxes | None:
        """None where the runtime cannot checkpoint an instance leaving it running."""
