"""RL helpers: branch one prepared sandbox into a group of rollouts that are cleaned up together."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aenv.sdk._async import AsyncSandbox


@asynccontextmanager
async def fork_group(source: AsyncSandbox, n: int, *, timeout: int | None = None) -> AsyncIterator[list[AsyncSandbox]]:
    """``async with fork_group(sbx, 8) as rollouts:`` - N children, all killed on exit."""
    children = await source.fork(n, timeout=timeout)
    try:
        yield children
    finally:
        for child in children:
            try:
                await child.kill()
            except Exception:  # a child that is already gone is fine
                pass
