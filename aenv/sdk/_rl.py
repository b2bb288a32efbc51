"""RL helpers: branch one prepared sandbox into a group of rollouts that are cleaned up together."""

from __future__ import annotations

from types import TracebackType

from aenv.sdk._async import AsyncSandbox, kill_all
from aenv.sdk._sync import Sandbox, kill_all_sync


class fork_group:  # noqa: N801 - used as a function: ``with fork_group(sbx, 8) as rollouts``
    """N children of ``source``, all killed when the block ends, however it ends:
    ``async with fork_group(sbx, 8) as rollouts`` for an :class:`AsyncSandbox`,
    ``with fork_group(sbx, 8) as rollouts`` for a sync :class:`Sandbox`. The source is checked
    before anything is forked: the wrong kind of sandbox, or of ``with``, is a TypeError."""

    def __init__(self, source: AsyncSandbox | Sandbox, n: int, *, timeout: int | None = None) -> None:
        if not isinstance(source, AsyncSandbox | Sandbox):
            raise TypeError(f"fork_group forks an AsyncSandbox or a Sandbox, not {type(source).__name__}")
        self.source = source
        self.n = n
        self.timeout = timeout
        self.children: list[AsyncSandbox] | list[Sandbox] = []

    async def __aenter__(self) -> list[AsyncSandbox]:
        if not isinstance(self.source, AsyncSandbox):
            raise TypeError("a sync Sandbox's fork group is a `with fork_group(...)`, not `async with`")
        children = await self.source.fork(self.n, timeout=self.timeout)  # it kills what it made if it fails
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
        children = self.source.fork(self.n, timeout=self.timeout)
        self.children = children
        return children

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        children, self.children = self.children, []
        kill_all_sync([c for c in children if isinstance(c, Sandbox)])
