"""Whether a new or resumed sandbox may start here now: the node's room (``AENV_MAX_SANDBOXES`` and
the host's free memory), its team's quotas, the admission checks the cluster agent adds, and the
timeouts a request may name.

``Admission`` reads the cluster agent's and the teams' hooks through ``Hooks``, a narrow view of
the node (``Node`` sets them; they are read at each call, so setting one later takes effect).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from aenv.config import Settings
from aenv.errors import InvalidRequest, LimitExceeded, QuotaExceeded
from aenv.node.sandbox import LiveSandbox
from aenv.node.state import SandboxState
from aenv.node.store import SandboxRecord
from aenv.node.warmpool import memory_available_mb

S = SandboxState


class Hooks(Protocol):
    """What others set on a node for its operations to ask (aenv/node/service.py says what each is)."""

    @property
    def admission_checks(self) -> list[Callable[[], None]]: ...

    @property
    def team_room(self) -> Callable[[SandboxRecord, int], tuple[int, str]] | None: ...

    @property
    def adopter(self) -> Callable[[str, bool], Awaitable[None]] | None: ...

    @property
    def resume_guard(self) -> Callable[[str], Awaitable[None]] | None: ...

    @property
    def wake_refusal(self) -> Callable[[LiveSandbox], str | None] | None: ...


class Admission:
    def __init__(self, settings: Settings, sandboxes: Mapping[str, LiveSandbox], hooks: Hooks) -> None:
        self.settings = settings
        self.sandboxes = sandboxes
        self.hooks = hooks

    def admit(self) -> None:
        for check in self.hooks.admission_checks:
            check()

    def check_room(self, rec: SandboxRecord | None = None) -> None:
        """Room for one more running sandbox, and for ``rec`` in its team's quota (429 if not)."""
        room, limit = self.room()
        if room == 0:
            raise LimitExceeded(limit)
        if rec is not None and self.team_room(rec, 1)[0] < 1:
            raise QuotaExceeded(self.team_room(rec, 1)[1], retry_after=1)

    def team_room(self, rec: SandboxRecord, wanted: int) -> tuple[int, str]:
        """How many sandboxes like ``rec`` its team's quotas let start now (aenv/teams/quotas.py)."""
        team_room = self.hooks.team_room
        if team_room is None:
            return wanted, ""
        return team_room(rec, wanted)

    def room(self) -> tuple[int, str]:
        """How many more sandboxes this node may run now, and the limit that stops the next one."""
        available = memory_available_mb()
        if available is not None and available < self.settings.min_free_memory_mb:
            return 0, (
                f"this node's host has {available} MiB of memory available, "
                f"less than the {self.settings.min_free_memory_mb} MiB it keeps free"
            )
        live = sum(1 for sb in self.sandboxes.values() if sb.state != S.PAUSED)
        most = self.settings.max_sandboxes
        return max(0, most - live), f"this node runs at most {most} sandboxes"

    def check_timeout(self, timeout: int | None) -> int:
        return check_timeout(self.settings, timeout)

    def own_timeout(self, rec: SandboxRecord) -> int:
        return own_timeout(self.settings, rec)


def check_timeout(settings: Settings, timeout: int | None) -> int:
    if timeout is None:
        return settings.default_timeout
    if isinstance(timeout, bool) or not isinstance(timeout, int) or timeout <= 0:
        raise InvalidRequest("timeout must be a positive number of seconds")
    if timeout > settings.max_timeout:
        raise InvalidRequest(f"timeout may be at most {settings.max_timeout} seconds")
    return timeout


def own_timeout(settings: Settings, rec: SandboxRecord) -> int:
    """The lease a resume that names none gives: the one the sandbox was last given (a
    record from another node's repository entry is checked as a request's would be)."""
    own = rec.timeout
    return own if type(own) is int and 0 < own <= settings.max_timeout else settings.default_timeout
