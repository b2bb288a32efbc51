"""Templates from OCI images: pull, add the sandbox conventions in a layer of their own, commit.

The image needs nothing of ours (the agent brings its own runtime at /.aenv). What a sandbox
expects of its root filesystem (E2B's default user `user` with /home/user, /run/e2b, a hostname,
the statx shim for glibc programs) is written by the host into one small layer on top of the
image's layers, without running anything from the image.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from aenv.images.pull import Pulled, pull, release
from aenv.node.orchestrator import Node
from aenv.node.store import TemplateRecord
from aenv.runtime.guestbundle import COMPAT_LIB, SUDO
from aenv.templates.builder import LogFn, commit_template

USER_UID = 1000


def find_in_layers(node: Node, layers: list[str], path: str) -> tuple[Path, os.stat_result] | None:
    """Where the overlay of ``layers`` finds ``path`` (top layer wins), and what is there."""
    for layer_id in reversed(layers):
        candidate = node.files.layer(layer_id) / path.lstrip("/")
        try:
            return candidate, os.lstat(candidate)
        except FileNotFoundError:
            continue
    return None


def read_from_layers(node: Node, layers: list[str], path: str) -> bytes | None:
    """The regular file at ``path`` as the overlay of ``layers`` shows it (a whiteout hides it)."""
    found = find_in_layers(node, layers, path)
    if found is None or not stat.S_ISREG(found[1].st_mode):
        return None
    return found[0].read_bytes()


def stat_in_layers(node: Node, layers: list[str], path: str) -> os.stat_result | None:
    """What the overlay of ``layers`` shows at ``path``, or None."""
    found = find_in_layers(node, layers, path)
    return found[1] if found is not None else None


def dir_in_layers(node: Node, layers: list[str], path: str) -> bool:
    found = stat_in_layers(node, layers, path)
    return found is not None and stat.S_ISDIR(found.st_mode)


def make_dirs(node: Node, layers: list[str], root: Path, path: str, owner: tuple[int, int] = (0, 0)) -> Path:
    """Create ``path`` and its parents in the new layer ``root``.

    A directory that the lower layers already have is created with their mode and owner: in an
    overlay the top layer's copy of a directory decides them, and must not change them. New ones
    get ``owner`` and mode 0755."""
    here, rel = root, ""
    for part in [p for p in path.split("/") if p]:
        rel = f"{rel}/{part}"
        here = here / part
        if here.is_dir():
            continue
        below = stat_in_layers(node, layers, rel)
        here.mkdir()
        if below is not None and stat.S_ISDIR(below.st_mode):
            os.chmod(here, stat.S_IMODE(below.st_mode))
            os.lchown(here, below.st_uid, below.st_gid)
        else:
            os.chmod(here, 0o755)
            os.lchown(here, *owner)
    return here


def _exists_in_layers(node: Node, layers: list[str], pattern: str) -> bool:
    return any(list((node.files.layer(layer_id)).glob(pattern)) for layer_id in layers)


def conventions_layer(node: Node, layers: list[str]) -> str:
    """Write the sandbox conventions for an image made of ``layers``; return the new layer id."""
    layer_id, root = node.files.new_layer_dir()
    passwd = (read_from_layers(node, layers, "etc/passwd") or b"root:x:0:0:root:/root:/bin/sh\n").decode()
    group = (read_from_layers(node, layers, "etc/group") or b"root:x:0:\n").decode()
    shell = "/bin/bash" if _exists_in_layers(node, layers, "bin/bash") else "/bin/sh"
    etc = make_dirs(node, layers, root, "etc")
    if not any(line.startswith("user:") for line in passwd.splitlines()):
        passwd = passwd.rstrip("\n") + f"\nuser:x:{USER_UID}:{USER_UID}:user:/home/user:{shell}\n"
    if not any(line.startswith("user:") for line in group.splitlines()):
        group = group.rstrip("\n") + f"\nuser:x:{USER_UID}:\n"
    _write(etc / "passwd", passwd)
    _write(etc / "group", group)
    _write(etc / "hostname", "sandbox\n")
    _write(etc / "hosts", "127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n")
    if _exists_in_layers(node, layers, "lib*/ld-linux*") or _exists_in_layers(node, layers, "usr/lib*/ld-linux*"):
        # glibc only reads it (musl ignores the file), and only glibc programs need the shim
        preload = (read_from_layers(node, layers, "etc/ld.so.preload") or b"").decode()
        if COMPAT_LIB not in preload:
            _write(etc / "ld.so.preload", preload + COMPAT_LIB + "\n")
    make_dirs(node, layers, root, "home")
    os.chown(make_dirs(node, layers, root, "home/user", owner=(USER_UID, USER_UID)), USER_UID, USER_UID)
    if not _exists_in_layers(node, layers, "root"):
        (root / "root").mkdir(mode=0o700)  # commands start in their user's home
    make_dirs(node, layers, root, "run/e2b")
    if stat_in_layers(node, layers, "usr/bin") is None or dir_in_layers(node, layers, "usr/bin"):
        # sudo through the agent (aenv.guest.sudo): an image's setuid sudo cannot work in gVisor
        os.symlink(SUDO, make_dirs(node, layers, root, "usr/bin") / "sudo")
    return layer_id


def _write(path: Path, text: str) -> None:
    """A file every user of the sandbox reads (the node's own umask is 077)."""
    path.write_text(text)
    os.chmod(path, 0o644)


async def template_from_image(
    node: Node, name: str, reference: str, *, login: tuple[str, str] | None = None, on_log: LogFn | None = None
) -> TemplateRecord:
    """Pull ``reference`` and commit it as template ``name`` (its env and user conventions kept)."""
    log = on_log or (lambda line: None)
    pulled: Pulled | None = None
    try:
        pulled = await pull(node, reference, login=login, on_log=log)
        extra = conventions_layer(node, pulled.layers)
        config = pulled.config.get("config") or {}
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        log(f"pulled {pulled.fetched_bytes / 2**20:.1f} MiB ({pulled.cached_layers} layers cached); committing")
        return await commit_template(
            node,
            name=name,
            layers=[*pulled.layers, extra],
            steps=[],
            env=env,
            description=f"from {pulled.ref}@{pulled.digest}",
            on_log=log,
        )
    finally:
        if pulled is not None:
            release(node, pulled)
