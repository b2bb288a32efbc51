"""The agent's start-up imports from the bundle's one file (aenv/guest/preload.py): the modules
come from it with their real files' names, others the ordinary way, and a file that is damaged or
another interpreter's is not used. Real interpreters in subprocesses (the bundle's own for the
bundle), no sandbox."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from aenv.guest import preload
from aenv.runtime.guestbundle import GUEST_MOUNT, _bundle_python, ensure_bundle

pytestmark = pytest.mark.fast
REPO = Path(__file__).resolve().parents[2]

REPORT = """
import json, sys
names = sys.argv[2:]
def origin(name):
    module = sys.modules.get(name)
    if module is None:
        return None
    return [type(module.__spec__.loader).__name__, getattr(module, "__file__", None)]
report = {"installed": installed, "before": {n: origin(n) for n in names}}
from aenv.guest import preload
preload.done()
report["after_done"] = [type(f).__name__ for f in sys.meta_path]
report["active"] = preload._active is not None
print(json.dumps(report))
"""


def run(python: list[str], env: dict[str, str], root: str, imports: str, names: list[str]) -> dict[str, Any]:
    script = (
        "import sys\nsys.modules.setdefault('ssl', None)\nfrom aenv.guest import preload\n"
        f"installed = preload.install(sys.argv[1])\n{imports}\n{REPORT}"
    )
    out = subprocess.run(
        [*python, "-s", "-B", "-c", script, root, *names], env=env, cwd="/", capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ensure_bundle(tmp_path_factory.mktemp("guest"))


def test_the_bundle_holds_the_agents_start_and_the_agent_imports_it_from_there(bundle: Path) -> None:
    env = {"PYTHONHOME": str(bundle), "PYTHONPATH": str(bundle / "pkg"), "LANG": "C.UTF-8"}
    names = ["asyncio", "asyncio.base_events", "json", "aenv.guest.agent", "aenv.channel"]
    report = run(_bundle_python(bundle), env, str(bundle), "import aenv.guest.agent", names)
    assert report["installed"] is True
    for name in names:
        loader, path = report["before"][name]
        assert loader == "_Preloaded", (name, loader)
        assert path.startswith(f"{bundle}/") and Path(path).is_file(), (name, path)  # its real file
    assert "_Preloaded" not in report["after_done"] and report["active"] is False
    # Tracebacks name the files where the sandbox sees them.
    check = (
        "import aenv.guest.agent as a\n"
        f"assert a.main.__code__.co_filename == '{GUEST_MOUNT}/pkg/aenv/guest/agent.py', a.main.__code__.co_filename"
    )
    run(_bundle_python(bundle), env, str(bundle), check, [])


def fake_package(root: Path) -> None:
    pkg = root / "pkg" / "demo"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 'package'\n")
    (pkg / "eager.py").write_text("from demo import VALUE\nEAGER = VALUE + ' eager'\n")
    (pkg / "lazy.py").write_text("LAZY = 'lazy'\n")


def test_modules_it_does_not_hold_are_imported_the_ordinary_way(tmp_path: Path) -> None:
    fake_package(tmp_path)
    written = preload.write(
        str(tmp_path / preload.FILE_NAME),
        str(tmp_path),
        [("demo", "pkg/demo/__init__.py", True), ("demo.eager", "pkg/demo/eager.py", False)],
        "/guest",
    )
    assert written == 2
    env = {"PYTHONPATH": f"{tmp_path / 'pkg'}{os.pathsep}{REPO}", "PATH": os.environ.get("PATH", "")}
    imports = "import demo.eager, demo.lazy\nassert demo.eager.EAGER == 'package eager' and demo.lazy.LAZY == 'lazy'"
    report = run([sys.executable], env, str(tmp_path), imports, ["demo", "demo.eager", "demo.lazy"])
    assert report["installed"] is True
    assert report["before"]["demo"] == ["_Preloaded", str(tmp_path / "pkg/demo/__init__.py")]
    assert report["before"]["demo.eager"][0] == "_Preloaded"
    assert report["before"]["demo.lazy"] == ["SourceFileLoader", str(tmp_path / "pkg/demo/lazy.py")]


@pytest.mark.parametrize("damage", ["missing", "truncated", "magic", "interpreter", "header", "offsets"])
def test_a_file_damaged_or_of_another_interpreter_is_not_used(
    tmp_path: Path, damage: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_package(tmp_path)
    path = tmp_path / preload.FILE_NAME
    if damage == "interpreter":
        monkeypatch.setattr(sys, "version", "2.7.18 (elsewhere)")
    preload.write(str(path), str(tmp_path), [("demo", "pkg/demo/__init__.py", True)], "/guest")
    monkeypatch.undo()
    data = path.read_bytes()
    if damage == "missing":
        path.unlink()
    elif damage == "truncated":
        path.write_bytes(data[: len(preload.MAGIC) + 20])
    elif damage == "magic":
        path.write_bytes(b"x" + data[1:])
    elif damage == "header":
        path.write_bytes(data[: len(preload.MAGIC)] + (10**12).to_bytes(8, "little") + data[len(preload.MAGIC) + 8 :])
    elif damage == "offsets":  # the code cut short: an entry past its end
        path.write_bytes(data[:-10])
    env = {"PYTHONPATH": f"{tmp_path / 'pkg'}{os.pathsep}{REPO}", "PATH": os.environ.get("PATH", "")}
    report = run([sys.executable], env, str(tmp_path), "import demo\nassert demo.VALUE == 'package'", ["demo"])
    assert report["installed"] is False
    assert report["before"]["demo"] == ["SourceFileLoader", str(tmp_path / "pkg/demo/__init__.py")]


def test_a_module_whose_code_is_damaged_is_read_from_its_file(tmp_path: Path) -> None:
    """The header and bounds are sound, one module's bytes are not: that module comes from its
    own file, the others still from the file."""
    fake_package(tmp_path)
    path = tmp_path / preload.FILE_NAME
    modules = [("demo", "pkg/demo/__init__.py", True), ("demo.eager", "pkg/demo/eager.py", False)]
    preload.write(str(path), str(tmp_path), modules, "/guest")
    data = bytearray(path.read_bytes())
    size = int.from_bytes(data[len(preload.MAGIC) : len(preload.MAGIC) + 8], "little")
    start = len(preload.MAGIC) + 8 + size
    _, index = marshal.loads(bytes(data[len(preload.MAGIC) + 8 : start]))
    _, _, offset, length = index["demo.eager"]
    data[start + offset : start + offset + length] = b"\xff" * length  # not a marshalled object
    path.write_bytes(bytes(data))
    env = {"PYTHONPATH": f"{tmp_path / 'pkg'}{os.pathsep}{REPO}", "PATH": os.environ.get("PATH", "")}
    imports = "import demo.eager\nassert demo.eager.EAGER == 'package eager', demo.eager.EAGER"
    report = run([sys.executable], env, str(tmp_path), imports, ["demo", "demo.eager"])
    assert report["installed"] is True
    assert report["before"]["demo"][0] == "_Preloaded"
    assert report["before"]["demo.eager"] == ["SourceFileLoader", str(tmp_path / "pkg/demo/eager.py")]
