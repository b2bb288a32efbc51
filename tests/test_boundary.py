"""The node's one boundary (aenv/node/service.py): outside aenv/node nothing touches a node's private
members, and the API routes import nothing of aenv.node but the service module (server.py, which
makes the node, excepted). A scan of the source, as test_fences does for imports."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import aenv
from aenv.node.orchestrator import Node
from tests.source import parse

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

ROOT = Path(aenv.__file__).parent
COMPOSITION_ROOTS = {"api/server.py"}  # makes the Node it serves


def outside_node(root: Path = ROOT) -> list[Path]:
    return [p for p in sorted(root.rglob("*.py")) if p.relative_to(root).parts[0] != "node"]


def node_private_names(root: Path = ROOT) -> set[str]:
    """Private names a node's classes define or assign on ``self`` (methods and attributes)."""
    names = set()
    for path in (root / "node").rglob("*.py"):
        for item in ast.walk(parse(path.read_text())):
            if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and _private(item.name):
                names.add(item.name)
            elif (
                isinstance(item, ast.Attribute)
                and isinstance(item.value, ast.Name)
                and item.value.id == "self"
                and _private(item.attr)
            ):
                names.add(item.attr)
    return names


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _names_a_node(expr: ast.expr) -> bool:
    """``node``, ``self.node``, ``app.state.node`` and the like."""
    return (isinstance(expr, ast.Name) and expr.id == "node") or (
        isinstance(expr, ast.Attribute) and expr.attr == "node"
    )


def private_reaches(path: Path, private: set[str]) -> list[str]:
    """Accesses of a private member of a node: on anything named node, or of a name a node
    defines on anything but the file's own ``self``/``cls``."""
    found = []
    for item in ast.walk(parse(path.read_text())):
        if not isinstance(item, ast.Attribute) or not _private(item.attr):
            continue
        own = isinstance(item.value, ast.Name) and item.value.id in ("self", "cls")
        if _names_a_node(item.value) or (item.attr in private and not own):
            found.append(f"{path.name}:{item.lineno} .{item.attr}")
    return found


def node_imports(path: Path) -> list[str]:
    out = []
    for item in ast.walk(parse(path.read_text())):
        if isinstance(item, ast.ImportFrom) and item.module and item.level == 0:
            if item.module == "aenv.node":
                out.extend(f"aenv.node.{a.name}" for a in item.names)
            elif item.module.startswith("aenv.node."):
                out.append(item.module)
        elif isinstance(item, ast.Import):
            out.extend(a.name for a in item.names if a.name.startswith("aenv.node"))
    return out


def test_no_private_member_of_a_node_is_reached_from_outside() -> None:
    private = node_private_names()
    assert {"_kill", "_within_deadline", "_teardown_later"} <= private  # the scan sees the node's insides
    found = [reach for path in outside_node() for reach in private_reaches(path, private)]
    assert found == []


def test_the_scan_finds_private_reaches(tmp_path: Path) -> None:
    source = tmp_path / "routes.py"
    source.write_text(
        "def f(node, request, x, self):\n"
        "    node._secret\n"  # on a node
        "    request.app.state.node._spawn(1)\n"  # on a node, however reached
        "    x._set_state(1)\n"  # a name only a node defines, on anything
        "    self._set_state(1)\n"  # the file's own: fine
        "    x._other\n"  # not a node's: fine
        "    node.__class__\n"  # dunder: fine
    )
    assert private_reaches(source, {"_set_state", "_spawn"}) == [
        "routes.py:2 ._secret",
        "routes.py:3 ._spawn",
        "routes.py:4 ._set_state",
    ]


def test_routes_import_only_the_service_from_the_node() -> None:
    bad = []
    for path in sorted((ROOT / "api").glob("*.py")):
        if str(path.relative_to(ROOT)) in COMPOSITION_ROOTS:
            continue
        bad += [f"{path.name}: {m}" for m in node_imports(path) if m != "aenv.node.service"]
    assert bad == []


def test_nothing_outside_the_node_names_the_orchestrator_but_server() -> None:
    bad = [
        f"{path.relative_to(ROOT)}: {m}"
        for path in outside_node()
        if str(path.relative_to(ROOT)) not in COMPOSITION_ROOTS
        for m in node_imports(path)
        if m == "aenv.node.orchestrator"
    ]
    assert bad == []


def test_the_node_has_every_member_of_the_service() -> None:
    service = parse((ROOT / "node" / "service.py").read_text())
    members = {
        f.name
        for cls in service.body
        if isinstance(cls, ast.ClassDef) and cls.name in ("NodeService", "BuildHost")
        for f in cls.body
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)
    }
    assert {"create", "kill", "capacity", "cached_artifacts", "templates"} <= members
    assert sorted(m for m in members if not hasattr(Node, m) and m not in Node.__init__.__code__.co_names) == []
