"""The node's sandboxes as records: lookups and lists, the one checked state change (which persists
the record and tells the listeners), each sandbox's limits, credentials and usage, and the node's
load (capacity).

The ``Records`` part of ``Node`` (aenv/node/orchestrator.py).
"""

from __future__ import annotations

from typing import Any

from aenv.errors import SandboxNotFound
from aenv.node import tokens
from aenv.node.egress import EgressPolicy
from aenv.node.sandbox import LiveSandbox
from aenv.node.service import Capacity
from aenv.node.state import PUBLIC_STATE, SandboxState, check_transition
from aenv.node.store import SandboxRecord
from aenv.node.usage import History
from aenv.runtime.base import Limits

S = SandboxState


class Records:
    def get(self, sandbox_id: str) -> LiveSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == S.KILLED:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return sb

    def list(self, *, states: set[str] | None = None, metadata: dict[str, str] | None = None) -> list[LiveSandbox]:
        out = []
        for sb in self.sandboxes.values():
            if sb.state == S.KILLED:
                continue
            if states and sb.state.value not in states and _public(sb.state) not in states:
                continue
            if metadata and any(sb.rec.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(sb)
        return sorted(out, key=lambda s: s.rec.started_at, reverse=True)

    async def _set_state(self, sb: LiveSandbox, target: SandboxState, *, persist: bool = True) -> None:
        check_transition(sb.id, sb.state, target)
        sb.events.transition(sb.state, target)
        sb.rec.state = target
        if persist:
            await self.store.put_sandbox(sb.rec)
        for listener in self.state_listeners:
            listener(sb)

    def limits_of(self, rec: SandboxRecord) -> Limits:
        return self._limits_from(rec.limits)

    def _limits_from(self, overrides: dict[str, Any]) -> Limits:
        s = self.settings
        base = {"cpu_count": s.cpu_count, "memory_mb": s.memory_mb, "nproc": s.nproc, "disk_mb": s.disk_mb}
        base.update({k: v for k, v in overrides.items() if k in base and v is not None})
        return Limits(**base)

    def policy_of(self, sandbox_id: str) -> EgressPolicy:
        rec = self.get(sandbox_id).rec
        return EgressPolicy.of(rec.allow_internet_access, rec.network)

    def usage_of(self, sandbox_id: str) -> History | None:
        """The sandbox's sampled resource usage (None before its first sample)."""
        return self.usage_history.of(sandbox_id)

    def capacity(self) -> Capacity:
        running = paused = starting = memory = 0
        cpu = used = 0.0
        for sb in list(self.sandboxes.values()):
            if sb.state == S.PAUSED:
                paused += 1
                continue
            limits = self.limits_of(sb.rec)
            if sb.state == S.RUNNING:
                running += 1
                history = self.usage_history.of(sb.id)
                sample = history.latest() if history is not None else None
                used += sample.cpu_used_pct / 100 * limits.cpu_count if sample is not None else 0.0
            else:
                starting += 1
            cpu += limits.cpu_count
            memory += limits.memory_mb
        return Capacity(
            running, paused, starting, self.settings.max_sandboxes, round(cpu, 3), memory, cpu_used=round(used, 3)
        )

    def access_token(self, sandbox_id: str) -> str:
        return tokens.access_token(self._secret, sandbox_id)

    def traffic_token(self, sandbox_id: str) -> str:
        return tokens.traffic_token(self._secret, sandbox_id)

    @property
    def token_secret(self) -> str:
        """The secret every sandbox's tokens derive from (64 hex digits)."""
        return self._secret.decode()

    async def use_token_secret(self, secret: str) -> None:
        """Derive tokens from ``secret`` from now on (the cluster's), kept for later starts too."""
        await self.store.set_meta("token_secret", secret)
        self._secret = secret.encode()


def _public(state: SandboxState) -> str:
    return PUBLIC_STATE[state]
