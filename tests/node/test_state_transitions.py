"""Every sandbox state change goes through the one checked transition, Records.set_state (aenv/node/records.py).

A scan of the source finds any other write of a `.state`; behaviour tests record the transitions
a node makes through each operation and through each failed operation's fallback, on real
sandboxes (the tiny in-process node of test_failures).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

import aenv
from aenv.errors import RuntimeFailure, WrongState
from aenv.node import records
from aenv.node.orchestrator import Node
from aenv.node.state import TRANSITIONS, check_transition
from aenv.node.state import SandboxState as S
from tests.node.test_failures import FaultyDriver, tiny  # noqa: F401  (the fixture, used by name)
from tests.source import parse

Transitions = dict[str, list[tuple[S, S]]]


class StateWrites(ast.NodeVisitor):
    """Writes of a `.state` attribute (assignments, setattr) and records built in a given state,
    each as (function it is in, line)."""

    def __init__(self) -> None:
        self.function = "<module>"
        self.found: list[tuple[str, int]] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        outer, self.function = self.function, node.name
        self.generic_visit(node)
        self.function = outer

    visit_AsyncFunctionDef = visit_FunctionDef

    def _targets(self, targets: list[ast.expr], line: int) -> None:
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and sub.attr == "state" and isinstance(sub.ctx, ast.Store):
                    self.found.append((self.function, line))

    def visit_Assign(self, node: ast.Assign) -> None:
        self._targets(node.targets, node.lineno)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._targets([node.target], node.lineno)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._targets([node.target], node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
        if name in ("setattr", "__setattr__") and any(getattr(a, "value", None) == "state" for a in node.args):
            self.found.append((self.function, node.lineno))
        if name in ("SandboxRecord", "replace") and any(k.arg == "state" for k in node.keywords):
            self.found.append((self.function, node.lineno))  # a new record starts creating
        self.generic_visit(node)


def state_writes(source: str) -> list[tuple[str, int]]:
    visitor = StateWrites()
    visitor.visit(parse(source))
    return visitor.found


def test_the_scan_finds_every_kind_of_state_write() -> None:
    source = (
        "def a(sb):\n    sb.rec.state = 1\n"
        "async def b(rec):\n    rec.state: int = 2\n"
        "def c(x):\n    x.state, y = 3, 4\n"
        "def d(x):\n    setattr(x, 'state', 5)\n"
        "def e():\n    return SandboxRecord(id='x', state=6)\n"
        "def f(x):\n    object.__setattr__(x, 'state', 7)\n"
        "def g(rec):\n    return dataclasses.replace(rec, state=8)\n"
        "def h(app):\n    app.state.node = 9\n    return x.state\n"
    )
    assert [f for f, _ in state_writes(source)] == ["a", "b", "c", "d", "e", "f", "g"]


def test_only_set_state_writes_a_state() -> None:
    root = Path(aenv.__file__).parent
    writes = [
        (str(path.relative_to(root.parent)), function, line)
        for path in sorted(root.rglob("*.py"))
        for function, line in state_writes(path.read_text())
    ]
    assert [(path, function) for path, function, _ in writes] == [("aenv/node/records.py", "set_state")], writes


def test_the_table() -> None:
    for state in S:
        if state not in (S.KILLING, S.KILLED):
            assert S.KILLING in TRANSITIONS[state], state  # a kill is legal from anywhere
    assert TRANSITIONS[S.KILLING] == {S.KILLED} and TRANSITIONS[S.KILLED] == frozenset()
    # What failed operations fall back to.
    for current, target in [
        (S.PAUSING, S.RUNNING),
        (S.RESUMING, S.PAUSED),
        (S.SNAPSHOTTING, S.RUNNING),
        (S.SNAPSHOTTING, S.PAUSED),
        (S.FORKING, S.PAUSED),
    ]:
        check_transition("sb", current, target)
    for current, target in [
        (S.PAUSED, S.RUNNING),
        (S.RUNNING, S.PAUSED),
        (S.CREATING, S.PAUSED),
        (S.KILLED, S.RUNNING),
    ]:
        with pytest.raises(WrongState):
            check_transition("sb", current, target)


def record_transitions(monkeypatch: pytest.MonkeyPatch) -> Transitions:
    seen: Transitions = defaultdict(list)

    def checked(sandbox_id: str, current: S, target: S) -> None:
        check_transition(sandbox_id, current, target)
        seen[sandbox_id].append((current, target))

    monkeypatch.setattr(records, "check_transition", checked)
    return seen


async def stored_state(node: Node, sandbox_id: str) -> S | None:
    return next((r.state for r in await node.store.sandboxes() if r.id == sandbox_id), None)


@pytest.mark.sandbox
async def test_every_lifecycle_change_is_a_checked_transition(
    tiny: tuple[Node, FaultyDriver],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, _ = tiny
    seen = record_transitions(monkeypatch)
    rec = await node.create("tiny")
    await node.pause(rec.id)
    assert await stored_state(node, rec.id) == S.PAUSED
    await node.resume(rec.id)
    await node.snapshot(rec.id)
    [forked] = await node.fork(rec.id, count=1)
    assert forked.sandbox is not None
    child = forked.sandbox.id
    assert await stored_state(node, rec.id) == S.RUNNING and await stored_state(node, child) == S.RUNNING
    await node.kill(child)
    await node.kill(rec.id)
    assert seen[rec.id] == [
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.PAUSED),
        (S.PAUSED, S.RESUMING),
        (S.RESUMING, S.RUNNING),
        (S.RUNNING, S.SNAPSHOTTING),
        (S.SNAPSHOTTING, S.RUNNING),
        (S.RUNNING, S.FORKING),
        (S.FORKING, S.RUNNING),
        (S.RUNNING, S.KILLING),
        (S.KILLING, S.KILLED),
    ]
    assert seen[child] == [(S.CREATING, S.RUNNING), (S.RUNNING, S.KILLING), (S.KILLING, S.KILLED)]
    assert await stored_state(node, rec.id) is None and await stored_state(node, child) is None


@pytest.mark.sandbox
async def test_failed_operations_fall_back_through_checked_transitions(
    tiny: tuple[Node, FaultyDriver],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    node, driver = tiny
    seen = record_transitions(monkeypatch)
    rec = await node.create("tiny")
    driver.fail_next = "before"
    with pytest.raises(RuntimeFailure):
        await node.pause(rec.id)  # the checkpoint failed: running again
    await node.pause(rec.id)
    driver.fail_restore = True
    with pytest.raises(RuntimeFailure):
        await node.resume(rec.id)  # the restore failed: paused again
    assert node.get(rec.id).state == S.PAUSED
    await node.resume(rec.id)
    driver.fail_restore = True
    if driver.leaves_running:
        await node.snapshot(rec.id)  # the source is not restored: nothing to fail
        driver.fail_restore = False
        snapshot = [(S.RUNNING, S.SNAPSHOTTING), (S.SNAPSHOTTING, S.RUNNING)]
    else:
        with pytest.raises(RuntimeFailure):
            await node.snapshot(rec.id)  # checkpointed, but the source could not be restarted: kept paused
        assert node.get(rec.id).state == S.PAUSED and await stored_state(node, rec.id) == S.PAUSED
        await node.resume(rec.id)
        snapshot = [(S.RUNNING, S.SNAPSHOTTING), (S.SNAPSHOTTING, S.PAUSED), (S.PAUSED, S.RESUMING)]
        snapshot.append((S.RESUMING, S.RUNNING))
    assert node.get(rec.id).state == S.RUNNING
    await node.kill(rec.id)
    assert seen[rec.id] == [
        (S.CREATING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.RUNNING),
        (S.RUNNING, S.PAUSING),
        (S.PAUSING, S.PAUSED),
        (S.PAUSED, S.RESUMING),
        (S.RESUMING, S.PAUSED),
        (S.PAUSED, S.RESUMING),
        (S.RESUMING, S.RUNNING),
        *snapshot,
        (S.RUNNING, S.KILLING),
        (S.KILLING, S.KILLED),
    ]


@pytest.mark.sandbox
async def test_an_illegal_change_is_refused_and_changes_nothing(tiny: tuple[Node, FaultyDriver]) -> None:  # noqa: F811
    node, _ = tiny
    rec = await node.create("tiny")
    await node.pause(rec.id)
    sb = node.get(rec.id)
    with pytest.raises(WrongState):
        await node.records.set_state(sb, S.RUNNING)  # paused -> running skips the restore
    assert sb.state == S.PAUSED and await stored_state(node, rec.id) == S.PAUSED
    await node.kill(rec.id)
