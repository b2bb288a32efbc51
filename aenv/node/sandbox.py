"""A sandbox as the node holds it in memory: its record, its instance and its agent link."""

from __future__ import annotations

import asyncio
import logging
import secrets
import string
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.channel import Stream
from aenv.errors import AenvError
from aenv.node.agentlink import AgentLink
from aenv.node.commands import CommandHistory
from aenv.node.egress import Guest
from aenv.node.events import SandboxEvents
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord
from aenv.runtime.base import Instance

log = logging.getLogger("aenv.node")
ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    return "".join(secrets.choice(ID_ALPHABET) for _ in range(20))


@dataclass
class LiveSandbox:
    rec: SandboxRecord
    instance: Instance | None = None
    link: AgentLink | None = None
    egress: Guest | None = None  # what its agent's link serves: its egress connections
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    ops: dict[str, asyncio.Task[Any]] = field(default_factory=dict)  # joinable operations by name
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)  # every operation in flight (a kill cancels them)
    killer: asyncio.Task[None] | None = None  # the kill in progress: nothing else starts any more
    commands: CommandHistory = field(default_factory=CommandHistory)  # its recent commands (envd's Start)
    events: SandboxEvents = field(default_factory=SandboxEvents)  # what happened to it, as the node saw
    # The tunnels of the HTTP requests to its ports that the node relays (request sent, answer not
    # all passed on while the tunnel has not ended): a pause lets them finish first, for a while.
    exchanges: weakref.WeakSet[Stream] = field(default_factory=weakref.WeakSet)
    opening: int = 0  # such requests (and envd's) that found it running and have not got their stream
    # Its commands' output streams (envd's process Start and Connect): a drain's move lets them end
    # too, for a while, as its clients are promised a pause only; a plain pause does not wait for them.
    streams: weakref.WeakSet[Stream] = field(default_factory=weakref.WeakSet)
    grace_of: float = 0.0  # the endAt whose grace period began (its commands but scoring ones stopped)
    # Its lifecycle events' words (aenv/events): this run's id and start (a create or a resume
    # begins one), and why a kill came ("request" unless something else says).
    execution_id: str = ""
    execution_started: float = 0.0
    kill_reason: str = "request"

    def exchanging(self, *, streams: bool = False) -> bool:
        # Once the port's END is in, what it sent is all on the host: a pause cannot cut it short.
        waited = [*self.exchanges, *(self.streams if streams else ())]
        return self.opening > 0 or any(not (s.ended or s.remote_ended) for s in waited)

    @property
    def id(self) -> str:
        return self.rec.id

    @property
    def state(self) -> SandboxState:
        return self.rec.state


@dataclass
class ForkResult:
    sandbox: SandboxRecord | None = None
    error: AenvError | None = None


def log_failure(sandbox_id: str, tasks: set[asyncio.Task[Any]]) -> Callable[[asyncio.Task[Any]], None]:
    def done(task: asyncio.Task[Any]) -> None:
        tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("timeout action on %s failed: %s", sandbox_id, task.exception())

    return done
