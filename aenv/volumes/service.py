"""A deployment's volumes: their records (aenv/volumes/store.py), their directories on the host,
and what a create's ``volumeMounts`` become.

A volume is the directory ``<volumes_dir>/<volume id>/data``: on a node alone (as root), the root
of its own ext4 image of ``AENV_VOLUME_SIZE_MB`` (``<id>.img``, loop-mounted at ``<id>/`` nosuid,
nodev, noexec), so a sandbox that fills it gets ENOSPC and never the host's disk; in a cluster, or
with a size of 0, a plain directory. A sandbox that mounts it has it bound at
the path it asked for, read-write, shared live with every other sandbox (and fork child) that
mounts it and with the content API. It is not part of a sandbox's upper, so no pause, snapshot or
template commit carries it: a resume, anywhere, mounts the volume as it is then. In a cluster the
records are in etcd and ``AENV_VOLUMES_DIR`` must be one shared directory (NFS or similar) at the
same path on every node; its consistency is that file system's, and its size limit the operator's
(an ext4 image cannot be mounted by two hosts at once).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

from aenv.config import Settings
from aenv.errors import Conflict, InvalidRequest, NotFound, QuotaExceeded, RuntimeFailure
from aenv.node.service import NodeService
from aenv.node.state import SandboxState
from aenv.runtime import hostexec
from aenv.storage.confined import chown_at, remove_tree
from aenv.storage.layers import MKFS, MKFS_SECONDS
from aenv.storage.space import ensure_space, headroom
from aenv.volumes.files import USER, VolumeFiles
from aenv.volumes.model import MAX_MOUNTS, Volume, check_mount_path, check_name
from aenv.volumes.store import EtcdVolumeStore, NameTaken, SqliteVolumeStore, VolumeStore

log = logging.getLogger("aenv.volumes")
COPY_SECONDS = 1800.0  # one copy of a volume (a fork's): a 10 GiB image at a slow disk's ~10 MB/s
GOING = frozenset({SandboxState.KILLING, SandboxState.KILLED})  # a kill under way holds no volume


class Volumes:
    def __init__(self, node: NodeService, store: VolumeStore | None = None) -> None:
        settings: Settings = node.settings
        self.node = node
        self.root = settings.volumes_dir or settings.data_dir / "volumes"
        if store is None:
            store = _store_of(settings)
        self.store = store
        self.size_mb = 0
        self.images = False  # each volume its own ext4 image (set at start)

    async def start(self) -> None:
        settings = self.node.settings
        self.size_mb = settings.volume_size_mb
        self.images = not settings.cluster and self.size_mb > 0 and os.geteuid() == 0
        await self.store.open()
        await asyncio.to_thread(_make_root, self.root)
        if self.images:
            for volume in await self.store.all():
                await self._mount(volume.id)
                await self._thaw(volume.id)  # a node that died while copying it left it frozen

    async def stop(self) -> None:
        if self.images:  # the node's sandboxes are paused or gone by now
            for volume_id in [p.stem for p in self.root.glob("*.img")]:
                if os.path.ismount(self.root / volume_id):
                    await hostexec.run(["umount", str(self.root / volume_id)], timeout=60, check=False)
        await self.store.close()

    def dir_of(self, volume_id: str) -> Path:
        return self.root / volume_id / "data"

    async def _make(self, volume_id: str) -> None:
        top = self.root / volume_id
        if self.images:
            image = self.root / f"{volume_id}.img"
            with open(image, "xb") as f:
                f.truncate(self.size_mb * 2**20)
            await hostexec.run([*MKFS, str(image)], timeout=MKFS_SECONDS)
            await self._mount(volume_id)
        else:
            top.mkdir(mode=0o700)
        await asyncio.to_thread(_make_data, top / "data")

    async def _mount(self, volume_id: str) -> None:
        image, top = self.root / f"{volume_id}.img", self.root / volume_id
        if not image.exists() or os.path.ismount(top):
            return
        top.mkdir(mode=0o700, exist_ok=True)
        opts = ",".join(("loop", "noatime", *hostexec.UNTRUSTED_FLAGS))
        await hostexec.run(["mount", "-o", opts, str(image), str(top)], timeout=60)

    async def _copy(self, source_id: str, volume_id: str) -> None:
        """``volume_id``'s files made a copy of ``source_id``'s as they are now. An image is copied
        sparse (its blocks shared where the host's file system can: reflink) with the source's file
        system frozen meanwhile, so the copy is one moment of it even while sandboxes write to it;
        a plain directory is copied with ``cp -a`` (links as links, nothing followed or opened but
        regular files), not one moment if others write meanwhile."""
        if self.images:
            image = self.root / f"{volume_id}.img"
            await self._freeze(source_id)
            try:
                argv = ["cp", "--sparse=always", "--reflink=auto", str(self.root / f"{source_id}.img"), str(image)]
                await hostexec.run(argv, timeout=COPY_SECONDS)
            finally:
                await self._thaw(source_id)
            await self._mount(volume_id)
        else:
            top = self.root / volume_id
            top.mkdir(mode=0o700)
            argv = ["cp", "-a", "--reflink=auto", str(self.dir_of(source_id)), str(top)]
            await hostexec.run(argv, timeout=COPY_SECONDS)

    async def _freeze(self, volume_id: str) -> None:
        await hostexec.run(["fsfreeze", "--freeze", str(self.root / volume_id)], timeout=60)

    async def _thaw(self, volume_id: str) -> None:
        await hostexec.run(["fsfreeze", "--unfreeze", str(self.root / volume_id)], timeout=60, check=False)

    def _used(self, volume_id: str) -> int:
        """Bytes a copy of the volume takes: its image's allocated blocks, or its files' sizes."""
        image = self.root / f"{volume_id}.img"
        if image.exists():
            return image.stat().st_blocks * 512
        total = 0
        for path in self.dir_of(volume_id).rglob("*"):
            try:
                st = path.lstat()
            except OSError:
                continue
            total += st.st_blocks * 512
        return total

    async def _unmake(self, volume_id: str) -> None:
        top = self.root / volume_id
        if os.path.ismount(top):
            try:
                await hostexec.run(["umount", str(top)], timeout=60)
            except RuntimeFailure:
                await hostexec.run(["umount", "-l", str(top)], timeout=60, check=False)
        await asyncio.to_thread(remove_tree, top, ignore_errors=True)
        (self.root / f"{volume_id}.img").unlink(missing_ok=True)

    def files(self, volume: Volume) -> VolumeFiles:
        return VolumeFiles(self.dir_of(volume.id))

    # -- records ---------------------------------------------------------------------------------------
    async def create(self, name: str, team: str, limit: int) -> Volume:
        check_name(name)
        if self.node.settings.cluster and self.node.settings.volumes_dir is None:
            raise InvalidRequest(
                "volumes are not set up on this cluster: its operator sets AENV_VOLUMES_DIR on every node "
                "to one directory they share (docs/volumes.md)"
            )
        mine = [v for v in await self.store.all() if v.team == team]
        if limit and len(mine) >= limit:
            raise QuotaExceeded(f"team {team} has {len(mine)} volumes, its quota (maxVolumes {limit})")
        volume = Volume.new(name, team)
        if self.images:
            ensure_space(self.root, headroom(self.node.settings), 0, f"volume {name!r}")
        return await self._recorded(volume, self._make(volume.id))

    async def _recorded(self, volume: Volume, making: Awaitable[None]) -> Volume:
        """``volume`` once ``making`` made its files and its record is kept; its files removed if
        either fails (a taken name: 409)."""
        try:
            await making
            await self.store.add(volume)
        except NameTaken:
            await self._unmake(volume.id)
            raise Conflict(f"volume {volume.name!r} already exists") from None
        except BaseException:
            await self._unmake(volume.id)
            raise
        return volume

    async def copy(self, source: Volume, name: str) -> Volume:
        """A new volume of ``source``'s team holding what ``source`` holds now (see :meth:`_copy`)."""
        volume = Volume.new(check_name(name), source.team)
        need = self._used(source.id)
        ensure_space(self.root, headroom(self.node.settings), need, f"a copy of volume {source.name!r}")
        return await self._recorded(volume, self._copy(source.id, volume.id))

    async def remove(self, volume: Volume) -> None:
        """Gone, record and files, whoever still mounts it (a fork's copies of children not made)."""
        await self.store.remove(volume)
        await self._unmake(volume.id)

    async def fork_clones(self, mounts: list[dict[str, str]], count: int, team: str, limit: int) -> ForkClones:
        """What a fork asking ``volumes: "clone"`` gives each of its ``count`` children: a copy of
        each of the source's volumes, counted in the team's quota before anything is copied."""
        sources = [(mount, await self.find(mount["id"], team)) for mount in mounts]
        mine = len([v for v in await self.store.all() if v.team == team])
        if limit and mine + count * len(sources) > limit:
            raise QuotaExceeded(
                f"a fork of {count} copying {len(sources)} volume(s) each makes {count * len(sources)} volumes; "
                f"team {team} has {mine} of its quota of {limit} (maxVolumes)"
            )
        return ForkClones(self, sources)

    async def visible(self, team: str | None) -> list[Volume]:
        return [v for v in await self.store.all() if team is None or v.team == team]

    async def find(self, ref: str, team: str | None) -> Volume:
        """A volume of the team by id (or, for mounts, by name): a 404 that names it otherwise."""
        for volume in await self.visible(team):
            if ref in (volume.id, volume.name):
                return volume
        raise NotFound(f"volume {ref[:140]!r} not found")

    async def delete(self, volume: Volume) -> None:
        users = self.users_of(volume.id)
        if users:
            raise Conflict(f"volume {volume.name!r} is mounted by sandbox {users[0]}: kill it first")
        await self.store.remove(volume)
        await self._unmake(volume.id)

    def users_of(self, volume_id: str) -> list[str]:
        """This node's sandboxes (running or paused) that mount the volume."""
        return [
            sb.id
            for sb in self.node.list()
            if sb.state not in GOING and any(m.get("id") == volume_id for m in sb.rec.volume_mounts)
        ]

    # -- mounts ----------------------------------------------------------------------------------------
    async def mounts_for(self, asked: list[dict[str, Any]] | None, team: str) -> list[dict[str, str]]:
        """A create's ``volumeMounts`` (``[{name, path}]``), checked: the team's volumes, each
        at one absolute path, none inside another."""
        if not asked:
            return []
        if len(asked) > MAX_MOUNTS:
            raise InvalidRequest(f"volumeMounts: at most {MAX_MOUNTS}")
        mounts: list[dict[str, str]] = []
        for item in asked:
            if not isinstance(item, dict) or set(item) - {"name", "path"} or not isinstance(item.get("name"), str):
                raise InvalidRequest("volumeMounts: each is {name, path}")
            path = check_mount_path(item.get("path"))  # type: ignore[arg-type]
            volume = await self.find(item["name"], team)
            for other in mounts:
                if _nested(path, other["path"]):
                    raise InvalidRequest(f"volumeMounts: {path} and {other['path']} overlap")
            mounts.append({"name": volume.name, "path": path, "id": volume.id})
        return mounts


class ForkClones:
    """A fork's copies of its source's volumes (aenv/node/spec.py's VolumeClones): the first
    child's taken while the source is stopped for its checkpoint, the others' copied from those
    after (the source no longer waits), each named ``<volume>-<child id>``. They are volumes like
    any other: listed, readable through the content API, kept after the child ends until deleted."""

    def __init__(self, volumes: Volumes, sources: list[tuple[dict[str, str], Volume]]) -> None:
        self.volumes = volumes
        self.sources = sources
        self.made: dict[str, list[tuple[str, Volume]]] = {}  # child -> (its mount path, its copy)
        self.first: str | None = None

    async def capture(self, first_child: str) -> None:
        self.first = first_child
        await self._make(first_child, [volume for _, volume in self.sources])

    async def spread(self, children: list[str]) -> None:
        assert self.first is not None, "capture comes first"
        origins = [volume for _, volume in self.made[self.first]]
        for child in children:
            await self._make(child, origins)

    def mounts_of(self, child: str) -> list[dict[str, str]]:
        return [{"name": v.name, "path": path, "id": v.id} for path, v in self.made.get(child, [])]

    async def drop(self, child: str) -> None:
        for _, volume in self.made.pop(child, []):
            await self.volumes.remove(volume)

    async def _make(self, child: str, origins: list[Volume]) -> None:
        made = self.made.setdefault(child, [])
        try:
            for (mount, volume), origin in zip(self.sources, origins, strict=True):
                name = f"{volume.name[: 127 - len(child)]}-{child}"
                made.append((mount["path"], await self.volumes.copy(origin, name)))
        except BaseException:
            await asyncio.shield(self.drop(child))
            raise


def _nested(a: str, b: str) -> bool:
    return a == b or a.startswith(b + "/") or b.startswith(a + "/")


def _make_root(path: Path) -> None:
    """Owner-only, as everything under the data dir: sandboxes reach a volume through its mount."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(path, 0o700)


def _make_data(path: Path) -> None:
    path.mkdir(mode=0o755)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, 0o755)
        chown_at(None, fd, *USER)  # the sandbox's default user writes it
    finally:
        os.close(fd)


def _store_of(settings: Settings) -> VolumeStore:
    if settings.cluster:
        from aenv.cluster.store import cluster_store

        return EtcdVolumeStore(cluster_store(settings))
    return SqliteVolumeStore(settings.data_dir / "volumes.db")
