"""The agent's start-up imports, read from one file of the guest bundle.

The agent imports ~130 modules as it starts (asyncio and what that imports). Found one file at a
time, each costs a lookup, a stat and an open, read and close: under gVisor's ptrace platform a
system call costs ~70 us, and a cold start (a template build, an image's first create, a resume
without memory) spent ~95 ms of its ~480 ms there. The bundle keeps the compiled code of those
modules in one file, ``modules.bin``, written by :func:`write` when the bundle is made; the agent
reads it in one go and imports them from memory (:func:`install`), then drops it (:func:`done`),
so nothing of it stays in the memory every checkpoint saves.

The file is ``MAGIC``, the length of a marshalled header, the header, and the modules' code
objects, each marshalled. The header is ``(sys.version, {name: (path under the bundle,
is a package, offset after the header, length)})``. A file missing, from another interpreter or damaged is not
used: the imports then take the ordinary way, the same modules from the same bundle. A module whose
code does not load (its bytes damaged within a sound file) is read from its own file.

Stdlib only: it runs inside any image, on the bundle's interpreter.
"""

from __future__ import annotations

import marshal
import os
import sys

TYPE_CHECKING = False  # typing itself is one of the modules preloaded: this imports only what is loaded
if TYPE_CHECKING:
    from collections.abc import Sequence
    from importlib.machinery import ModuleSpec, SourceFileLoader
    from types import CodeType, ModuleType

_ModuleSpec: type[ModuleSpec] = type(os.__spec__)
# The ordinary way's loader of a source file, from the import system every interpreter has loaded
_SourceFileLoader: type[SourceFileLoader] = sys.modules["_frozen_importlib_external"].SourceFileLoader

MAGIC = b"aenv-modules-1\n"
FILE_NAME = "modules.bin"
_HEAD = len(MAGIC) + 8


class _Preloaded:
    """A meta path finder and loader serving the modules of one ``modules.bin``."""

    def __init__(self, root: str, code: memoryview, index: dict[str, tuple[str, bool, int, int]]) -> None:
        self.root = root
        self.data: memoryview | None = code
        self.index = index

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        entry = self.index.get(name)
        if entry is None or self.data is None:
            return None
        origin = os.path.join(self.root, entry[0])
        spec = _ModuleSpec(name, self, origin=origin, is_package=entry[1])  # type: ignore[arg-type]  # a loader by shape
        if entry[1]:  # its other submodules are found the ordinary way, next to it
            spec.submodule_search_locations = [os.path.dirname(origin)]
        spec.has_location = True
        return spec

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return None  # the default module

    def exec_module(self, module: ModuleType) -> None:
        spec = module.__spec__
        assert spec is not None and spec.origin is not None and self.data is not None
        _, _, offset, length = self.index.pop(spec.name)
        try:
            code = marshal.loads(self.data[offset : offset + length])
        except (ValueError, EOFError, TypeError):
            code = None
        if not isinstance(code, _CODE):  # damaged inside a sound header: the module's own file
            loader = _SourceFileLoader(spec.name, spec.origin)
            spec.loader = module.__loader__ = loader
            loader.exec_module(module)
            return
        exec(code, module.__dict__)

    def release(self) -> None:
        self.index = {}
        if self.data is not None:
            self.data.release()
            self.data = None


_CODE: type[CodeType] = type(_Preloaded.exec_module.__code__)
_active: _Preloaded | None = None


def install(root: str) -> bool:
    """Serve start-up imports from ``root``/modules.bin (the bundle's root), if it is there and
    is this interpreter's; whether it is."""
    global _active
    try:
        with open(os.path.join(root, FILE_NAME), "rb") as f:
            data = f.read()
        if data[: len(MAGIC)] != MAGIC:
            return False
        size = int.from_bytes(data[len(MAGIC) : _HEAD], "little")
        if size > len(data) - _HEAD:
            return False
        view = memoryview(data)
        version, index = marshal.loads(view[_HEAD : _HEAD + size])
    except (OSError, ValueError, EOFError, TypeError):
        return False
    code = view[_HEAD + size :]
    if version != sys.version or not isinstance(index, dict) or not all(_fits(e, len(code)) for e in index.values()):
        return False
    _active = _Preloaded(root, code, index)
    sys.meta_path.insert(0, _active)
    return True


def _fits(entry: object, size: int) -> bool:
    if not isinstance(entry, tuple) or len(entry) != 4:
        return False
    rel, _, offset, length = entry
    ints = isinstance(offset, int) and isinstance(length, int)
    return isinstance(rel, str) and ints and length >= 0 and 0 <= offset <= size - length


def done() -> None:
    """The start is over: later imports take the ordinary way, and the file's bytes are freed."""
    global _active
    if _active is None:
        return
    try:
        sys.meta_path.remove(_active)
    except ValueError:
        pass
    _active.release()
    _active = None


def write(dest: str, root: str, modules: list[tuple[str, str, bool]], guest_root: str) -> int:
    """Write ``dest`` from ``modules`` ((name, path under ``root``, is a package), sources read
    from under ``root``), their code naming the files as the guest sees them (under
    ``guest_root``); the modules written. Runs on the host with the interpreter the bundle copies."""
    index: dict[str, tuple[str, bool, int, int]] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, rel, is_pkg in modules:
        with open(os.path.join(root, rel), "rb") as f:
            source = f.read()
        code = compile(source, os.path.join(guest_root, rel), "exec", dont_inherit=True, optimize=0)
        blob = marshal.dumps(code)
        index[name] = (rel, is_pkg, offset, len(blob))
        blobs.append(blob)
        offset += len(blob)
    header = marshal.dumps((sys.version, index))
    with open(dest, "wb") as f:
        f.write(MAGIC + len(header).to_bytes(8, "little") + header + b"".join(blobs))
    return len(index)
