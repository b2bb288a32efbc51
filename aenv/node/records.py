"""The node's sandboxes as records: lookups and lists, the one checked state change (which persists
the record and tells the listeners), each sandbox's limits, timeout, network rules, credentials and
usage, and the node's load (capacity).

``Records`` owns the table of live sandboxes (``sandboxes``) and the state listeners; ``Node``
(aenv/node/orchestrator.py) makes it and hands it to the parts that look sandboxes up.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from typing import Any

from aenv.config import Settings
from aenv.errors import SandboxNotFound
from aenv.node import tokens
from aenv.node.admission import check_timeout
from aenv.node.egress import EgressPolicy
from aenv.node.sandbox import LiveSandbox
from aenv.node.service import Capacity
from aenv.node.state import PUBLIC_STATE, SandboxState, check_transition
from aenv.node.store import SandboxRecord, Store
from aenv.node.usage import History, UsageHistory
from aenv.runtime.base import Limits

S = SandboxState


class Records:
    def __init__(self, settings: Settings, store: Store, usage_history: UsageHistory) -> None:
        self.settings = settings
        self.store = store
        self.usage_history = usage_history
        self.sandboxes: dict[str, LiveSandbox] = {}
        # Called (synchronously; they must not block or raise) after every state change of a
        # sandbox, KILLED included: the cluster agent keeps the directory from them.
        self.state_listeners: list[Callable[[LiveSandbox], None]] = []
        # The same, told the state left too; and told of a change of a running sandbox that is
        # not a state's (a new timeout, new egress rules) with what changed: lifecycle events.
        self.transition_listeners: list[Callable[[LiveSandbox, SandboxState, SandboxState], None]] = []
        self.update_listeners: list[Callable[[LiveSandbox, dict[str, Any]], None]] = []
        self._secret = b""

    def get(self, sandbox_id: str) -> LiveSandbox:
        sb = self.sandboxes.get(sandbox_id)
        if sb is None or sb.state == S.KILLED:
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return sb

    def list(self, *, states: set[str] | None = None, metadata: dict[str, str] | None = None) -> list[LiveSandbox]:
        out: list[LiveSandbox] = []
        for sb in self.sandboxes.values():
            if sb.state == S.KILLED:
                continue
            if states and sb.state.value not in states and _public(sb.state) not in states:
                continue
            if metadata and any(sb.rec.metadata.get(k) != v for k, v in metadata.items()):
                continue
            out.append(sb)
        return sorted(out, key=lambda s: s.rec.started_at, reverse=True)

    async def set_state(self, sb: LiveSandbox, target: SandboxState, *, persist: bool = True) -> None:
        check_transition(sb.id, sb.state, target)
        old = sb.state
        sb.events.transition(old, target)
        sb.rec.state = target
        if persist:
            await self.store.put_sandbox(sb.rec)
        for listener in self.state_listeners:
            listener(sb)
        for told in self.transition_listeners:
            told(sb, old, target)

    def updated(self, sb: LiveSandbox, change: dict[str, Any]) -> None:
        """Tell the update listeners of a change of a running sandbox that is not a state's."""
        for listener in self.update_listeners:
            listener(sb, change)

    def limits_of(self, rec: SandboxRecord) -> Limits:
        return self.limits_from(rec.limits)

    def limits_from(self, overrides: dict[str, Any]) -> Limits:
        s = self.settings
        base: dict[str, Any] = {
            "cpu_count": s.cpu_count,
            "memory_mb": s.memory_mb,
            "nproc": s.nproc,
            "disk_mb": s.disk_mb,
        }
        base.update({k: v for k, v in overrides.items() if k in base and v is not None})
        return Limits(**base)

    def policy_of(self, sandbox_id: str) -> EgressPolicy:
        rec = self.get(sandbox_id).rec
        return EgressPolicy.of(rec.allow_internet_access, rec.network)

    async def set_network(self, sandbox_id: str, network: dict[str, Any], internet: bool | None = None) -> None:
        """Replace a sandbox's egress rules: connections made from now on follow them, and open
        connections they no longer allow are ended."""
        sb = self.get(sandbox_id)
        internet = sb.rec.allow_internet_access if internet is None else internet
        EgressPolicy.of(internet, network)
        sb.rec.network, sb.rec.allow_internet_access = dict(network), internet
        await self.store.put_sandbox(sb.rec)
        if sb.egress is not None:
            sb.egress.recheck()
        self.updated(sb, {"network": sb.rec.network, "internet": internet})

    async def set_timeout(self, sandbox_id: str, timeout: int) -> SandboxRecord:
        """The sandbox expires ``timeout`` seconds from now; 0 expires it now (E2B's minimum), so
        the reaper pauses or kills it at its next round."""
        sb = self.get(sandbox_id)
        timeout = 0 if type(timeout) is int and timeout == 0 else check_timeout(self.settings, timeout)
        sb.rec.end_at = time.time() + timeout
        if timeout:  # 0 ends this run; its resumes get the lease it had
            sb.rec.timeout = timeout
        await self.store.put_sandbox(sb.rec)
        self.updated(sb, {"end_at": sb.rec.end_at})
        return sb.rec

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

    async def load_token_secret(self) -> None:
        """The secret kept in the store, made at a node's first start."""
        secret = await self.store.get_meta("token_secret")
        if secret is None:
            secret = secrets.token_hex(32)
            await self.store.set_meta("token_secret", secret)
        self._secret = secret.encode()

    async def use_token_secret(self, secret: str) -> None:
        """Derive tokens from ``secret`` from now on (the cluster's), kept for later starts too."""
        await self.store.set_meta("token_secret", secret)
        self._secret = secret.encode()


def _public(state: SandboxState) -> str:
    return PUBLIC_STATE[state]
