"""User lookup from the sandbox's own /etc/passwd and /etc/group (no NSS, stdlib only)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from aenv.guest.safeio import read_small


class UnknownUser(LookupError):
    pass


@dataclass(frozen=True, slots=True)
class User:
    name: str
    uid: int
    gid: int
    home: str
    shell: str
    groups: tuple[int, ...]


def _read(path: str) -> list[list[str]]:
    """The rows of a colon-separated file; whatever the sandbox put at the path (a FIFO, a link
    to /dev/zero) is read without blocking and only up to a bound."""
    try:
        text = read_small(path).decode("utf-8", errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.split("\n") if line.strip() and not line.startswith("#")]


_cache: dict[str, tuple[tuple[float, float], User]] = {}


def _stamp() -> tuple[float, float]:
    stamps = []
    for path in ("/etc/passwd", "/etc/group"):
        try:
            stamps.append(os.stat(path).st_mtime)
        except OSError:
            stamps.append(0.0)
    return stamps[0], stamps[1]


def lookup(name: str) -> User:
    """Cached while /etc/passwd and /etc/group are unchanged (parsing them costs ~1 ms in gVisor)."""
    stamp = _stamp()
    hit = _cache.get(name)
    if hit is not None and hit[0] == stamp:
        return hit[1]
    user = _lookup(name)
    _cache[name] = (stamp, user)
    return user


def _lookup(name: str) -> User:
    for row in _read("/etc/passwd"):
        if len(row) >= 7 and (row[0] == name or (name.isdigit() and row[2] == name)):
            gid = int(row[3])
            extra = tuple(
                int(g[2]) for g in _read("/etc/group") if len(g) >= 4 and row[0] in g[3].split(",") and g[2].isdigit()
            )
            return User(row[0], int(row[2]), gid, row[5] or "/", row[6] or "/bin/sh", tuple(sorted({gid, *extra})))
    if name == "root":
        return User("root", 0, 0, "/root", "/bin/sh", (0,))
    if name.isdigit() and int(name) < 2**31:  # a uid the image's passwd lacks: Docker runs it all the same
        return User(name, int(name), 0, "/", "/bin/sh", (0,))
    raise UnknownUser(f"user '{name}' does not exist in the sandbox")


_names: dict[str, tuple[float, dict[str, str]]] = {}


def _id_names(path: str) -> dict[str, str]:
    """id -> name from /etc/passwd or /etc/group, parsed again only when the file changes: every
    entry of a listing and every event of a watch names its owner and group."""
    try:
        mtime = os.stat(path).st_mtime
    except OSError:
        mtime = 0.0
    hit = _names.get(path)
    if hit is None or hit[0] != mtime:
        table: dict[str, str] = {}
        for row in _read(path):
            if len(row) >= 3:
                table.setdefault(row[2], row[0])
        hit = _names[path] = (mtime, table)
    return hit[1]


def name_of_uid(uid: int) -> str:
    return _id_names("/etc/passwd").get(str(uid), str(uid))


def name_of_gid(gid: int) -> str:
    return _id_names("/etc/group").get(str(gid), str(gid))
