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
    for path in sorted((ROOT / "api").rglob("*.py")):  # the route groups' package too
        if str(path.relative_to(ROOT)) in COMPOSITION_ROOTS:
            continue
        bad += [f"{path.relative_to(ROOT)}: {m}" for m in node_imports(path) if m != "aenv.node.service"]
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


def module_imports(package: Path) -> dict[str, set[str]]:
    """Each module of ``package`` -> the modules of it that it imports when loaded: its top-level
    imports (those under ``if TYPE_CHECKING:`` and inside functions are not run at load)."""
    modules = {p.stem for p in package.glob("*.py")}
    prefix = f"aenv.{package.name}"
    graph = {}
    for path in package.glob("*.py"):
        found: set[str] = set()
        statements = list(parse(path.read_text()).body)
        while statements:
            item = statements.pop()
            if isinstance(item, ast.If):
                statements += item.orelse if "TYPE_CHECKING" in ast.unparse(item.test) else item.body + item.orelse
            elif isinstance(item, ast.Try):
                statements += item.body + item.orelse + item.finalbody + [s for h in item.handlers for s in h.body]
            elif isinstance(item, ast.ImportFrom) and item.module == prefix:
                found |= {a.name for a in item.names}
            elif isinstance(item, ast.ImportFrom) and (item.module or "").startswith(prefix + "."):
                found.add((item.module or "").split(".")[2])
            elif isinstance(item, ast.Import):
                found |= {a.name.split(".")[2] for a in item.names if a.name.startswith(prefix + ".")}
        graph[path.stem] = found & modules
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The cycles of ``graph``, each once, starting at its least module."""
    cycles: set[tuple[str, ...]] = set()

    def walk(path: list[str]) -> None:
        for nxt in sorted(graph[path[-1]]):
            if nxt in path:
                cycle = path[path.index(nxt) :]
                start = cycle.index(min(cycle))
                cycles.add(tuple(cycle[start:] + cycle[:start]))
            else:
                walk([*path, nxt])

    for module in sorted(graph):
        walk([module])
    return [list(c) for c in sorted(cycles)]


def test_no_import_cycle_inside_the_node() -> None:
    """The node is composed of parts given what they use, not mixins reaching each other: no module
    of aenv/node needs another one that needs it back to load."""
    graph = module_imports(ROOT / "node")
    assert {"orchestrator", "records", "instances", "runner", "creation"} <= graph.keys()
    assert "records" in graph["instances"] and "instances" in graph["runner"]  # the scan sees imports
    assert import_cycles(graph) == []
    assert Node.__bases__ == (object,)  # no mixins


def test_the_cycle_scan_finds_cycles(tmp_path: Path) -> None:
    package = tmp_path / "node"
    package.mkdir()
    (package / "a.py").write_text("from aenv.node import b\n")
    checked_only = "if TYPE_CHECKING:\n    from aenv.node import d\n"
    (package / "b.py").write_text("from typing import TYPE_CHECKING\nimport aenv.node.c\n" + checked_only)
    (package / "c.py").write_text("from aenv.node.a import f\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from aenv.node import a\n")
    (package / "e.py").write_text("def f():\n    from aenv.node import e\n")
    graph = module_imports(package)
    assert graph == {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set(), "e": set()}
    assert import_cycles(graph) == [["a", "b", "c"]]
