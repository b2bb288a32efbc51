"""The sync client: the async client run on a private event loop thread (never a hand-written
twin of its logic). Each method is a thin wrapper with the async one's signature, typed for IDEs
and mypy, and its docstring, taken from the async method (``@twin``), so ``dir()`` and ``help()``
show them; tests/sdk/test_sdk_faces.py checks that every async method has its twin and that the
two agree."""

from __future__ import annotations

import asyncio
import builtins
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator, Mapping, Sequence
from typing import Any, Literal, TypeVar

from aenv.sdk._async import AsyncClient, AsyncSandbox, SandboxInfo, kill_all
from aenv.sdk._config import ClientConfig
from aenv.sdk._templates import ProgressFn
from aenv.sdk._wire import DEFAULT_EXEC_TIMEOUT, CommandResult, OutputFn, PtySession

T = TypeVar("T")


class _Loop:
    """One background event loop shared by every sync object of a client."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="aenv-sdk", daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C): the call is cancelled, as an awaited one would be
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


F = TypeVar("F", bound=Callable[..., Any])


def twin(original: Callable[..., Any]) -> Callable[[F], F]:
    """A sync method's docstring is its async twin's: one text, written once (in aenv/sdk/_client.py,
    _sandbox.py and _wire.py)."""

    def shared(face: F) -> F:
        face.__doc__ = original.__doc__
        return face

    return shared


class _Face:
    _loop: _Loop

    def _block(self, coro: Coroutine[Any, Any, T]) -> T:
        return self._loop.run(coro)


class Pty(_Face):
    """Sync face of :class:`PtySession`: an interactive terminal inside a sandbox."""

    def __init__(self, target: PtySession, loop: _Loop) -> None:
        self._target = target
        self._loop = loop
        self.pid = target.pid

    @property
    def exit_code(self) -> int | None:
        """The shell's exit code, once ``output()`` has seen it end."""
        return self._target.exit_code

    @twin(PtySession.output)
    def output(self) -> Iterator[bytes]:
        chunks = self._target.output()
        while True:
            try:
                yield self._block(_next(chunks))
            except StopAsyncIteration:
                return

    @twin(PtySession.send)
    def send(self, data: bytes) -> None:
        self._block(self._target.send(data))

    @twin(PtySession.resize)
    def resize(self, cols: int, rows: int) -> None:
        self._block(self._target.resize(cols, rows))

    @twin(PtySession.close)
    def close(self) -> None:
        self._block(self._target.close())


class Sandbox(_Face):
    """Sync face of :class:`AsyncSandbox`: the same methods, blocking."""

    def __init__(self, target: AsyncSandbox, loop: _Loop) -> None:
        self._target = target
        self._loop = loop
        self.sandbox_id = target.sandbox_id
        self.template_id = target.template_id

    def __repr__(self) -> str:
        return f"Sandbox({self.sandbox_id!r})"

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self._block(self._target.kill())

    @twin(AsyncSandbox.exec)
    def exec(
        self,
        cmd: str | list[str],
        *,
        user: str | None = None,
        cwd: str | None = None,
        envs: Mapping[str, str] | None = None,
        timeout: float | None = DEFAULT_EXEC_TIMEOUT,
        on_stdout: OutputFn | None = None,
        on_stderr: OutputFn | None = None,
        check: bool = False,
        scoring: bool = False,
        max_output: int | None = None,
    ) -> CommandResult:
        return self._block(
            self._target.exec(
                cmd,
                user=user,
                cwd=cwd,
                envs=envs,
                timeout=timeout,
                on_stdout=on_stdout,
                on_stderr=on_stderr,
                check=check,
                scoring=scoring,
                max_output=max_output,
            )
        )

    @twin(AsyncSandbox.pty)
    def pty(self, *, cols: int = 80, rows: int = 24, user: str | None = None, cmd: list[str] | None = None) -> Pty:
        return Pty(self._block(self._target.pty(cols=cols, rows=rows, user=user, cmd=cmd)), self._loop)

    @twin(AsyncSandbox.write)
    def write(self, path: str, data: bytes | str, *, user: str | None = None) -> None:
        self._block(self._target.write(path, data, user=user))

    @twin(AsyncSandbox.write_from)
    def write_from(
        self,
        path: str,
        local: str | os.PathLike[str],
        *,
        user: str | None = None,
        on_progress: ProgressFn | None = None,
    ) -> int:
        return self._block(self._target.write_from(path, local, user=user, on_progress=on_progress))

    @twin(AsyncSandbox.read)
    def read(self, path: str, *, user: str | None = None, max_bytes: int | None = None) -> bytes:
        return self._block(self._target.read(path, user=user, max_bytes=max_bytes))

    @twin(AsyncSandbox.read_to)
    def read_to(
        self, path: str, sink: Callable[[bytes], object], *, on_size: Callable[[int], object] | None = None
    ) -> int:
        return self._block(self._target.read_to(path, sink, on_size=on_size))

    @twin(AsyncSandbox.ls)
    def ls(self, path: str = "", *, depth: int = 1) -> list[dict[str, Any]]:
        return self._block(self._target.ls(path, depth=depth))

    @twin(AsyncSandbox.remove)
    def remove(self, path: str) -> None:
        self._block(self._target.remove(path))

    @twin(AsyncSandbox.info)
    def info(self) -> SandboxInfo:
        return self._block(self._target.info())

    @twin(AsyncSandbox.rollout_log)
    def rollout_log(self) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.rollout_log())

    @twin(AsyncSandbox.pause)
    def pause(self, *, keep_memory: bool = True) -> None:
        self._block(self._target.pause(keep_memory=keep_memory))

    @twin(AsyncSandbox.resume)
    def resume(self, *, timeout: int | None = None) -> None:
        self._block(self._target.resume(timeout=timeout))

    @twin(AsyncSandbox.snapshot)
    def snapshot(self, name: str | None = None, *, durable: bool = False) -> str:
        return self._block(self._target.snapshot(name, durable=durable))

    @twin(AsyncSandbox.fork)
    def fork(
        self,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        clone_volumes: bool = False,
    ) -> list[Sandbox]:
        children = self._block(
            self._target.fork(count, timeout=timeout, metadata=metadata, clone_volumes=clone_volumes)
        )
        return [Sandbox(child, self._loop) for child in children]

    @twin(AsyncSandbox.set_timeout)
    def set_timeout(self, seconds: int) -> None:
        self._block(self._target.set_timeout(seconds))

    @twin(AsyncSandbox.kill)
    def kill(self) -> bool:
        return self._block(self._target.kill())


class Client(_Face):
    """Sync face of :class:`AsyncClient`: ``with Client() as c: sbx = c.create()``."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, request_timeout: float | None = None
    ) -> None:
        self._loop = _Loop()
        self._target = self._block(_make(url, api_key, request_timeout))

    @property
    def config(self) -> ClientConfig:
        """Where the client goes and with what key (argument, then AENV_* variables, then defaults)."""
        return self._target.config

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the client's connections (its sandboxes live on)."""
        self._block(self._target.aclose())
        self._loop.close()

    @twin(AsyncClient.create)
    def create(
        self,
        template: str = "base",
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        auto_pause: bool = False,
        keep_memory: bool = True,
        limits: Mapping[str, Any] | None = None,
        auto_resume: bool = False,
        grace: int | None = None,
        image: str | None = None,
        volumes: Mapping[str, str] | None = None,
    ) -> Sandbox:
        return Sandbox(
            self._block(
                self._target.create(
                    template,
                    timeout=timeout,
                    metadata=metadata,
                    envs=envs,
                    auto_pause=auto_pause,
                    keep_memory=keep_memory,
                    limits=limits,
                    auto_resume=auto_resume,
                    grace=grace,
                    image=image,
                    volumes=volumes,
                )
            ),
            self._loop,
        )

    @twin(AsyncClient.connect)
    def connect(self, sandbox_id: str, *, timeout: int | None = None) -> Sandbox:
        return Sandbox(self._block(self._target.connect(sandbox_id, timeout=timeout)), self._loop)

    @twin(AsyncClient.list)
    def list(
        self, *, state: list[str] | None = None, metadata: Mapping[str, str] | None = None, all_teams: bool = False
    ) -> list[SandboxInfo]:
        return self._block(self._target.list(state=state, metadata=metadata, all_teams=all_teams))

    @twin(AsyncClient.templates)
    def templates(self) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.templates())

    @twin(AsyncClient.warm_pool)
    def warm_pool(self, template: str, size: int | None | Literal["keep"] = "keep") -> dict[str, Any]:
        return self._block(self._target.warm_pool(template, size))

    @twin(AsyncClient.template_from_image)
    def template_from_image(
        self,
        name: str,
        image: str,
        *,
        username: str | None = None,
        password: str | None = None,
        on_log: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int, int, int], None] | None = None,
    ) -> dict[str, Any]:
        return self._block(
            self._target.template_from_image(
                name, image, username=username, password=password, on_log=on_log, on_progress=on_progress
            )
        )

    @twin(AsyncClient.fetch_template)
    def fetch_template(self, name: str, *, on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        return self._block(self._target.fetch_template(name, on_progress=on_progress))

    @twin(AsyncClient.build)
    def build(
        self,
        name: str,
        context: str | os.PathLike[str] = ".",
        *,
        dockerfile: str = "Dockerfile",
        build_args: Mapping[str, str] | None = None,
        on_log: Callable[[str], None] | None = None,
        on_upload: ProgressFn | None = None,
    ) -> dict[str, Any]:
        return self._block(
            self._target.build(
                name, context, dockerfile=dockerfile, build_args=build_args, on_log=on_log, on_upload=on_upload
            )
        )

    @twin(AsyncClient.build_builtin)
    def build_builtin(
        self, name: str = "desktop", *, browser: str | None = None, on_log: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        return self._block(self._target.build_builtin(name, browser=browser, on_log=on_log))

    @twin(AsyncClient.nodes)
    def nodes(self) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.nodes())

    @twin(AsyncClient.node)
    def node(self, node_id: str) -> dict[str, Any]:
        return self._block(self._target.node(node_id))

    @twin(AsyncClient.drain_node)
    def drain_node(
        self, node_id: str, *, move: bool = False, on_progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        return self._block(self._target.drain_node(node_id, move=move, on_progress=on_progress))

    @twin(AsyncClient.undrain_node)
    def undrain_node(self, node_id: str) -> dict[str, Any]:
        return self._block(self._target.undrain_node(node_id))

    @twin(AsyncClient.logs)
    def logs(self, sandbox_id: str) -> dict[str, Any]:
        return self._block(self._target.logs(sandbox_id))

    @twin(AsyncClient.rollout_log)
    def rollout_log(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.rollout_log(sandbox_id))

    @twin(AsyncClient.overview)
    def overview(self) -> dict[str, Any]:
        return self._block(self._target.overview())

    @twin(AsyncClient.images)
    def images(self) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.images())

    @twin(AsyncClient.prefetch_images)
    def prefetch_images(self, images: Sequence[str]) -> dict[str, Any]:
        return self._block(self._target.prefetch_images(images))

    @twin(AsyncClient.prefetch_status)
    def prefetch_status(self, prefetch_id: str) -> dict[str, Any]:
        return self._block(self._target.prefetch_status(prefetch_id))

    @twin(AsyncClient.repository)
    def repository(self) -> dict[str, Any]:
        return self._block(self._target.repository())

    @twin(AsyncClient.repository_gc)
    def repository_gc(self) -> dict[str, Any]:
        return self._block(self._target.repository_gc())

    @twin(AsyncClient.snapshots)
    def snapshots(self) -> builtins.list[dict[str, Any]]:
        return self._block(self._target.snapshots())

    @twin(AsyncClient.delete_snapshot)
    def delete_snapshot(self, snapshot_id: str) -> None:
        self._block(self._target.delete_snapshot(snapshot_id))


def kill_all_sync(sandboxes: list[Sandbox]) -> None:
    """Kill them all (at once), each whatever happens to the others."""
    if sandboxes:
        sandboxes[0]._block(kill_all([s._target for s in sandboxes]))


async def _next(chunks: AsyncIterator[bytes]) -> bytes:
    return await anext(chunks)


async def _make(url: str | None, api_key: str | None, request_timeout: float | None) -> AsyncClient:
    return AsyncClient(url, api_key, request_timeout=request_timeout)


__all__ = ["Client", "Pty", "Sandbox"]
