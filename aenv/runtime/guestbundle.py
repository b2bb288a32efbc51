"""The guest runtime bundle: a trimmed CPython, its shared libraries and the agent's code.

It is mounted read-only at ``/.aenv`` in every sandbox and started through its own dynamic
loader, so an image needs no Python or glibc of its own. Built once per (interpreter, agent code)
and addressed by a hash of both, so an upgrade never changes a bundle that a checkpoint uses.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import aenv
from aenv.errors import RuntimeFailure
from aenv.guest import preload

log = logging.getLogger("aenv.runtime")

GUEST_MOUNT = "/.aenv"
# What the agent never uses: every bundle sits on each node (and once in the repository).
_SKIP_STDLIB = {
    "site-packages",
    "test",
    "tests",
    "idlelib",
    "tkinter",
    "turtledemo",
    "ensurepip",
    "lib2to3",
    "unittest",
    "pydoc_data",
    "distutils",
}
_SKIP_PREFIXES = ("config-", "_tkinter", "_test", "_ctypes_test", "_xx", "xxlimited")
_SKIP_SUFFIXES = (".opt-1.pyc", ".opt-2.pyc")  # the agent runs without -O
BUNDLE_LAYOUT = "4"  # bumped whenever what goes into a bundle changes


def _skipped(name: str) -> bool:
    return name in _SKIP_STDLIB or name.startswith(_SKIP_PREFIXES) or name.endswith(_SKIP_SUFFIXES)


_AGENT_PACKAGES = ("channel", "guest")


COMPAT_SOURCE = Path(__file__).parent / "compat" / "aenv_compat.c"
SPAWN_SOURCE = Path(__file__).parent / "compat" / "aenv_spawn.c"
SUDO_SOURCE = Path(__file__).parent / "compat" / "aenv_sudo.c"
SUDO = f"{GUEST_MOUNT}/bin/sudo"  # what images have as /usr/bin/sudo (a symlink)
COMPAT_LIB = f"{GUEST_MOUNT}/compat/libaenv_compat.so"  # what images list in /etc/ld.so.preload


def _agent_sources() -> list[Path]:
    root = Path(aenv.__file__).parent
    out = [root / "__init__.py", COMPAT_SOURCE, SPAWN_SOURCE, SUDO_SOURCE]
    for pkg in _AGENT_PACKAGES:
        out += sorted(p for p in (root / pkg).rglob("*.py"))
    return out


def bundle_key(*, statx_shim: bool = True) -> str:
    h = hashlib.sha256()
    h.update(BUNDLE_LAYOUT.encode())
    h.update(b"" if statx_shim else b"no statx shim")
    h.update(sys.version.encode())
    h.update(os.path.realpath(sys.executable).encode())
    for src in _agent_sources():
        h.update(src.name.encode())
        h.update(src.read_bytes())
    return h.hexdigest()[:16]


def _interpreter() -> Path:
    exe = Path(sys.executable).resolve()
    if exe.read_bytes()[:4] != b"\x7fELF":  # e.g. a pyenv shim
        exe = Path(sys.base_prefix) / "bin" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    return exe.resolve()


def _shared_libs(binaries: list[Path]) -> tuple[set[Path], Path]:
    libs: set[Path] = set()
    loader: Path | None = None
    for binary in binaries:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False).stdout
        for line in out.splitlines():
            parts = line.split()
            if "=>" in parts and len(parts) >= 3 and parts[2].startswith("/"):
                libs.add(Path(parts[2]))
            elif parts and parts[0].startswith("/") and "ld-linux" in parts[0]:
                loader = Path(parts[0])
    if loader is None:
        raise RuntimeError("cannot find the dynamic loader of the host interpreter")
    return libs, loader


def loader_name() -> str:
    return "ld-linux-x86-64.so.2" if os.uname().machine == "x86_64" else "ld-linux-aarch64.so.1"


def agent_argv(module: str = "aenv.guest") -> list[str]:
    """How the runtime starts the agent inside the sandbox (or another of the bundle's modules:
    a microVM's init, aenv.guest.vminit, on the same interpreter)."""
    return [*_bundle_python(Path(GUEST_MOUNT)), "-s", "-B", "-m", module]


def agent_env() -> list[str]:
    return [f"PYTHONHOME={GUEST_MOUNT}", f"PYTHONPATH={GUEST_MOUNT}/pkg", "PYTHONUNBUFFERED=1", "LANG=C.UTF-8"]


def _compile(source: Path, dest: Path, *extra: str) -> None:
    """Compile a shim or tool from source with the host's compiler (never shipped as a binary)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError(f"a C compiler (gcc) is needed to build {source.name} for the guest bundle")
    argv = [cc, "-O2", *extra, "-o", str(dest), str(source)]
    subprocess.run(argv, check=True, capture_output=True)


def ensure_bundle(cache_dir: Path, *, statx_shim: bool = True) -> Path:
    """Build the bundle under ``cache_dir`` unless it is there already; return its directory.
    ``statx_shim``: the compat shim drops statx's AT_NO_AUTOMOUNT, which runsc 20221219 refuses."""
    key = bundle_key(statx_shim=statx_shim)
    dest = cache_dir / key
    if (dest / ".complete").exists():
        return dest
    tmp = cache_dir / f".{dest.name}.{os.getpid()}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "bin").mkdir(parents=True)
    (tmp / "lib").mkdir()
    exe = _interpreter()
    shutil.copy2(exe, tmp / "bin" / "python3")
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    dynload = stdlib / "lib-dynload"
    binaries = [exe, *sorted(p for p in dynload.glob("*.so") if not _skipped(p.name))]
    libs, loader = _shared_libs(binaries)
    for lib in libs:
        shutil.copy2(lib.resolve(), tmp / "lib" / lib.name)
    shutil.copy2(loader.resolve(), tmp / "lib" / loader_name())
    shutil.copytree(
        stdlib,
        tmp / "lib" / stdlib.name,
        ignore=lambda d, names: [n for n in names if _skipped(n)],
        symlinks=False,
    )
    root = Path(aenv.__file__).parent
    for src in _agent_sources():
        if src.suffix != ".py":
            continue
        target = tmp / "pkg" / "aenv" / src.relative_to(root)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    # The compat shim runs inside any image's programs: no startup files, only libc's syscall().
    statx = ("-DAENV_STATX_SHIM",) if statx_shim else ()
    _compile(COMPAT_SOURCE, tmp / "compat" / Path(COMPAT_LIB).name, "-shared", "-fPIC", "-nostartfiles", *statx)
    # The spawner runs inside the agent, on the bundle's own glibc; bound now, so that its vfork
    # child never enters the dynamic linker.
    _compile(SPAWN_SOURCE, tmp / "compat" / "libaenv_spawn.so", "-shared", "-fPIC", "-Wl,-z,now")
    # sudo runs in any image on the bundle's own loader and glibc (dynamically: see aenv_sudo.c).
    linker = f"-Wl,--dynamic-linker={GUEST_MOUNT}/lib/{loader_name()}"
    _compile(SUDO_SOURCE, tmp / "bin" / "sudo", linker, f"-Wl,-rpath,{GUEST_MOUNT}/lib")
    # Precompile so every sandbox starts without writing bytecode.
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(tmp / "pkg")], check=False)
    _write_preload(tmp)
    (tmp / ".complete").write_text(key)
    # Every user of the sandbox loads the compat shim, and the node's umask (077) is not theirs.
    for path in [tmp, *tmp.rglob("*")]:
        executable = path.is_dir() or path.stat().st_mode & 0o111
        path.chmod(0o755 if executable else 0o644)
    try:
        tmp.rename(dest)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


# Run by the bundle's own interpreter: the modules the agent's start imports, as files of the bundle.
_STARTUP_MODULES = """
import json, os, sys
sys.modules.setdefault("ssl", None)  # as aenv/guest/__main__.py
root = os.path.realpath(sys.argv[1])
import aenv.guest.agent
out = []
for name, module in sorted(sys.modules.items()):
    path, spec = getattr(module, "__file__", None), getattr(module, "__spec__", None)
    if name == "__main__" or spec is None or not isinstance(path, str) or not path.endswith(".py"):
        continue
    path = os.path.realpath(path)
    if path.startswith(root + os.sep):
        out.append([name, os.path.relpath(path, root), spec.submodule_search_locations is not None])
print(json.dumps(out))
"""


def _write_preload(bundle: Path) -> None:
    """The bundle's ``modules.bin`` (aenv/guest/preload.py): the code of the modules the agent's
    start imports, in one file. Without it the agent starts all the same, only slower."""
    argv = [*_bundle_python(bundle), "-s", "-B", "-c", _STARTUP_MODULES, str(bundle)]
    env = {"PYTHONHOME": str(bundle), "PYTHONPATH": str(bundle / "pkg"), "LANG": "C.UTF-8"}
    try:
        out = subprocess.run(argv, env=env, cwd="/", capture_output=True, text=True, check=True, timeout=60)
        modules = [(str(name), str(rel), bool(pkg)) for name, rel, pkg in json.loads(out.stdout)]
        preload.write(str(bundle / preload.FILE_NAME), str(bundle), modules, GUEST_MOUNT)
    except (OSError, ValueError, subprocess.SubprocessError, SyntaxError) as exc:
        log.warning("guest bundle without %s (the agent imports file by file): %s", preload.FILE_NAME, exc)
        (bundle / preload.FILE_NAME).unlink(missing_ok=True)


def _bundle_python(bundle: Path) -> list[str]:
    """The bundle's interpreter as a host command: through its own loader, as in a sandbox."""
    lib = bundle / "lib"
    return [str(lib / loader_name()), "--library-path", str(lib), str(bundle / "bin" / "python3")]


class BundledGuests:
    """The guest-bundle half of the Driver contract, alike for every driver: the bundle this
    node's agent code makes (built on first use), and those older images were made with, kept
    under ``guest_dir`` by key. A driver calls :meth:`_init_guests` in its ``__init__``."""

    guest_dir: Path
    _guest: Path | None
    _statx_shim: bool

    def _init_guests(self, directory: Path, *, statx_shim: bool = False) -> None:
        self.guest_dir = directory
        directory.mkdir(parents=True, exist_ok=True)
        self._guest = None
        self._statx_shim = statx_shim

    def guest_bundle(self, key: str = "") -> Path:
        if self._guest is None:
            self._guest = ensure_bundle(self.guest_dir, statx_shim=self._statx_shim)
        if key and key != self._guest.name:
            path = self.guest_dir / key
            if not (path / ".complete").exists():
                raise RuntimeFailure(f"guest bundle {key} is missing; the image needs the agent it was made with")
            return path
        return self._guest

    def guest_key(self) -> str:
        return self.guest_bundle().name

    def guest_path(self, key: str) -> Path:
        return self.guest_dir / key

    def guest_keys(self) -> set[str]:
        return {p.name for p in self.guest_dir.iterdir() if not p.name.startswith(".")}  # not builds/fetches

    def remove_guest(self, key: str) -> None:
        # Out of sight in one rename, so nothing boots a half-removed bundle; leftovers of a crash
        # are swept at start with the other evictions.
        doomed = self.guest_dir / f".evict-{key}-{os.getpid()}"
        try:
            os.rename(self.guest_dir / key, doomed)
        except FileNotFoundError:
            return
        shutil.rmtree(doomed, ignore_errors=True)
