"""A microVM's RAM as a file, for its images (aenv/runtime/qemu.py).

Every image of the qemu driver holds the guest's RAM as a plain file of the VM's size, which
restores map *privately* (``memory-backend-file,share=off``): nothing is loaded at a restore, a
page is read from the file when the guest first touches it, and the pages no sandbox writes stay
one copy in the page cache for every sandbox restored from the image.

A restored VM's RAM is then two things: the image's file (the pages it has not written) and the
pages it wrote, which the kernel copied into anonymous memory on write. QEMU's own migration
cannot save only those (it streams every page of a private mapping, template pages included), so
a checkpoint of such a VM is composed here while the VM is stopped: a sparse copy of the file it
was restored from, with the pages it wrote laid over it. /proc/<pid>/pagemap says which pages those
are (present and no longer the file's, or swapped out); /proc/<pid>/mem reads them. The cost is
the file's data plus the pages written, not the VM's size.

What is read is copied as bytes, never interpreted: the host follows nothing a guest wrote.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from aenv.storage.layers import copy_sparse_from

PAGE = os.sysconf("SC_PAGE_SIZE")
# The top byte of each 64-bit pagemap entry (little-endian: its eighth byte): bit 63 present,
# 62 swapped, 61 a file page (or shared anonymous). A page the VM wrote is present and no longer
# the file's, or swapped (only anonymous pages are).
_PRESENT, _SWAPPED, _FILE = 0x80, 0x40, 0x20
_WRITTEN = bytes(1 if (b & _PRESENT and not b & _FILE) or b & _SWAPPED else 0 for b in range(256))
_RUN = re.compile(b"\x01+")
CHUNK = 8 << 20  # bytes read from the VM's memory at a time


@dataclass(frozen=True)
class Mapping:
    """Part of a process's mapping of a file: its addresses and where in the file they start."""

    start: int
    end: int
    offset: int


def mappings_of(pid: int, fd: int) -> list[Mapping]:
    """Where process ``pid`` maps the file open as ``fd`` (matched by device and inode: the file
    may have been renamed or removed since)."""
    st = os.fstat(fd)
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    found = []
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 5 or fields[3] != device or int(fields[4]) != st.st_ino:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            found.append(Mapping(start, end, int(fields[2], 16)))
    return found


def written_runs(pid: int, mapping: Mapping) -> list[tuple[int, int]]:
    """(address, length) of each run of pages of ``mapping`` that process ``pid`` has written."""
    first, count = mapping.start // PAGE, (mapping.end - mapping.start) // PAGE
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        entries = b""
        while len(entries) < count * 8:
            got = os.pread(fd, count * 8 - len(entries), (first + len(entries) // 8) * 8)
            if not got:
                break
            entries += got
    finally:
        os.close(fd)
    flags = entries[7::8].translate(_WRITTEN)
    return [(mapping.start + m.start() * PAGE, (m.end() - m.start()) * PAGE) for m in _RUN.finditer(flags)]


def compose(pid: int, base_fd: int, target: Path) -> int:
    """Write ``target``: the file open as ``base_fd`` (which process ``pid``, stopped, maps
    privately as its guest's RAM) with every page the process wrote laid over it. Returns the
    bytes of written pages."""
    mappings = mappings_of(pid, base_fd)
    if not mappings:
        raise OSError(f"process {pid} does not map its RAM file")
    copy_sparse_from(base_fd, target)
    size = os.fstat(base_fd).st_size
    written = 0
    buffer = bytearray(CHUNK)
    mem = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    try:
        out = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            for mapping in mappings:
                for address, length in written_runs(pid, mapping):
                    at = mapping.offset + (address - mapping.start)
                    if at + length > size:
                        raise OSError(f"process {pid} maps its RAM file past its end")
                    _copy(mem, address, out, at, length, buffer)
                    written += length
        finally:
            os.close(out)
    finally:
        os.close(mem)
    return written


def _copy(mem: int, address: int, out: int, at: int, length: int, buffer: bytearray) -> None:
    """``length`` bytes of a process's memory at ``address`` into the file ``out`` at ``at``."""
    done = 0
    while done < length:
        view = memoryview(buffer)[: min(len(buffer), length - done)]
        got = os.preadv(mem, [view], address + done)
        if got <= 0:
            raise OSError(f"the process's memory ended at {address + done:#x}")
        chunk = view[:got]
        while chunk:
            n = os.pwrite(out, chunk, at + done)
            chunk, done = chunk[n:], done + n
