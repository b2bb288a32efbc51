"""A node's sandboxes' state changes, as lifecycle events in the event store.

The node tells the recorder of each change synchronously (Records' listeners must not block); the
recorder words the event at once (the moment, the state left, the run's numbers) and one task
writes them in order, in batches, then wakes the webhook dispatcher.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from aenv.events import model
from aenv.events.model import LifecycleEvent
from aenv.events.store import EventStore
from aenv.node.service import LiveSandbox, NodeService
from aenv.node.state import SandboxState as S
from aenv.teams.model import DEFAULT_TEAM, rfc3339

log = logging.getLogger("aenv.events")
MAX_PENDING = 100_000  # events not yet written (a store that stopped answering): the oldest go
BATCH = 500
STOP_WAIT = 5.0

# A state change that ends an operation, and the event it is.
ENDED = {
    (S.CREATING, S.RUNNING): model.CREATED,
    (S.RESUMING, S.RUNNING): model.RESUMED,
    (S.PAUSING, S.PAUSED): model.PAUSED,
    (S.SNAPSHOTTING, S.RUNNING): model.CHECKPOINTED,
    (S.SNAPSHOTTING, S.PAUSED): model.CHECKPOINTED,
    (S.FORKING, S.RUNNING): model.CHECKPOINTED,
    (S.FORKING, S.PAUSED): model.CHECKPOINTED,
}


class Recorder:
    def __init__(self, node: NodeService, store: EventStore, written: Callable[[], None] = lambda: None) -> None:
        self.node = node
        self.store = store
        self.written = written  # called after each batch is in the store (the dispatcher's wake-up)
        self._pending: list[LifecycleEvent] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._killing_from: dict[str, S] = {}
        self._stopping = False

    def start(self) -> None:
        self.node.transition_listeners.append(self.transition)
        self.node.update_listeners.append(self.update)
        self._task = asyncio.create_task(self._write_forever(), name="lifecycle events")

    async def stop(self) -> None:
        with contextlib.suppress(ValueError):
            self.node.transition_listeners.remove(self.transition)
        with contextlib.suppress(ValueError):
            self.node.update_listeners.remove(self.update)
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            try:  # what is pending is written before the node goes
                await asyncio.wait_for(asyncio.shield(self._task), STOP_WAIT)
            except (TimeoutError, asyncio.CancelledError):
                self._task.cancel()
            self._task = None

    # -- what the node tells -----------------------------------------------------------------------
    def transition(self, sb: LiveSandbox, old: S, new: S) -> None:
        if new == S.KILLING:
            self._killing_from[sb.id] = old
            return
        if new == S.KILLED:
            began = self._killing_from.pop(sb.id, None)
            if began != S.CREATING:  # a create that failed made no sandbox to tell of
                self._add(sb, model.KILLED, self._execution(sb, began) | {"kill_reason": sb.kill_reason})
            return
        kind = ENDED.get((old, new))
        if kind is None:
            return
        data: dict[str, Any] = {}
        if kind in (model.CREATED, model.RESUMED):
            sb.execution_id, sb.execution_started = str(uuid.uuid4()), time.time()
        elif kind == model.PAUSED:
            data = self._execution(sb, old)
        self._add(sb, kind, data)

    def update(self, sb: LiveSandbox, change: dict[str, Any]) -> None:
        data: dict[str, Any] = {}
        if "end_at" in change:
            data["set_timeout"] = rfc3339(change["end_at"])
        if "network" in change:
            data["network_egress"] = _egress(change["network"], bool(change.get("internet")))
        if data:
            self._add(sb, model.UPDATED, data)

    # -- the words ---------------------------------------------------------------------------------
    def _execution(self, sb: LiveSandbox, was: S | None) -> dict[str, Any]:
        started = sb.execution_started or sb.rec.started_at
        ended = sb.rec.paused_at if was == S.PAUSED and sb.rec.paused_at >= started else time.time()
        limits = self.node.limits_of(sb.rec)
        return {
            "execution": {
                "started_at": rfc3339(started),
                "vcpu_count": max(1, round(limits.cpu_count)),
                "memory_mb": limits.memory_mb,
                "execution_time": max(0, int((ended - started) * 1000)),
            }
        }

    def _add(self, sb: LiveSandbox, kind: str, data: dict[str, Any]) -> None:
        rec = sb.rec
        if rec.metadata:
            data = {"sandbox_metadata": dict(rec.metadata)} | data
        if not sb.execution_id:  # known from before this process (a node restart, a takeover)
            sb.execution_id = str(uuid.uuid4())
        event = LifecycleEvent(
            id=model.new_id(),
            type=kind,
            timestamp=time.time(),
            sandbox_id=rec.id,
            team=rec.team or DEFAULT_TEAM,
            execution_id=sb.execution_id,
            template_id=rec.template_id,
            build_id=self._build_of(rec.template_id),
            data=data,
        )
        if len(self._pending) >= MAX_PENDING:
            del self._pending[:BATCH]
            log.warning("lifecycle events: the store is behind by %d events; the oldest were dropped", MAX_PENDING)
        self._pending.append(event)
        self._wake.set()

    def _build_of(self, template_id: str) -> str:
        try:
            return self.node.find_template(template_id).e2b_build_id()
        except Exception:  # a snapshot, or a template deleted since: no build to name
            return ""

    # -- the writer --------------------------------------------------------------------------------
    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                await self.flush()
            except Exception as exc:  # the store is down for now: keep them, try again
                if self._stopping:
                    log.warning("lifecycle events: %d not written as the node stops (%s)", len(self._pending), exc)
                    return
                log.warning("lifecycle events: could not write (%s); retrying", exc)
                await asyncio.sleep(1.0)
                self._wake.set()
                continue
            if self._stopping:
                return

    async def flush(self) -> None:
        while self._pending:
            batch = self._pending[:BATCH]
            await self.store.append(batch)
            del self._pending[: len(batch)]
            self.written()


def _egress(network: dict[str, Any], internet: bool) -> dict[str, list[str]]:
    """E2B's words for egress rules: addresses and domains allowed, addresses denied."""
    allowed = [str(x) for x in network.get("allowOut") or [] if isinstance(x, str)]
    denied = [str(x) for x in network.get("denyOut") or [] if isinstance(x, str)]
    if internet and not allowed:
        allowed = ["0.0.0.0/0"]
    return {
        "allowed_cidrs": [x for x in allowed if _is_cidr(x)],
        "denied_cidrs": [x for x in denied if _is_cidr(x)],
        "allowed_domains": [x for x in allowed if not _is_cidr(x)],
    }


def _is_cidr(value: str) -> bool:
    try:
        ipaddress.ip_network(value, strict=False)
    except ValueError:
        return False
    return True
