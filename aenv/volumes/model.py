"""A volume's record, and the names and paths the API takes."""

from __future__ import annotations

import posixpath
import re
import secrets
import time
import uuid
from dataclasses import dataclass
from typing import Any

from aenv.errors import InvalidRequest

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
MAX_MOUNTS = 8
# Where a volume may not be mounted: the system's own trees, the agent's bundle, the root.
RESERVED = ("/proc", "/sys", "/dev", "/.aenv", "/run/aenv", "/etc", "/bin", "/sbin", "/usr", "/lib", "/lib64")


@dataclass(frozen=True, slots=True)
class Volume:
    id: str
    name: str
    team: str
    token: str  # the content API's bearer token (E2B's ``token``)
    created_at: float

    @classmethod
    def new(cls, name: str, team: str) -> Volume:
        return cls(str(uuid.uuid4()), name, team, secrets.token_urlsafe(32), time.time())

    def api(self, *, with_token: bool = True) -> dict[str, Any]:
        body: dict[str, Any] = {"volumeID": self.id, "name": self.name}
        if with_token:
            body["token"] = self.token
        return body

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "name": self.name, "team": self.team, "token": self.token, "createdAt": self.created_at}

    @classmethod
    def from_json(cls, body: dict[str, Any]) -> Volume:
        return cls(str(body["id"]), str(body["name"]), str(body["team"]), str(body["token"]), float(body["createdAt"]))


def check_name(name: str) -> str:
    if not NAME.fullmatch(name):
        raise InvalidRequest(
            f"volume name {name[:140]!r}: 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit"
        )
    return name


def check_mount_path(path: str) -> str:
    """An absolute, normal path a volume may be mounted at."""
    if not isinstance(path, str) or not path.startswith("/") or len(path) > 512 or "\0" in path:
        raise InvalidRequest(f"volume mount path {str(path)[:140]!r} must be an absolute path")
    normal = posixpath.normpath(path)
    if normal != path.rstrip("/") or normal == "/" or "/../" in f"{path}/" or "/./" in f"{path}/":
        raise InvalidRequest(f"volume mount path {path[:140]!r} must be a normal path other than /")
    if any(normal == r or normal.startswith(r + "/") for r in RESERVED):
        raise InvalidRequest(f"volume mount path {normal[:140]!r} is a system directory")
    return normal
