"""A microVM's disks as QEMU block nodes: the layers under a sandbox's upper, and the qcow2 chains
that a guest's writes make of them.

A sandbox's upper under the qemu driver is a qcow2 file at the layer store's ``<upper>.img``:
standalone when the sandbox booted (its blank ext4 converted), or an overlay of the layer below it
when the sandbox was restored from a checkpoint (a create from a template, a fork child): the VM's
memory image expects the disk it was saved with, and the overlay shows exactly that, copy-on-write.
Sealed (a snapshot, a template's build), such a file is a layer, and the chain of overlays follows
the record's layer list.

Those files travel (a repository other nodes write), so their headers are hostile input. The
chain is never taken from them alone: a header's backing file must name an earlier layer of the
same sandbox by its bare file name, and QEMU is given every node of the chain explicitly
(``-blockdev`` with ``backing`` set), so it opens no file a header names. Images with an external
data file or encryption are refused.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aenv.errors import ImageIncompatible
from aenv.runtime import hostexec
from aenv.storage.layers import QCOW2_MAGIC

HEADER = struct.Struct(">4sIQIIQIIQQIIQ")  # version 2's 72 bytes (version 3 adds the feature bits)
FEATURES = struct.Struct(">QQQ")  # version 3: incompatible, compatible, autoclear
EXTERNAL_DATA_FILE = 1 << 2
MAX_BACKING_NAME = 1023  # QEMU's own bound
QEMU_IMG_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class Qcow2:
    size: int  # the virtual disk's bytes
    backing: str  # the backing file's name as the header says it ("" for none)


def read_qcow2(path: Path) -> Qcow2 | None:
    """The header of a qcow2 file (None: not one). Raises ImageIncompatible for a header this
    driver will not give QEMU."""
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER.size + FEATURES.size)
            if head[:4] != QCOW2_MAGIC:
                return None
            if len(head) < HEADER.size:
                raise ImageIncompatible(f"{path.name}: a truncated qcow2 header")
            _, version, backing_at, backing_len, _, size, crypt, *_ = HEADER.unpack_from(head)
            if version not in (2, 3):
                raise ImageIncompatible(f"{path.name}: qcow2 version {version}")
            if crypt:
                raise ImageIncompatible(f"{path.name}: an encrypted qcow2")
            if version == 3:
                if len(head) < HEADER.size + FEATURES.size:
                    raise ImageIncompatible(f"{path.name}: a truncated qcow2 header")
                incompatible = FEATURES.unpack_from(head, HEADER.size)[0]
                if incompatible & EXTERNAL_DATA_FILE:
                    raise ImageIncompatible(f"{path.name}: a qcow2 with an external data file")
            backing = b""
            if backing_at:
                if backing_len > MAX_BACKING_NAME:
                    raise ImageIncompatible(f"{path.name}: a backing file name of {backing_len} bytes")
                f.seek(backing_at)
                backing = f.read(backing_len)
    except OSError as exc:
        raise ImageIncompatible(f"cannot read disk {path.name}: {exc.strerror}") from exc
    try:
        name = backing.decode()
    except UnicodeDecodeError as exc:
        raise ImageIncompatible(f"{path.name}: a backing file name that is not text") from exc
    return Qcow2(size, name)


class Chain:
    """The block nodes of one VM, built as ``-blockdev`` arguments: each layer's disk (a raw ext4
    the host made, or a guest-written qcow2 on its own backing layer), the upper's, the bundle's."""

    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = []
        self._by_path: dict[Path, str] = {}

    def raw(self, path: Path, *, name: str) -> str:
        """A read-only raw image (a layer or the guest bundle the host made)."""
        node = {"driver": "raw", "node-name": name, "read-only": True, "file": _file(path, read_only=True)}
        self.nodes.append(node)
        self._by_path[path] = name
        return name

    def layers(self, disks: list[Path]) -> list[str]:
        """A node per layer disk, lowest first; a qcow2 one on the earlier layer its header names."""
        names = []
        for i, disk in enumerate(disks):
            header = read_qcow2(disk)
            if header is None:
                names.append(self.raw(disk, name=f"l{i}"))
                continue
            backing = self._backing_of(disk, header, disks[:i])
            names.append(self._qcow2(disk, name=f"l{i}", backing=backing, read_only=True))
        return names

    def upper(self, disk: Path, below: list[Path]) -> str:
        """The writable upper, a qcow2 whose backing (if any) is one of the layers below it."""
        header = read_qcow2(disk)
        if header is None:
            raise ImageIncompatible(f"the sandbox's disk {disk.name} is not the qcow2 file this driver writes")
        return self._qcow2(disk, name="upper", backing=self._backing_of(disk, header, below), read_only=False)

    def argv(self) -> list[str]:
        out = []
        for node in self.nodes:
            out += ["-blockdev", json.dumps(node, separators=(",", ":"))]
        return out

    def _backing_of(self, disk: Path, header: Qcow2, below: list[Path]) -> str | None:
        if not header.backing:
            return None
        for candidate in below:
            if candidate.name == header.backing:
                name = self._by_path.get(candidate)
                if name is None:
                    raise ImageIncompatible(f"{disk.name} is backed by {header.backing}, which is not attached")
                return name
        raise ImageIncompatible(f"{disk.name} names a backing file that is no layer below it: {header.backing[:100]!r}")

    def _qcow2(self, path: Path, *, name: str, backing: str | None, read_only: bool) -> str:
        node: dict[str, Any] = {
            "driver": "qcow2",
            "node-name": name,
            "read-only": read_only,
            "file": _file(path, read_only=read_only),
            "backing": backing,  # None: none at all, whatever the header says
        }
        if not read_only:
            node["cache"] = {"direct": False, "no-flush": False}
        self.nodes.append(node)
        self._by_path[path] = name
        return name


def _file(path: Path, *, read_only: bool) -> dict[str, Any]:
    return {"driver": "file", "filename": str(path), "read-only": read_only}


async def standalone(raw: Path) -> None:
    """Turn a fresh sandbox's raw ext4 upper into a qcow2 file of the same disk, in place."""
    tmp = raw.with_name(f".{raw.name}.qcow2")
    tmp.unlink(missing_ok=True)
    try:
        argv = ["qemu-img", "convert", "-q", "-f", "raw", "-O", "qcow2", str(raw), str(tmp)]
        await hostexec.run(argv, timeout=QEMU_IMG_TIMEOUT)
        tmp.replace(raw)
    finally:
        tmp.unlink(missing_ok=True)


async def overlay(upper: Path, backing: Path) -> None:
    """Make ``upper`` a new, empty qcow2 overlay of ``backing`` (a layer beside it, named by its
    bare file name), replacing what was there (a fresh blank)."""
    header = read_qcow2(backing)
    size = header.size if header is not None else backing.stat().st_size
    fmt = "qcow2" if header is not None else "raw"
    tmp = upper.with_name(f".{upper.name}.qcow2")
    tmp.unlink(missing_ok=True)
    try:
        argv = ["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-F", fmt, "-b", backing.name, str(tmp), str(size)]
        await hostexec.run(argv, timeout=QEMU_IMG_TIMEOUT)
        tmp.replace(upper)
    finally:
        tmp.unlink(missing_ok=True)
