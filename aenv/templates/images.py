"""Templates from OCI images: pull, add the sandbox conventions in a layer of their own, commit.

The image needs nothing of ours (the agent brings its own runtime at /.aenv). What a sandbox
expects of its root filesystem (E2B's default user `user` with /home/user, /run/e2b, a hostname,
the statx shim for glibc programs) is written by the host into one small layer on top of the
image's layers, without running anything from the image.
"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

from aenv.images.local import is_local
from aenv.images.pull import ImagePull, Pulled, PullProgressFn, release
from aenv.images.reference import ImageRef
from aenv.node.service import BuildHost, TemplateRecord
from aenv.runtime.guestbundle import COMPAT_LIB, GUEST_MOUNT, SUDO
from aenv.storage.confined import View, remove_tree
from aenv.templates.builder import LogFn, commit_template

USER_UID = 1000
USER = (USER_UID, USER_UID)
# Where the runtime mounts its own file systems. An image without them would have the sandbox's
# boot make them in its upper: the build's upper would never be empty, and every image template
# would carry one more layer (and a first sandbox a copy of its upper) for four empty directories.
MOUNT_POINTS = ("/proc", "/sys", "/dev", GUEST_MOUNT)


def image_user(config: dict[str, Any]) -> str:
    """The user an image's processes run as by default (its config's ``User``: a name or uid,
    maybe with a group, which the sandbox's user lookup does not take), root when it names none."""
    return str(config.get("User") or "").partition(":")[0].strip() or "root"


def layers_view(node: BuildHost, layers: list[str], top: Path | None = None) -> View:
    """What a sandbox on ``layers`` sees, read by the host without following anything out of
    them; ``top`` is a new layer that writes go to."""
    return View([node.files.layer(layer_id) for layer_id in layers], top)


def conventions_layer(node: BuildHost, layers: list[str]) -> str:
    """Write the sandbox conventions for an image made of ``layers``; return the new layer id.

    Paths resolve as in the sandbox: an image whose /etc or /home is a link gets the files where
    the link leads, inside the image."""
    layer_id, root = node.files.new_layer_dir()
    try:
        _write_conventions(layers_view(node, layers, root))
    except BaseException:
        remove_tree(root, ignore_errors=True)
        raise
    return layer_id


def _write_conventions(view: View) -> None:
    passwd = (view.read("/etc/passwd") or b"root:x:0:0:root:/root:/bin/sh\n").decode(errors="replace")
    group = (view.read("/etc/group") or b"root:x:0:\n").decode(errors="replace")
    shell = "/bin/bash" if view.stat("/bin/bash", follow=False) is not None else "/bin/sh"
    if not any(line.startswith("user:") for line in passwd.splitlines()):
        passwd = passwd.rstrip("\n") + f"\nuser:x:{USER_UID}:{USER_UID}:user:/home/user:{shell}\n"
    if not any(line.startswith("user:") for line in group.splitlines()):
        group = group.rstrip("\n") + f"\nuser:x:{USER_UID}:\n"
    view.write_file("/etc/passwd", passwd.encode(), 0o644)
    view.write_file("/etc/group", group.encode(), 0o644)
    view.write_file("/etc/hostname", b"sandbox\n", 0o644)
    view.write_file("/etc/hosts", b"127.0.0.1 localhost sandbox\n::1 localhost ip6-localhost\n", 0o644)
    if view.glob("/lib*/ld-linux*") or view.glob("/usr/lib*/ld-linux*"):
        # glibc only reads it (musl ignores the file), and only glibc programs need the shim
        preload = (view.read("/etc/ld.so.preload") or b"").decode(errors="replace")
        if COMPAT_LIB not in preload:
            view.write_file("/etc/ld.so.preload", (preload + COMPAT_LIB + "\n").encode(), 0o644)
    view.make_dir("/home/user", attrs=(0o755, *USER))
    if view.stat("/root", follow=False) is None:
        view.make_dir("/root", attrs=(0o700, 0, 0))  # commands start in their user's home
    view.make_dir("/run/e2b")
    for point in MOUNT_POINTS:
        if view.stat(point, follow=False) is None:
            view.make_dir(point, attrs=(0o755, 0, 0))
    usr_bin = view.stat("/usr/bin")
    if usr_bin is None or stat.S_ISDIR(usr_bin.st_mode):
        # sudo through the agent (aenv.guest.sudo): an image's setuid sudo cannot work in gVisor
        view.symlink("/usr/bin/sudo", SUDO)


async def template_from_image(
    node: BuildHost,
    name: str,
    reference: str,
    *,
    login: tuple[str, str] | None = None,
    on_log: LogFn | None = None,
    on_progress: PullProgressFn | None = None,
) -> TemplateRecord:
    """Pull ``reference`` and commit it as template ``name`` (its env and user conventions kept)."""
    async with ImagePull(node, reference, login=login, on_log=on_log, on_progress=on_progress) as job:
        return await commit_image(node, job, name, canonical_reference(reference), on_log=on_log)


def canonical_reference(reference: str) -> str:
    """How a reference is recorded and matched: Docker Hub's shorthand spelled out
    (``python:3.12-slim`` is ``registry-1.docker.io/library/python:3.12-slim``), a local
    import as written. A reference that is none is a 400."""
    reference = reference.strip()
    return reference if is_local(reference) else str(ImageRef.parse(reference))


async def commit_image(
    node: BuildHost,
    job: ImagePull,
    name: str,
    reference: str,
    *,
    aliases: tuple[str, ...] = (),
    on_log: LogFn | None = None,
    template_id: str = "",
    public: bool = False,
    keep_first: bool = False,
) -> TemplateRecord:
    """Bring in the layers of the image ``job`` pulls, add the sandbox conventions and commit it
    as template ``name`` (id ``template_id``, else a new one), recorded as made from
    ``reference`` (canonical) and the manifest's digest, with ``aliases``. What a failure made is
    removed: the conventions layer, the build sandbox, its upper and image (pulled layers stay:
    whole and verified, a cache). ``keep_first``: a create waits for it, and takes the sandbox
    the template is snapshotted from (aenv/templates/builder.py)."""
    log = on_log or (lambda line: None)
    pulled: Pulled | None = None
    try:
        pulled = await job.fetch_layers()
        extra = await asyncio.to_thread(conventions_layer, node, pulled.layers)
        config = pulled.config.get("config") or {}
        env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
        # Docker's defaults: the image's user (root when it names none) in its working directory
        user, workdir = image_user(config), str(config.get("WorkingDir") or "/")
        log(f"pulled {pulled.fetched_bytes / 2**20:.1f} MiB ({pulled.cached_layers} layers cached); committing")
        unpinned = ImageRef(pulled.ref.registry, pulled.ref.repository, pulled.ref.tag)  # its digest said once
        try:
            rec = await commit_template(
                node,
                name=name,
                layers=[*pulled.layers, extra],
                steps=[],
                env=env,
                user=user,
                workdir=workdir,
                description=f"from {unpinned}@{pulled.digest}",
                on_log=log,
                template_id=template_id,
                keep_first=keep_first,
            )
        except BaseException:
            await node.files.remove(extra)
            raise
        rec.image_ref, rec.image_digest = reference, pulled.digest
        rec.image_layers = pulled.sizes
        rec.aliases = sorted({*rec.aliases, *aliases} - {rec.name})
        rec.public = public  # pulled with the node's own logins: any team could make it (aenv/teams)
        await node.save_template(rec)
        return rec
    finally:
        if pulled is not None:
            release(node, pulled)
