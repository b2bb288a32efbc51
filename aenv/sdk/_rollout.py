"""Rollout helpers over fork: best-of-N and a beam-style tree search, for both faces, that never
leave a child behind.

One async core serves both faces: the sync one runs it on its client's loop and calls the user's
functions in threads (as the rest of the sync face, no hand-written twin of the logic). Every
sandbox a helper forks is killed unless the helper hands it back, whatever happens: an exception
in ``run``/``step`` or in scoring, a fork that fails part way, a child that dies, a cancellation
(Ctrl-C in the sync face) or a failed kill of the others."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar

from aenv.sdk._async import AsyncSandbox, kill_all

H = TypeVar("H")  # the handle the user's functions get: an AsyncSandbox or a sync Sandbox
OnError = Literal["raise", "drop"]
# A score: a shell command whose stdout's last line is a number (run as a scoring command, which
# may run in the grace period after a timeout), or a function of the child returning a number.
Score = str | Callable[[Any], Any]
DEFAULT_SCORE_TIMEOUT = 600.0


@dataclass
class Branch(Generic[H]):
    """One child: ``sandbox`` (alive only if the helper kept it), what ``run``/``step`` returned
    (``result``), its ``score``, or the ``error`` that dropped it; ``path`` names it in the tree
    ("2", "2.0"), ``snapshot_id`` is set when a tree search kept it as a snapshot."""

    sandbox: H
    index: int
    path: str
    score: float | None = None
    result: Any = None
    error: BaseException | None = None
    snapshot_id: str | None = None
    _async: AsyncSandbox | None = field(default=None, repr=False, compare=False)


@dataclass
class BestOfN(Generic[H]):
    """What ``best_of_n`` found: the ``best`` branch (its sandbox alive, yours to kill) and every
    branch in fork order (the others' sandboxes killed)."""

    best: Branch[H]
    branches: list[Branch[H]]

    @property
    def sandbox(self) -> H:
        return self.best.sandbox

    @property
    def score(self) -> float:
        assert self.best.score is not None
        return self.best.score


@dataclass
class TreeSearch(Generic[H]):
    """What ``tree_search`` found: the last round's kept branches, best first (alive, yours to
    kill), the branches it did not keep as snapshots (``snapshot_id``: create a sandbox from one to
    go on from there; delete them when done), and every round's branches."""

    frontier: list[Branch[H]]
    snapshots: list[Branch[H]]
    rounds: list[list[Branch[H]]]

    @property
    def best(self) -> Branch[H]:
        return self.frontier[0]


class _Face(Generic[H]):
    """How the core reaches the user's functions: handles of the async face are the sandboxes."""

    def handle(self, sandbox: AsyncSandbox) -> H:
        return sandbox  # type: ignore[return-value]

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        value = fn(*args)
        return await value if inspect.isawaitable(value) else value


class _ThreadFace(_Face[H]):
    """The sync face: handles are sync Sandboxes, the user's functions run in threads of their own
    (one per child, so N runs really run at once; the loop never blocks on them)."""

    def __init__(self, wrap: Callable[[AsyncSandbox], H], threads: int) -> None:
        self.wrap = wrap
        self.pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="aenv-rollout")

    def handle(self, sandbox: AsyncSandbox) -> H:
        return self.wrap(sandbox)

    async def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


async def best_of_n_async(
    face: _Face[H],
    sandbox: AsyncSandbox,
    n: int,
    run: Callable[..., Any],
    score: Score,
    *,
    timeout: int | None,
    metadata: Mapping[str, str] | None,
    on_error: OnError,
    score_timeout: float | None,
) -> BestOfN[H]:
    _check(n, "n")
    labels = [{**(metadata or {}), "child": str(i)} for i in range(n)]
    children = await _fork(sandbox, n, timeout, labels)
    try:
        branches = [Branch(face.handle(c), i, str(i), _async=c) for i, c in enumerate(children)]
        await _run_all(face, branches, lambda b: face.call(run, b.sandbox), score, on_error, score_timeout)
        best = _ranked(branches)[0]
        await kill_all([c for i, c in enumerate(children) if i != best.index])
    except BaseException:
        await kill_all(children)  # the winner too: nobody gets it back
        raise
    return BestOfN(best, branches)


async def tree_search_async(
    face: _Face[H],
    sandbox: AsyncSandbox,
    step: Callable[..., Any],
    score: Score,
    *,
    rounds: int,
    branch: int,
    keep: int,
    timeout: int | None,
    metadata: Mapping[str, str] | None,
    snapshot_rest: bool,
    on_error: OnError,
    score_timeout: float | None,
) -> TreeSearch[H]:
    for value, name in ((rounds, "rounds"), (branch, "branch"), (keep, "keep")):
        _check(value, name)
    owned: list[AsyncSandbox] = []  # alive and made here: killed on any failure
    snapshots: list[Branch[H]] = []
    history: list[list[Branch[H]]] = []
    frontier: list[tuple[AsyncSandbox, str]] = [(sandbox, "")]  # the source is never the helper's
    try:
        for r in range(rounds):
            made = await _fork_each(frontier, branch, timeout, metadata, r, owned)
            parents = [parent for parent, _ in frontier if parent in owned]
            if parents:  # their children carry their state on
                await kill_all(parents)
                owned[:] = [s for s in owned if s not in parents]
            branches = [
                Branch(face.handle(child), i, f"{path}.{j}" if path else str(j), _async=child)
                for i, (child, path, j) in enumerate(made)
            ]
            history.append(branches)

            def stepped(b: Branch[H], r: int = r) -> Awaitable[Any]:
                return face.call(step, b.sandbox, r)

            await _run_all(face, branches, stepped, score, on_error, score_timeout)
            chosen = _ranked(branches)[:keep]
            rest = [b for b in branches if all(b is not c for c in chosen)]
            if snapshot_rest:
                await _snapshot_all([b for b in rest if b.error is None], on_error)
                snapshots += [b for b in rest if b.snapshot_id is not None]
            gone = [b._async for b in rest if b._async is not None]
            await kill_all(gone)
            owned[:] = [s for s in owned if s not in gone]
            frontier = [(b._async, b.path) for b in chosen if b._async is not None]
        result = TreeSearch(chosen, snapshots, history)
    except BaseException:
        await kill_all(owned)
        await _delete_snapshots(sandbox, [b.snapshot_id for b in snapshots if b.snapshot_id])
        raise
    return result


def _check(value: int, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")


async def _fork(
    source: AsyncSandbox, n: int, timeout: int | None, labels: Sequence[Mapping[str, str]]
) -> list[AsyncSandbox]:
    """A fork whose children are killed if this is cancelled meanwhile: the fork is waited for
    (it is the node's to finish) and what it made killed before the cancellation goes on."""
    forking = asyncio.ensure_future(source.fork(n, timeout=timeout, metadata=labels))
    try:
        return await asyncio.shield(forking)
    except asyncio.CancelledError:
        try:
            made = await forking
        except BaseException:
            made = []  # a failed fork kills what it made itself
        await kill_all(made)
        raise


async def _fork_each(
    frontier: list[tuple[AsyncSandbox, str]],
    n: int,
    timeout: int | None,
    metadata: Mapping[str, str] | None,
    round_: int,
    owned: list[AsyncSandbox],
) -> list[tuple[AsyncSandbox, str, int]]:
    """``n`` children of each sandbox of the frontier, all forks at once; every child made goes to
    ``owned`` before any failure is raised."""

    def labels(path: str) -> list[dict[str, str]]:
        return [
            {**(metadata or {}), "round": str(round_), "branch": f"{path}.{j}" if path else str(j)} for j in range(n)
        ]

    forks = [asyncio.ensure_future(_fork(parent, n, timeout, labels(path))) for parent, path in frontier]
    interrupted: BaseException | None = None
    try:
        await asyncio.wait(forks)
    except BaseException as exc:  # cancelled: each fork not done kills its own children (see _fork)
        interrupted = exc
        for f in forks:
            f.cancel()
        await asyncio.gather(*forks, return_exceptions=True)
    made: list[tuple[AsyncSandbox, str, int]] = []
    for f, (_, path) in zip(forks, frontier, strict=True):
        if not f.cancelled() and f.exception() is None:
            children = f.result()
            owned.extend(children)  # the caller kills them if anything below fails
            made += [(child, path, j) for j, child in enumerate(children)]
    if interrupted is not None:
        raise interrupted
    for f in forks:
        error = f.exception()
        if error is not None:
            raise error
    return made


async def _run_all(
    face: _Face[H],
    branches: list[Branch[H]],
    run: Callable[[Branch[H]], Awaitable[Any]],
    score: Score,
    on_error: OnError,
    score_timeout: float | None,
) -> None:
    """Run and score every branch at once. ``raise``: the first failure cancels the others and is
    raised; ``drop``: a failed branch keeps its error, and only all failing is raised."""

    async def one(b: Branch[H]) -> None:
        try:
            b.result = await run(b)
            b.score = await _score(face, b, score, score_timeout)
        except Exception as exc:
            if on_error == "raise":
                raise
            b.error = exc

    tasks = [asyncio.ensure_future(one(b)) for b in branches]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in tasks:
            error = task.exception() if task in done else None
            if error is not None:
                raise error
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if all(b.error is not None for b in branches):
        error = branches[0].error
        assert error is not None
        raise error


async def _score(face: _Face[H], b: Branch[H], score: Score, timeout: float | None) -> float:
    if isinstance(score, str):
        assert b._async is not None
        result = await b._async.exec(["/bin/sh", "-c", score], scoring=True, timeout=timeout, check=True)
        lines = result.stdout.strip().splitlines()
        try:
            value: Any = float(lines[-1]) if lines else None
        except ValueError:
            value = None
        if value is None:
            shown = lines[-1][:80] if lines else ""
            raise ValueError(f"score command {score[:80]!r} printed {shown!r}, not a number as its last line")
    else:
        value = await face.call(score, b.sandbox)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"a score must be a number, not {value!r}")
    return float(value)


def _ranked(branches: list[Branch[H]]) -> list[Branch[H]]:
    """Scored branches, best first (ties: the lower index)."""
    scored = [b for b in branches if b.error is None and b.score is not None]
    return sorted(scored, key=lambda b: (-(b.score or 0.0), b.index))


async def _snapshot_all(branches: list[Branch[H]], on_error: OnError) -> None:
    async def one(b: Branch[H]) -> None:
        assert b._async is not None
        b.snapshot_id = await b._async.snapshot()

    outcomes = await asyncio.gather(*(one(b) for b in branches), return_exceptions=True)
    for b, outcome in zip(branches, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            if on_error == "raise" or not isinstance(outcome, Exception):
                raise outcome
            b.error = outcome


async def _delete_snapshots(sandbox: AsyncSandbox, ids: list[str]) -> None:
    """The snapshots of a search that failed (nobody gets their ids): deleted, whatever happens."""
    if ids:
        deletes = (sandbox.client.delete_snapshot(i) for i in ids)
        await asyncio.shield(asyncio.gather(*deletes, return_exceptions=True))
