"""What a microVM boots from, made on the host: the kernel found, its initramfs, ext4 disk images.

- **Kernel**: AENV_QEMU_KERNEL, or the newest of Debian's cloud kernels scripts/install unpacked
  into /usr/local/lib/aenv/kernel (``linux-image-cloud-amd64``'s, not installed as a kernel the
  host would boot), or of ``/boot/vmlinuz-*`` whose modules are installed.
- **Initramfs**: Debian's kernels build virtio and overlayfs as modules, so the kernel boots a
  small initramfs of ours (a ``newc`` cpio written here): stage one of the guest's init
  (aenv/runtime/compat/aenv_vminit.c, compiled static from source) and the modules it loads,
  their dependencies first. Made once per kernel and init source, kept by a hash of both.
- **Disks**: a layer that is a plain directory (debootstrap's ``base``) has no disk image of its
  own: one is made from it (``mkfs.ext4 -d``), once, kept by its path (layers never change), and
  dropped when the directory is gone. The guest bundle gets one the same way, per bundle key.
"""

from __future__ import annotations

import gzip
import hashlib
import lzma
import os
import re
import shutil
import stat
import subprocess
from dataclasses import dataclass
from pathlib import Path

from aenv.errors import RuntimeFailure
from aenv.runtime import hostexec

GUEST_KERNELS = Path("/usr/local/lib/aenv/kernel")  # <it>/boot/vmlinuz-*, <it>/lib/modules/*
INIT_SOURCE = Path(__file__).parent / "compat" / "aenv_vminit.c"
# What stage one loads (with what they need, from modules.dep): the virtio-mmio transport of QEMU's
# microvm, its block disks, its serial ports (the agent's channel), overlayfs.
MODULES = ("virtio_mmio", "virtio_blk", "virtio_console", "overlay")
MKFS = ["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-E", "lazy_itable_init=1,nodiscard", "-m", "0"]
BLOCK = 4096
MKFS_TIMEOUT = 600.0


@dataclass(frozen=True, slots=True)
class Kernel:
    path: Path  # its vmlinuz
    release: str  # "6.1.0-57-cloud-amd64"
    modules: Path  # the directory of its modules.dep


def _modules_of(root: Path, release: str) -> Path | None:
    for d in (root / "lib" / "modules" / release, root / "usr" / "lib" / "modules" / release):
        if (d / "modules.dep").is_file():
            return d
    return None


def find_kernel(explicit: str = "") -> Kernel:
    """``explicit`` (a vmlinuz-<release> whose modules are in <its root>/lib/modules or the host's),
    else the newest kernel of GUEST_KERNELS (scripts/install unpacks Debian's cloud kernel there,
    never installed as one the host boots), else of /boot, with its modules."""
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise RuntimeFailure(f"AENV_QEMU_KERNEL: {explicit} is no file")
        release = path.name.removeprefix("vmlinuz-")
        modules = _modules_of(path.parent.parent, release) or _modules_of(Path("/"), release)
        if modules is None:
            raise RuntimeFailure(f"AENV_QEMU_KERNEL: no modules for kernel {release} beside it or in /lib/modules")
        return Kernel(path, release, modules)
    for root in (GUEST_KERNELS, Path("/")):
        found = []
        for path in (root / "boot").glob("vmlinuz-*"):
            release = path.name.removeprefix("vmlinuz-")
            modules = _modules_of(root, release)
            if modules is not None:
                found.append((_version_key(release), Kernel(path, release, modules)))
        if found:
            return max(found, key=lambda f: f[0])[1]
    raise RuntimeFailure(
        f"the qemu driver found no kernel: scripts/install unpacks Debian's cloud kernel into {GUEST_KERNELS}, "
        "or set AENV_QEMU_KERNEL to a vmlinuz whose modules are installed"
    )


def _version_key(release: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"\d+", release))


def modules_in_order(kernel: Kernel, wanted: tuple[str, ...] = MODULES) -> list[Path]:
    """The module files of ``wanted`` and everything they need, each after what it needs."""
    deps: dict[str, list[str]] = {}
    for line in (kernel.modules / "modules.dep").read_text().splitlines():
        name, _, rest = line.partition(":")
        deps[name] = rest.split()
    by_name = {Path(p).name.split(".ko")[0]: p for p in deps}
    ordered: list[str] = []

    def visit(path: str) -> None:
        if path in ordered:
            return
        for dep in deps.get(path, []):
            visit(dep)
        ordered.append(path)

    for name in wanted:
        path = by_name.get(name) or by_name.get(name.replace("-", "_"))
        if path is not None:  # else built into this kernel
            visit(path)
    return [kernel.modules / p for p in ordered]


def _module_bytes(path: Path) -> bytes:
    """A module as stage one loads it: plain (Debian 13's are xz-compressed)."""
    data = path.read_bytes()
    if path.name.endswith(".ko.xz"):
        return lzma.decompress(data)
    if path.name.endswith(".ko.gz"):
        return gzip.decompress(data)
    if not path.name.endswith(".ko"):
        raise RuntimeFailure(f"module {path.name}: stage one loads plain, xz or gzip modules only")
    return data


def _cpio_entry(name: str, mode: int, data: bytes = b"", rdev: tuple[int, int] = (0, 0)) -> bytes:
    """One entry of a ``newc`` cpio archive (what the kernel unpacks as an initramfs)."""
    fields = (0, mode, 0, 0, 1, 0, len(data), 0, 0, rdev[0], rdev[1], len(name) + 1, 0)
    header = b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
    header += b"\0" * (-len(header) % 4)
    return header + data + b"\0" * (-len(data) % 4)


def cpio(entries: list[tuple[str, int, bytes, tuple[int, int]]]) -> bytes:
    out = [_cpio_entry(name, mode, data, rdev) for name, mode, data, rdev in entries]
    out.append(_cpio_entry("TRAILER!!!", 0))
    return b"".join(out)


def _compile_init(dest: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeFailure("a C compiler (gcc) is needed to build the microVM's init")
    result = subprocess.run([cc, "-static", "-Os", "-s", "-o", str(dest), str(INIT_SOURCE)], capture_output=True)
    if result.returncode != 0:
        raise RuntimeFailure(
            "cannot build the microVM's init (gcc -static: is libc6-dev installed?)",
            stderr=result.stderr.decode(errors="replace")[-4000:],
        )


def ensure_initramfs(cache_dir: Path, kernel: Kernel) -> Path:
    """The initramfs for ``kernel``: stage one's init and the modules it loads."""
    modules = modules_in_order(kernel)
    h = hashlib.sha256(INIT_SOURCE.read_bytes())
    h.update(str(kernel.modules).encode())
    for m in modules:
        h.update(m.name.encode())
    dest = cache_dir / f"initramfs-{h.hexdigest()[:16]}.cpio"
    if dest.is_file():
        return dest
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{dest.name}.{os.getpid()}"
    binary = tmp.with_suffix(".init")
    try:
        _compile_init(binary)
        directory, char = stat.S_IFDIR | 0o755, stat.S_IFCHR | 0o600
        entries = [(d, directory, b"", (0, 0)) for d in ("dev", "proc", "sys", "run", "lib", "lib/modules")]
        entries.append(("dev/console", char, b"", (5, 1)))
        entries.append(("init", stat.S_IFREG | 0o755, binary.read_bytes(), (0, 0)))
        for i, module in enumerate(modules):  # stage one loads them in name order
            name = f"lib/modules/{i:02d}-{module.name.split('.ko')[0]}.ko"
            entries.append((name, stat.S_IFREG | 0o644, _module_bytes(module), (0, 0)))
        tmp.write_bytes(cpio(entries))
        os.rename(tmp, dest)
    finally:
        binary.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)
    return dest


def _tree_size(root: Path) -> tuple[int, int]:
    """(bytes an ext4 copy of the tree needs at the least, its entries), links not followed."""
    total, entries = 0, 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in (*dirnames, *filenames):
            entries += 1
            st = os.lstat(os.path.join(dirpath, name))
            total += max(BLOCK, -(-st.st_size // BLOCK) * BLOCK) if stat.S_ISREG(st.st_mode) else BLOCK
    return total, entries


async def ext4_of(source: Path, dest: Path) -> Path:
    """An ext4 image of the directory ``source`` (owners, modes, links, device nodes and extended
    attributes as they are, overlayfs whiteouts included), made once: kept at ``dest``."""
    if dest.is_file():
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    total, entries = _tree_size(source)
    size_mb = total * 5 // 4 // 2**20 + 16  # room for the file system's own blocks
    inodes = entries + entries // 4 + 1024
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.truncate(size_mb * 2**20)
        await hostexec.run([*MKFS, "-N", str(inodes), "-d", str(source), str(tmp)], timeout=MKFS_TIMEOUT)
        os.rename(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
