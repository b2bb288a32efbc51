"""The sync client: the async client run on a private event loop thread (never a hand-written twin)."""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from aenv.sdk._async import AsyncClient, AsyncSandbox

T = TypeVar("T")


class _Loop:
    """One background event loop shared by every sync object of a client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aenv-sdk", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


def _wrap(value: Any, loop: _Loop) -> Any:
    if isinstance(value, AsyncSandbox):
        return Sandbox(value, loop)
    if isinstance(value, list) and value and all(isinstance(v, AsyncSandbox) for v in value):
        return [Sandbox(v, loop) for v in value]
    return value


class _SyncProxy:
    _target: Any
    _loop: _Loop

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._target, name)
        if not inspect.iscoroutinefunction(attr):
            return attr

        @functools.wraps(attr)
        def call(*args: Any, **kwargs: Any) -> Any:
            return _wrap(self._loop.run(attr(*args, **kwargs)), self._loop)

        return call


class Sandbox(_SyncProxy):
    """Sync face of :class:`AsyncSandbox`: the same methods, blocking."""

    def __init__(self, target: AsyncSandbox, loop: _Loop) -> None:
        self._target = target
        self._loop = loop
        self.sandbox_id = target.sandbox_id

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.run(self._target.kill())


class Client(_SyncProxy):
    """Sync face of :class:`AsyncClient`: ``with Client() as c: sbx = c.create()``."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, request_timeout: float | None = None
    ) -> None:
        self._loop = _Loop()
        self._target = self._loop.run(_make(url, api_key, request_timeout))

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._loop.run(self._target.aclose())
        self._loop.close()


async def _make(url: str | None, api_key: str | None, request_timeout: float | None) -> AsyncClient:
    return AsyncClient(url, api_key, request_timeout=request_timeout)


__all__ = ["Client", "Sandbox"]
