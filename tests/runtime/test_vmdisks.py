"""A microVM's disk chain (aenv/runtime/vmdisks.py) from hostile files: a qcow2 header is what a
repository others write says, so QEMU is never left to follow it. No QEMU runs here (fast tier):
headers are written byte by byte, as QEMU lays them out."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from aenv.errors import ImageIncompatible
from aenv.runtime import vmdisks

pytestmark = pytest.mark.fast

SIZE = 64 * 2**20


def qcow2(path: Path, *, backing: str = "", version: int = 3, incompatible: int = 0, crypt: int = 0) -> Path:
    """A qcow2 header (version 2 or 3) with a backing file name after it, as qemu-img writes one."""
    name = backing.encode()
    at = 4096 if name else 0
    head = vmdisks.HEADER.pack(b"QFI\xfb", version, at, len(name), 16, SIZE, crypt, 0, 0, 0, 0, 0, 0)
    if version == 3:
        head += vmdisks.FEATURES.pack(incompatible, 0, 0) + struct.pack(">II", 4, 104)
    data = head.ljust(4096, b"\0") + name
    path.write_bytes(data)
    return path


def raw(path: Path) -> Path:
    path.write_bytes(b"\0" * 8192)
    return path


def nodes(chain: vmdisks.Chain) -> dict[str, dict[str, object]]:
    return {str(n["node-name"]): n for n in chain.nodes}


def test_a_chain_follows_the_record_and_names_every_backing_explicitly(tmp_path: Path) -> None:
    base = raw(tmp_path / "aaaa.img")  # a layer the host made (debootstrap's, a pulled one)
    built = qcow2(tmp_path / "bbbb.img")  # a template build's upper, sealed: standalone
    copy = qcow2(tmp_path / "cccc.img", backing="bbbb.img")  # a fork's copy of an upper above it
    upper = qcow2(tmp_path / "dddd.img", backing="cccc.img")
    chain = vmdisks.Chain()
    assert chain.layers([base, built, copy]) == ["l0", "l1", "l2"]
    assert chain.upper(upper, [base, built, copy]) == "upper"
    by_name = nodes(chain)
    assert by_name["l0"]["driver"] == "raw"
    assert by_name["l1"]["backing"] is None  # none at all: not "whatever the header says"
    assert by_name["l2"]["backing"] == "l1"
    assert by_name["upper"]["backing"] == "l2"
    assert by_name["upper"]["read-only"] is False
    assert all(n["read-only"] for name, n in by_name.items() if name != "upper")
    # The argv is JSON: a path with a comma or an equals sign is not an option of QEMU's.
    argv = chain.argv()
    assert argv[::2] == ["-blockdev"] * 4
    assert json.loads(argv[-1])["file"] == {"driver": "file", "filename": str(upper), "read-only": False}


@pytest.mark.parametrize(
    "backing",
    [
        "/etc/shadow",  # a host file as the disk
        "../../../etc/shadow",
        'json:{"driver":"file","filename":"/etc/shadow"}',  # QEMU's pseudo-protocol
        "nbd://attacker:10809/x",
        "eeee.img",  # a file beside it, but no layer of this sandbox
        "dddd.img",  # itself
    ],
)
def test_a_backing_name_that_is_no_earlier_layer_is_refused(tmp_path: Path, backing: str) -> None:
    below = qcow2(tmp_path / "bbbb.img")
    raw(tmp_path / "eeee.img")
    upper = qcow2(tmp_path / "dddd.img", backing=backing)
    chain = vmdisks.Chain()
    chain.layers([below])
    with pytest.raises(ImageIncompatible) as refused:
        chain.upper(upper, [below])
    assert refused.value.status == 422
    # And as a layer: a later layer may not name one above it either.
    above = qcow2(tmp_path / "ffff.img", backing="gggg.img")
    qcow2(tmp_path / "gggg.img")
    with pytest.raises(ImageIncompatible):
        vmdisks.Chain().layers([above, tmp_path / "gggg.img"])


def test_an_external_data_file_or_encryption_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageIncompatible, match="external data file"):
        vmdisks.read_qcow2(qcow2(tmp_path / "a.img", incompatible=vmdisks.EXTERNAL_DATA_FILE))
    with pytest.raises(ImageIncompatible, match="encrypted"):
        vmdisks.read_qcow2(qcow2(tmp_path / "b.img", crypt=1))
    with pytest.raises(ImageIncompatible, match="version"):
        vmdisks.read_qcow2(qcow2(tmp_path / "c.img", version=9))
    (tmp_path / "d.img").write_bytes(b"QFI\xfb\0\0")
    with pytest.raises(ImageIncompatible, match="truncated"):
        vmdisks.read_qcow2(tmp_path / "d.img")
    long = qcow2(tmp_path / "e.img", backing="x" * 2000)
    with pytest.raises(ImageIncompatible, match="2000 bytes"):
        vmdisks.read_qcow2(long)
    # Version 2 has no feature bits: read as it is.
    assert vmdisks.read_qcow2(qcow2(tmp_path / "f.img", version=2, backing="b.img")) == vmdisks.Qcow2(SIZE, "b.img")
    assert vmdisks.read_qcow2(raw(tmp_path / "g.img")) is None


def test_an_upper_that_is_not_the_drivers_qcow2_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ImageIncompatible, match="not the qcow2 file"):
        vmdisks.Chain().upper(raw(tmp_path / "u.img"), [])


async def test_the_layer_store_never_looks_into_a_guest_written_disk(tmp_path: Path) -> None:
    """A VM's upper (a qcow2 only QEMU opens) as the node's layer store sees it: not empty, never
    mounted (no root needed here: nothing is), usable as it is, copied as a file."""
    from aenv.storage.layers import LayerStore

    files = LayerStore(tmp_path / "fs")
    upper = "a1b2c3d4e5f6"
    (files.layers / upper).mkdir()
    disk = qcow2(files.layers / f"{upper}.img")
    with open(disk, "ab") as f:  # some data past the header, with a hole before it
        f.seek(2**20)
        f.write(b"guest data")
    assert files.guest_written(upper)
    assert not files.is_empty(upper)  # its upper/ is absent on the host: not read as "empty"
    await files.mount(upper, writable=False)  # a no-op: a mount would have needed root, and failed
    assert not (files.layers / upper).is_mount()
    assert files.is_local(upper)
    copy = files.copy_upper(upper)  # no FIFREEZE: that would freeze the host's file system here
    assert (files.layers / f"{copy}.img").read_bytes() == disk.read_bytes()
    assert files.guest_written(copy)
    await files.make_read_only(copy)  # nothing mounted: nothing to do
    await files.remove(copy)
    assert not (files.layers / f"{copy}.img").exists()
