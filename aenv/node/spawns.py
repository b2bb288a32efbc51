"""How often each template was used, for E2B's Template model (``spawnCount``, ``lastSpawnedAt``):
a sandbox counts once, when it first runs (a create, a fork child, a warm pool's). Kept in memory
by the node that ran it: a count since the node started, not a history."""

from __future__ import annotations

import time
from dataclasses import dataclass

from aenv.node.sandbox import LiveSandbox
from aenv.node.state import SandboxState


@dataclass
class Spawned:
    count: int = 0
    last: float = 0.0


class Spawns:
    def __init__(self) -> None:
        self.of: dict[str, Spawned] = {}  # by template id or name, as the sandbox records it
        self._counted: set[str] = set()  # sandboxes counted and not gone yet

    def observe(self, sb: LiveSandbox) -> None:
        """A node state listener."""
        if sb.state == SandboxState.KILLED:
            self._counted.discard(sb.id)
        elif sb.state == SandboxState.RUNNING and sb.id not in self._counted:
            self._counted.add(sb.id)
            spawned = self.of.setdefault(sb.rec.template_id, Spawned())
            spawned.count += 1
            spawned.last = time.time()

    def get(self, *keys: str) -> Spawned:
        """The uses under any of ``keys`` (a template's id and its name) together."""
        found = [self.of[k] for k in dict.fromkeys(keys) if k in self.of]
        return Spawned(sum(s.count for s in found), max((s.last for s in found), default=0.0))
