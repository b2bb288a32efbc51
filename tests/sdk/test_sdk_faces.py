"""The sync face has the async one's methods as real methods: dir(), help(), inspect and IDEs see
them with the same parameters, defaults and docstrings (they were proxied through __getattr__: no
method showed, and exec's 60 s limit was nowhere to read). No server needed."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import pytest

from aenv.sdk import (
    DEFAULT_EXEC_TIMEOUT,
    AsyncClient,
    AsyncSandbox,
    Client,
    Pty,
    PtySession,
    Sandbox,
    fork_group,
)

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

# the async name -> the sync name, where they differ
RENAMED = {"aclose": "close"}
FACES = [(AsyncSandbox, Sandbox), (AsyncClient, Client), (PtySession, Pty)]


def _public_coroutines(cls: type) -> dict[str, Callable[..., Any]]:
    return {
        name: fn
        for name, fn in vars(cls).items()
        if not name.startswith("_") and (inspect.iscoroutinefunction(fn) or inspect.isasyncgenfunction(fn))
    }


def _sync_annotation(text: Any) -> Any:
    if not isinstance(text, str):
        return text
    return text.replace("AsyncSandbox", "Sandbox").replace("PtySession", "Pty").replace("AsyncIterator", "Iterator")


@pytest.mark.parametrize(("async_cls", "sync_cls"), FACES, ids=lambda c: c.__name__)
def test_every_async_method_has_a_real_sync_twin(async_cls: type, sync_cls: type) -> None:
    methods = _public_coroutines(async_cls)
    assert methods, async_cls
    for name, fn in methods.items():
        twin_name = RENAMED.get(name, name)
        assert twin_name in dir(sync_cls), f"{sync_cls.__name__} has no {twin_name}"
        twin = vars(sync_cls).get(twin_name)
        assert inspect.isfunction(twin) and not inspect.iscoroutinefunction(twin), (sync_cls, twin_name)
        mine, theirs = inspect.signature(twin), inspect.signature(fn)
        assert [(p.name, p.kind, p.default) for p in mine.parameters.values()] == [
            (p.name, p.kind, p.default) for p in theirs.parameters.values()
        ], f"{sync_cls.__name__}.{twin_name} takes other parameters than {async_cls.__name__}.{name}"
        assert [p.annotation for p in mine.parameters.values()] == [
            _sync_annotation(p.annotation) for p in theirs.parameters.values()
        ], name
        assert mine.return_annotation == _sync_annotation(theirs.return_annotation), name
        assert twin.__doc__ and twin.__doc__ == fn.__doc__, (
            f"{sync_cls.__name__}.{twin_name}'s docstring must be {async_cls.__name__}.{name}'s (aenv/sdk/_sync.py)"
        )
    assert "__getattr__" not in vars(sync_cls)  # nothing reaches the async object unseen


def test_exec_says_its_limit() -> None:
    assert DEFAULT_EXEC_TIMEOUT == 60
    for exec_ in (AsyncSandbox.exec, Sandbox.exec):
        timeout = inspect.signature(exec_).parameters["timeout"]
        assert timeout.kind is inspect.Parameter.KEYWORD_ONLY and timeout.default == DEFAULT_EXEC_TIMEOUT
        assert exec_.__doc__ is not None and "60" in exec_.__doc__ and "OperationTimeout" in exec_.__doc__


def test_fork_group_refuses_what_it_cannot_fork_before_forking() -> None:
    with pytest.raises(TypeError, match="AsyncSandbox or a Sandbox"):
        fork_group("sbx-id", 2)  # type: ignore[arg-type]
