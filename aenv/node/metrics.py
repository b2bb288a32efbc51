"""Prometheus metrics of a node (served on /metrics)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from prometheus_client import Counter, Gauge, Histogram, Info

from aenv.errors import AenvError, lookup
from aenv.node.state import SandboxState

if TYPE_CHECKING:
    from aenv.node.orchestrator import Node
    from aenv.node.service import NodeService
    from aenv.node.store import SnapshotRecord, TemplateRecord

SANDBOXES = Gauge("aenv_sandboxes", "Sandboxes on this node by state", ["state"])
TEMPLATES = Gauge("aenv_templates", "Templates on this node")
OPERATIONS = Counter("aenv_operations_total", "Lifecycle operations", ["op", "outcome"])
LAYER_CACHE = Gauge(
    "aenv_layer_cache_bytes", "Disk held by cached layers and images (pulled, build steps, committed records)"
)
REPO_COMMITS = Counter("aenv_repo_commits_total", "Templates and snapshots committed to the repository", ["outcome"])
REPO_BYTES = Counter("aenv_repo_commit_bytes_total", "Bytes of commits: logical size and actually uploaded", ["what"])
REPO_FETCHES = Counter("aenv_repo_fetches_total", "Artifacts fetched from the repository", ["outcome"])
REPO_FETCH_BYTES = Counter("aenv_repo_fetch_bytes_total", "Logical bytes of the artifacts fetched from the repository")
CHANNEL_STREAMS = Gauge(
    "aenv_channel_streams",
    "Open streams between the node and its sandboxes' agents: by method for those the node opened "
    "(tunnel.open: proxied connections), 'guest' for those agents opened",
    ["method"],
)
EGRESS = Counter("aenv_egress_connections_total", "Outbound connections asked for by sandboxes", ["outcome"])
OPERATION_SECONDS = Histogram(
    "aenv_operation_seconds",
    "Duration of lifecycle operations",
    ["op"],
    buckets=(0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 1.5, 2, 3, 5, 10, 30),
)
OPERATION_FAILURES = Counter(
    "aenv_operation_failures_total",
    "Lifecycle operations that failed, by reason (the error code of the API's answer)",
    ["op", "reason"],
)
LAYER_CACHE_BUDGET = Gauge("aenv_layer_cache_budget_bytes", "The layer cache's budget (AENV_LAYER_CACHE_MB)")
# Images as templates (aenv/node/imagecache.py): what was pulled, what is stored, what the images add up to.
IMAGE_PULLED = Counter("aenv_image_pull_bytes_total", "Bytes of image layers downloaded from registries and mirrors")
IMAGE_STORED = Gauge(
    "aenv_image_layer_stored_bytes",
    "Disk held by the layers of the images this node holds as templates, each stored once however many share it",
)
IMAGE_SIZES = Gauge(
    "aenv_image_size_bytes",
    "The sizes of the images this node holds as templates, added up (each image's compressed layers, shared ones "
    "counted in every image): against aenv_image_layer_stored_bytes, what sharing saves",
)
IMAGES = Gauge("aenv_images", "Images this node knows as templates, by state (local, evicted)", ["state"])
IMAGE_EVICTIONS = Counter(
    "aenv_image_evictions_total", "Image templates evicted from this node to keep its cache budget"
)
REPO_PENDING = Gauge(
    "aenv_repo_pending",
    "Templates, durable snapshots and paused sandboxes not committed to the repository yet (the commit backlog)",
)
RUNTIME = Info("aenv_runtime", "The sandbox runtime of this node: driver, runsc version, platform")
DOZING = Gauge(
    "aenv_sandboxes_dozing",
    "Running sandboxes (and warm pool members) frozen on the host while idle (AENV_DOZE_AFTER)",
)
WAKES = Gauge(
    "aenv_doze_wakes", "Times a dozing sandbox was thawed by a request or an operation since the node started"
)
MAX_SANDBOXES = Gauge("aenv_max_sandboxes", "Sandboxes this node may run at once (AENV_MAX_SANDBOXES)")
# Commands started through envd (process.Start: exec, E2B's commands.run, PTYs), each counted once.
COMMAND_OUTCOMES = ("ok", "nonzero", "timeout", "error", "detached")
COMMANDS = Counter(
    "aenv_commands_total",
    "Commands run in sandboxes, by how they ended: ok (exit 0), nonzero (another exit code or a signal), "
    "timeout (killed at their own timeout), error (did not start, or the sandbox or its agent went away), "
    "detached (the client stopped following before the end; the process ran on)",
    ["outcome"],
)
for _outcome in COMMAND_OUTCOMES:
    COMMANDS.labels(outcome=_outcome)  # every outcome exported from the start, at 0
# From the request to the command running in the sandbox (the agent's start event): the node's and the
# agent's share of an exec (the channel, a dozing sandbox's wake, the spawn), whatever the command does.
COMMAND_START_SECONDS = Histogram(
    "aenv_command_start_seconds",
    "Seconds from a command's request to its start in the sandbox (its pid known)",
    buckets=(0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 30),
)


def outcomes(op: str) -> tuple[int, int]:
    """How many ``op`` operations this process finished well and how many failed (E2B's node
    ``createSuccesses`` and ``createFails`` for ``create``)."""
    done = {"ok": 0.0, "error": 0.0}
    for family in OPERATIONS.collect():
        for sample in family.samples:
            if sample.name == "aenv_operations_total" and sample.labels["op"] == op:
                done[sample.labels["outcome"]] = done.get(sample.labels["outcome"], 0.0) + sample.value
    return int(done["ok"]), int(done["error"])


def operation_failed(op: str, exc: BaseException) -> None:
    """Count a failed operation, with why: an aenv error's code, else what kind of failure it was."""
    if isinstance(exc, AenvError):
        reason = lookup(type(exc))[1]
    elif isinstance(exc, asyncio.CancelledError):
        reason = "cancelled"
    elif isinstance(exc, TimeoutError):
        reason = "timeout"
    else:
        reason = "internal"
    OPERATIONS.labels(op=op, outcome="error").inc()
    OPERATION_FAILURES.labels(op=op, reason=reason).inc()


def observe_node(node: Node) -> None:
    from aenv.node.state import SandboxState

    counts = {s.value: 0 for s in SandboxState if s != SandboxState.KILLED}
    for sb in node.sandboxes.values():
        if sb.state.value in counts:
            counts[sb.state.value] += 1
    for state, n in counts.items():
        SANDBOXES.labels(state=state).set(n)
    TEMPLATES.set(len(node.templates))
    LAYER_CACHE_BUDGET.set(node.settings.layer_cache_mb * 2**20)
    MAX_SANDBOXES.set(node.settings.max_sandboxes)
    RUNTIME.info(node.runtime_info())
    REPO_PENDING.set(len(pending_commits(node)))
    DOZING.set(sum(1 for sb in node.dozer.candidates() if node.is_dozing(sb)))
    WAKES.set(node.driver.wakes)
    streams: dict[str, int] = {}
    for sb in node.sandboxes.values():
        for stream in sb.link.channel.streams() if sb.link is not None else []:
            # Only the node's own method names become labels: an agent names its streams itself.
            method = stream.method if stream.id % 2 == 1 else "guest"
            streams[method] = streams.get(method, 0) + 1
    CHANNEL_STREAMS.clear()
    for method, n in streams.items():
        CHANNEL_STREAMS.labels(method=method).set(n)


def pending_commits(node: NodeService) -> list[str]:
    """Ids of the templates, durable snapshots and paused sandboxes the repository does not have
    yet: the commit backlog."""
    return [*pending_records(node), *pending_pauses(node)]


def pending_records(node: NodeService) -> list[str]:
    """Ids of the templates and durable snapshots the repository does not have yet."""
    return [r.id for r in committable(node) if not r.committed_at]


def committable(node: NodeService) -> list[TemplateRecord | SnapshotRecord]:
    """The templates and snapshots a node commits to its repository (not a fork's own image)."""
    return [*node.templates.values(), *(s for s in node.snapshots.values() if not s.ephemeral)]


def pending_pauses(node: NodeService) -> list[str]:
    """Ids of the sandboxes paused with their memory whose pause is not in the repository yet (it
    is committed, to be durable, on a node that has one)."""
    return [
        sb.id
        for sb in list(node.sandboxes.values())
        if sb.state == SandboxState.PAUSED and not sb.rec.durable_at and not node.durable_reason(sb.rec)
    ]
