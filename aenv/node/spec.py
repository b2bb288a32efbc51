"""What a create asks of its sandbox, beyond the template: one value from the API to the node."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class SandboxSpec:
    """A create's settings, as the API checked their shapes; the node checks their values
    (timeout and grace bounds, egress rules, lifecycle combinations) against its settings."""

    timeout: int | None = None  # seconds; None: the node's default
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)  # over the template's
    auto_pause: bool = False  # E2B's lifecycle onTimeout "pause"
    auto_resume: bool = False  # traffic wakes it when paused
    auto_pause_memory: bool = True  # a timeout's pause keeps memory (else files only)
    limits: dict[str, Any] = field(default_factory=dict)  # over the template's
    allow_internet_access: bool | None = None  # None: the node's default
    network: dict[str, Any] = field(default_factory=dict)  # egress rules (E2B's network object)
    secure: bool = True  # envd calls need the sandbox's access token
    public_traffic: bool = True  # its ports answer without the traffic token
    mask_request_host: str = ""  # the Host its ports see (E2B's maskRequestHost)
    grace: int = 0  # seconds after the timeout when only scoring commands run
    volume_mounts: list[dict[str, str]] = field(default_factory=list)  # checked: {"name", "path", "id"}


DEFAULT_SPEC = SandboxSpec()  # (frozen: safe as a shared default)


class VolumeClones(Protocol):
    """A fork's own copies of its source's volumes (aenv/volumes/clones.py): one copy of each taken
    while the source is stopped for its checkpoint (the moment its children start from), then one
    per further child made from that copy once the source runs again."""

    async def capture(self, first_child: str) -> None: ...

    async def spread(self, children: list[str]) -> None: ...

    def mounts_of(self, child: str) -> list[dict[str, str]]: ...

    async def drop(self, child: str) -> None: ...
