"""A restored VM's RAM composed for its image (aenv/runtime/vmram.py), on a plain process that maps
a file privately as QEMU maps an image's RAM file: the image must be the file with exactly the
pages the process wrote laid over it (pages it only read, and pages it never touched, are the
file's), whatever became of the file's name. Fast tier: no QEMU needed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime import vmram

pytestmark = pytest.mark.fast
PAGE = vmram.PAGE
PAGES = 64

# Maps the file privately at a page offset, reads some pages, writes others (one run of three and
# two lone pages, one of them over a hole of the file), then says so and waits to be stopped.
MAPPER = """
import mmap, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
m = mmap.mmap(fd, 0, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
P = mmap.PAGESIZE
seen = sum(m[i * P] for i in (0, 1, 2, 30))            # read only: stay the file's
for i in (5, 6, 7, 40, 63):
    m[i * P : (i + 1) * P] = bytes([0xA0 + i % 16]) * P  # written: the process's own now
print("ready", flush=True)
sys.stdin.read()
"""


def base_file(path: Path) -> bytes:
    """64 pages, each filled with its number, with a hole (zeros) over pages 40-49."""
    data = bytearray(b"".join(bytes([i]) * PAGE for i in range(PAGES)))
    data[40 * PAGE : 50 * PAGE] = bytes(10 * PAGE)
    with open(path, "wb") as f:
        f.write(data[: 40 * PAGE])
        f.seek(50 * PAGE)
        f.write(data[50 * PAGE :])
    return bytes(data)


@pytest.fixture()
def mapper(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path, bytes]]:
    base = tmp_path / "ram"
    data = base_file(base)
    proc = subprocess.Popen(
        [sys.executable, "-c", MAPPER, str(base)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
    os.kill(proc.pid, signal.SIGSTOP)  # as QEMU is stopped while its RAM is saved
    try:
        yield proc, base, data
    finally:
        proc.kill()
        proc.wait()


def expected(data: bytes) -> bytes:
    out = bytearray(data)
    for i in (5, 6, 7, 40, 63):
        out[i * PAGE : (i + 1) * PAGE] = bytes([0xA0 + i % 16]) * PAGE
    return bytes(out)


def test_the_image_is_the_file_with_the_written_pages_over_it(mapper, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, base, data = mapper
    fd = os.open(base, os.O_RDONLY)
    try:
        [mapping] = vmram.mappings_of(proc.pid, fd)
        runs = vmram.written_runs(proc.pid, mapping)
        assert [((a - mapping.start) // PAGE, n // PAGE) for a, n in runs] == [(5, 3), (40, 1), (63, 1)]
        written = vmram.compose(proc.pid, fd, tmp_path / "image")
    finally:
        os.close(fd)
    assert written == 5 * PAGE
    assert (tmp_path / "image").read_bytes() == expected(data)
    assert base.read_bytes() == data  # the file the process maps is never written


def test_a_renamed_or_removed_file_is_found_by_its_descriptor(mapper, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, base, data = mapper
    fd = os.open(base, os.O_RDONLY)
    try:
        base.unlink()  # (an image the node removed while a sandbox restored from it runs on)
        vmram.compose(proc.pid, fd, tmp_path / "image")
    finally:
        os.close(fd)
    assert (tmp_path / "image").read_bytes() == expected(data)


def test_a_process_that_does_not_map_the_file_is_refused(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(bytes(PAGE))
    fd = os.open(other, os.O_RDONLY)
    try:
        with pytest.raises(OSError, match="does not map"):
            vmram.compose(os.getpid(), fd, tmp_path / "image")
    finally:
        os.close(fd)
    assert not (tmp_path / "image").exists()
