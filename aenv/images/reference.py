"""Image references as Docker and OCI tools write them: ``[registry/]repo[:tag][@digest]``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from aenv.errors import InvalidRequest

DOCKER_HUB = "registry-1.docker.io"
COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")  # OCI's: ASCII (\w would take any letter)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
# A host name or an IPv6 address in brackets, and a port: nothing that would change the URL made of it.
REGISTRY = re.compile(
    r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?)*|\[[0-9a-fA-F:.]+\])(?::[0-9]{1,5})?"
)


@dataclass(frozen=True)
class ImageRef:
    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @property
    def reference(self) -> str:
        """What goes after /manifests/: the digest when pinned, else the tag."""
        return self.digest or self.tag or "latest"

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}"
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    @classmethod
    def parse(cls, text: str) -> ImageRef:
        rest, digest = text.strip(), None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if not DIGEST.fullmatch(digest):
                raise InvalidRequest(f"image reference {text!r}: bad digest {digest!r}")
        tag = None
        slash = rest.rfind("/")
        if ":" in rest[slash + 1 :]:
            rest, tag = rest.rsplit(":", 1)
            if not TAG.fullmatch(tag):
                raise InvalidRequest(f"image reference {text!r}: bad tag {tag!r}")
        first, _, remainder = rest.partition("/")
        if remainder and ("." in first or ":" in first or first == "localhost"):
            registry, repository = first, remainder
            if not REGISTRY.fullmatch(registry):
                raise InvalidRequest(f"image reference {text!r}: bad registry {registry!r}")
        else:
            registry, repository = DOCKER_HUB, rest
        if registry.lower() in ("docker.io", "index.docker.io", DOCKER_HUB):  # Docker Hub's names for itself
            registry = DOCKER_HUB
            if "/" not in repository:
                repository = f"library/{repository}"
        if not repository or not all(COMPONENT.fullmatch(part) for part in repository.split("/")):
            raise InvalidRequest(f"image reference {text!r}: bad repository name {repository!r}")
        return cls(registry, repository, tag if tag or digest else "latest", digest)
