"""RL helpers: branch one prepared sandbox into a group of rollouts that are cleaned up together
(``fork_group``), keep the best of N (``best_of_n``) or search a tree of forks (``tree_search``);
the helpers' core is aenv/sdk/_rollout.py."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import TracebackType
from typing import Any, TypeVar, overload

from aenv.sdk._async import AsyncSandbox, kill_all
from aenv.sdk._rollout import (
    DEFAULT_SCORE_TIMEOUT,
    BestOfN,
    OnError,
    Score,
    TreeSearch,
    _Face,
    _ThreadFace,
    best_of_n_async,
    tree_search_async,
)
from aenv.sdk._sync import Sandbox, kill_all_sync

T = TypeVar("T")


class fork_group:  # noqa: N801 - used as a function: ``with fork_group(sbx, 8) as rollouts``
    """N children of ``source``, all killed when the block ends, however it ends:
    ``async with fork_group(sbx, 8) as rollouts`` for an :class:`AsyncSandbox`,
    ``with fork_group(sbx, 8) as rollouts`` for a sync :class:`Sandbox`. The source is checked
    before anything is forked: the wrong kind of sandbox, or of ``with``, is a TypeError.
    ``metadata`` is the fork's: one map for every child, or one per child."""

    def __init__(
        self,
        source: AsyncSandbox | Sandbox,
        n: int,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    ) -> None:
        if not isinstance(source, AsyncSandbox | Sandbox):
            raise TypeError(f"fork_group forks an AsyncSandbox or a Sandbox, not {type(source).__name__}")
        self.source = source
        self.n = n
        self.timeout = timeout
        self.metadata = metadata
        self.children: list[AsyncSandbox] | list[Sandbox] = []

    async def __aenter__(self) -> list[AsyncSandbox]:
        if not isinstance(self.source, AsyncSandbox):
            raise TypeError("a sync Sandbox's fork group is a `with fork_group(...)`, not `async with`")
        # it kills what it made if it fails
        children = await self.source.fork(self.n, timeout=self.timeout, metadata=self.metadata)
        self.children = children
        return children

    async def __aexit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        children, self.children = self.children, []
        await kill_all([c for c in children if isinstance(c, AsyncSandbox)])

    def __enter__(self) -> list[Sandbox]:
        if not isinstance(self.source, Sandbox):
            raise TypeError("an AsyncSandbox's fork group is an `async with fork_group(...)`, not `with`")
        children = self.source.fork(self.n, timeout=self.timeout, metadata=self.metadata)
        self.children = children
        return children

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        children, self.children = self.children, []
        kill_all_sync([c for c in children if isinstance(c, Sandbox)])


CLEANUP_WAIT = 120.0  # how long an interrupted sync helper waits for its children's kills


@overload
def best_of_n(
    sandbox: AsyncSandbox,
    n: int,
    run: Callable[[AsyncSandbox], Any],
    score: Score,
    *,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> Coroutine[Any, Any, BestOfN[AsyncSandbox]]: ...


@overload
def best_of_n(
    sandbox: Sandbox,
    n: int,
    run: Callable[[Sandbox], Any],
    score: Score,
    *,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> BestOfN[Sandbox]: ...


def best_of_n(
    sandbox: AsyncSandbox | Sandbox,
    n: int,
    run: Callable[[Any], Any],
    score: Score,
    *,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> Coroutine[Any, Any, BestOfN[AsyncSandbox]] | BestOfN[Sandbox]:
    """Fork ``sandbox`` into ``n`` children, ``run(child)`` in each at once, score each, keep the
    best and kill the rest; returns a :class:`BestOfN` (``.sandbox``: the best child, alive and
    yours to kill; ``.branches``: every child's result, score or error). ``await`` it for an
    :class:`AsyncSandbox` (``run`` and ``score`` may be coroutine functions); for a sync
    :class:`Sandbox` it blocks, ``run`` and ``score`` running in threads of their own.

    ``score``: a shell command (``/bin/sh -c``) whose stdout's last line is a number, run in each
    child as a scoring command (``exec(..., scoring=True, check=True)``: it may run in the
    child's grace period after its timeout; ``score_timeout`` bounds it), or a function of the
    child returning a number. Higher is better; a tie goes to the lower index. ``metadata`` is
    added to each child's (with ``child``: its index); ``timeout`` is the children's.

    ``on_error="raise"`` (the default): the first exception in a ``run`` or a score (a child that
    died raises ``SandboxGone`` there, a failed score command ``CommandFailed``) cancels the other
    runs and is raised. ``"drop"``: a failing child is dropped (its error in its branch) and the
    best of the others wins; only all failing raises. Whatever happens (those errors, a fork that
    fails part way, a cancellation or Ctrl-C), no child is left running but the one returned."""
    if isinstance(sandbox, AsyncSandbox):
        return best_of_n_async(
            _Face(),
            sandbox,
            n,
            run,
            score,
            timeout=timeout,
            metadata=metadata,
            on_error=on_error,
            score_timeout=score_timeout,
        )
    if isinstance(sandbox, Sandbox):
        return _blocking(
            sandbox,
            n,
            lambda face: best_of_n_async(
                face,
                sandbox._target,
                n,
                run,
                score,
                timeout=timeout,
                metadata=metadata,
                on_error=on_error,
                score_timeout=score_timeout,
            ),
        )
    raise TypeError(f"best_of_n forks an AsyncSandbox or a Sandbox, not {type(sandbox).__name__}")


@overload
def tree_search(
    sandbox: AsyncSandbox,
    step: Callable[[AsyncSandbox, int], Any],
    score: Score,
    *,
    rounds: int,
    branch: int,
    keep: int = 1,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    snapshot_rest: bool = True,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> Coroutine[Any, Any, TreeSearch[AsyncSandbox]]: ...


@overload
def tree_search(
    sandbox: Sandbox,
    step: Callable[[Sandbox, int], Any],
    score: Score,
    *,
    rounds: int,
    branch: int,
    keep: int = 1,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    snapshot_rest: bool = True,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> TreeSearch[Sandbox]: ...


def tree_search(
    sandbox: AsyncSandbox | Sandbox,
    step: Callable[[Any, int], Any],
    score: Score,
    *,
    rounds: int,
    branch: int,
    keep: int = 1,
    timeout: int | None = None,
    metadata: Mapping[str, str] | None = None,
    snapshot_rest: bool = True,
    on_error: OnError = "raise",
    score_timeout: float | None = DEFAULT_SCORE_TIMEOUT,
) -> Coroutine[Any, Any, TreeSearch[AsyncSandbox]] | TreeSearch[Sandbox]:
    """A beam search over forks: for each of ``rounds`` rounds, fork every sandbox of the beam
    (at first ``sandbox`` alone) into ``branch`` children, ``step(child, round)`` in each at once,
    score them (as ``best_of_n`` does), keep the ``keep`` best as the next beam and snapshot the
    others (``snapshot_rest``: a sandbox created from one goes on from there) before killing
    them; a beam's sandboxes are killed once their children carry their state on. Returns a
    :class:`TreeSearch`: ``frontier`` (the last beam, best first, alive and yours to kill),
    ``snapshots`` (the branches not kept, each with its ``snapshot_id`` and score: yours to
    delete) and every round's branches. Children get ``metadata`` with ``round`` and ``branch``
    (their path, "1.0.2"). ``await`` it for an :class:`AsyncSandbox`; for a sync :class:`Sandbox`
    it blocks. On any failure (``on_error`` as in ``best_of_n``), or a cancellation, every
    sandbox it made is killed and every snapshot it took deleted; ``sandbox`` itself is never
    touched."""
    options: dict[str, Any] = dict(
        rounds=rounds,
        branch=branch,
        keep=keep,
        timeout=timeout,
        metadata=metadata,
        snapshot_rest=snapshot_rest,
        on_error=on_error,
        score_timeout=score_timeout,
    )
    if isinstance(sandbox, AsyncSandbox):
        return tree_search_async(_Face(), sandbox, step, score, **options)
    if isinstance(sandbox, Sandbox):
        threads = keep * branch if isinstance(keep, int) and isinstance(branch, int) else 1
        return _blocking(
            sandbox, threads, lambda face: tree_search_async(face, sandbox._target, step, score, **options)
        )
    raise TypeError(f"tree_search forks an AsyncSandbox or a Sandbox, not {type(sandbox).__name__}")


def _blocking(sandbox: Sandbox, threads: int, make: Callable[[_ThreadFace[Sandbox]], Coroutine[Any, Any, T]]) -> T:
    """Run a helper's core on the sync client's loop. Interrupted (Ctrl-C), it is cancelled and
    waited for: its kills are done before this raises, not left to a loop the process may end."""
    loop = sandbox._loop
    face = _ThreadFace(lambda s: Sandbox(s, loop), threads if isinstance(threads, int) else 1)
    finished = threading.Event()

    async def guarded() -> T:
        try:
            return await make(face)
        finally:
            finished.set()

    future = asyncio.run_coroutine_threadsafe(guarded(), loop.loop)
    try:
        return future.result()
    except BaseException:
        future.cancel()
        finished.wait(CLEANUP_WAIT)
        raise
    finally:
        face.pool.shutdown(wait=False)
