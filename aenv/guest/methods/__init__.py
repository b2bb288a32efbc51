"""The agent's methods: the registry the channel's streams are served from, and what they share.

Each module of this package serves one group of the envd API (``process``, ``filesystem``,
``system``) and registers its handlers with :func:`handler` when imported; the agent imports all
of them. Apart from the agent so that the plumbing (freeze, thaw, the pipe) reads on its own and a
method group can be read without it. Stdlib only: this runs inside every sandbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

from aenv.channel import END, Stream

if TYPE_CHECKING:
    from aenv.guest.agent import Agent

# File operations run here, never on the event loop (a slow disk or a huge tree delays only them),
# in a pool of their own: the freeze's sync and the checkpoint check never queue behind them.
FILE_IO = ThreadPoolExecutor(max_workers=4, thread_name_prefix="files")

T = TypeVar("T")
Handler = Callable[["Agent", Stream], Awaitable[Any]]
HANDLERS: dict[str, Handler] = {}
STREAMING: set[str] = set()


def handler(name: str, *, streaming: bool = False) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        if streaming:
            STREAMING.add(name)
        return fn

    return register


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(FILE_IO, fn, *args)


async def until_cancelled(stream: Stream) -> None:
    """Return once the host ends the stream (it lost interest)."""
    while (await stream.recv()).kind != END:
        pass
