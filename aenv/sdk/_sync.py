"""The sync client: the async client run on a private event loop thread (never a hand-written
twin of its logic). Each method is a thin wrapper with the async one's signature and docstring, so
``dir()``, ``help()`` and IDEs show them; tests/sdk/test_sdk_faces.py checks that every async
method has its twin and that the two agree."""

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

    def output(self) -> Iterator[bytes]:
        """What the terminal prints, chunk by chunk, until the shell ends."""
        chunks = self._target.output()
        while True:
            try:
                yield self._block(_next(chunks))
            except StopAsyncIteration:
                return

    def send(self, data: bytes) -> None:
        """Type ``data`` into the terminal."""
        self._block(self._target.send(data))

    def resize(self, cols: int, rows: int) -> None:
        """Change the terminal's size."""
        self._block(self._target.resize(cols, rows))

    def close(self) -> None:
        """Stop following the terminal (its shell runs on until it ends)."""
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
        """Run a command (a shell string through `bash -l -c`, or an argv list) and wait for it.

        ``timeout``: seconds the command may run, 60 by default (``DEFAULT_EXEC_TIMEOUT``); past
        it the sandbox's agent kills it and this raises ``OperationTimeout``. ``None`` or 0: no
        limit. A non-zero exit is no error (see ``exit_code``) unless ``check``: then it raises
        ``CommandFailed`` with the exit code and the end of the output. ``scoring``: a scoring
        command, which may still run in the grace period after the sandbox's timeout
        (``create(grace=...)``). A sandbox that is gone, or goes while the command runs (killed,
        timed out, died), raises ``SandboxGone``. On a paused sandbox this raises ``WrongState``
        (resume it first) unless it was created with ``auto_resume``. ``max_output``: bytes kept of
        each of stdout and stderr; once either has more, the command is killed (SIGKILL, its whole
        session) and the result says ``truncated``: what it wrote past that is never held here."""
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

    def pty(self, *, cols: int = 80, rows: int = 24, user: str | None = None, cmd: list[str] | None = None) -> Pty:
        """An interactive terminal running ``cmd`` (a login shell by default) of ``cols`` x ``rows``."""
        return Pty(self._block(self._target.pty(cols=cols, rows=rows, user=user, cmd=cmd)), self._loop)

    def write(self, path: str, data: bytes | str, *, user: str | None = None) -> None:
        """Write ``data`` (text as UTF-8) to ``path`` in the sandbox, making its directories."""
        self._block(self._target.write(path, data, user=user))

    def write_from(
        self,
        path: str,
        local: str | os.PathLike[str],
        *,
        user: str | None = None,
        on_progress: ProgressFn | None = None,
    ) -> int:
        """Stream local file ``local`` to ``path`` in the sandbox without reading it into memory;
        ``on_progress(sent, total)`` after each chunk. Returns the bytes sent."""
        return self._block(self._target.write_from(path, local, user=user, on_progress=on_progress))

    def read(self, path: str, *, user: str | None = None, max_bytes: int | None = None) -> bytes:
        """The bytes of ``path`` in the sandbox. ``max_bytes``: a larger file raises
        ``PayloadTooLarge`` as soon as its size or its bytes say so (never read whole first)."""
        return self._block(self._target.read(path, user=user, max_bytes=max_bytes))

    def read_to(
        self, path: str, sink: Callable[[bytes], object], *, on_size: Callable[[int], object] | None = None
    ) -> int:
        """Stream a file out of the sandbox chunk by chunk; returns its size. ``on_size`` hears
        the size the sandbox gives before the first chunk (e.g. for a progress bar's total)."""
        return self._block(self._target.read_to(path, sink, on_size=on_size))

    def ls(self, path: str = "", *, depth: int = 1) -> list[dict[str, Any]]:
        """The entries of directory ``path`` (``depth`` levels down), as envd lists them."""
        return self._block(self._target.ls(path, depth=depth))

    def remove(self, path: str) -> None:
        """Remove a file or a directory with everything in it."""
        self._block(self._target.remove(path))

    def info(self) -> SandboxInfo:
        """Its state, template, metadata and times (``end_at``: when its timeout ends it)."""
        return self._block(self._target.info())

    def rollout_log(self) -> builtins.list[dict[str, Any]]:
        """Its rollout log: each command it ran (exec, E2B's commands, a terminal) that has ended,
        oldest first, with ``exitCode``, the end of its ``stdout`` and ``stderr`` (their sizes in
        ``stdoutBytes`` / ``stderrBytes``), ``seq`` and the ``sandboxID`` that ran it: a fork
        child's log begins with its source's commands. Kept by its node while it lives, paused or
        running (``AENV_ROLLOUT_LOG_KB`` of it, oldest commands dropped first)."""
        return self._block(self._target.rollout_log())

    def pause(self, *, keep_memory: bool = True) -> None:
        """Pause; without ``keep_memory`` only the file system is kept: processes end, and the
        resume boots the sandbox fresh (a new boot id, the template's start command again)."""
        self._block(self._target.pause(keep_memory=keep_memory))

    def resume(self, *, timeout: int | None = None) -> None:
        """Resume a paused sandbox (a running one is left running). Without ``timeout`` it runs
        for its own timeout again (the one it was created with, or last given by ``set_timeout``
        or a resume); with one, that becomes its timeout. A running sandbox's is only extended."""
        self._block(self._target.resume(timeout=timeout))

    def snapshot(self, name: str | None = None, *, durable: bool = False) -> str:
        """Snapshot this sandbox (it keeps running); with ``durable`` return only once the
        snapshot repository holds it."""
        return self._block(self._target.snapshot(name, durable=durable))

    def fork(
        self,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
    ) -> list[Sandbox]:
        """N children from this sandbox's exact state; raises if any child failed (others are killed).
        ``metadata`` is added to this sandbox's metadata for the children: one map for all, or a
        list of ``count`` maps, one per child (e.g. ``[{"child": str(i)} for i in range(n)]``)."""
        children = self._block(self._target.fork(count, timeout=timeout, metadata=metadata))
        return [Sandbox(child, self._loop) for child in children]

    def set_timeout(self, seconds: int) -> None:
        """The sandbox ends (is paused or killed) ``seconds`` from now; a later resume without a
        timeout gives it ``seconds`` again."""
        self._block(self._target.set_timeout(seconds))

    def kill(self) -> bool:
        """Kill it; False if it was already gone."""
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
    ) -> Sandbox:
        """A new sandbox; with ``auto_pause`` its timeout pauses it (keeping only its file system
        unless ``keep_memory``) instead of killing it; with ``auto_resume`` its use (a command, a
        file, its ports) resumes it when paused with its memory. ``timeout``: seconds it runs
        (the node's default, 300, when None), and again after each resume that names none.
        ``grace``: seconds it is held after its timeout for scoring: its commands stop at the
        timeout, only ``exec(..., scoring=True)`` runs until the grace period ends it."""
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
                )
            ),
            self._loop,
        )

    def connect(self, sandbox_id: str, *, timeout: int | None = None) -> Sandbox:
        """A handle on an existing sandbox; a paused one is resumed, with its own timeout unless
        ``timeout`` names one (as a sandbox's ``resume``)."""
        return Sandbox(self._block(self._target.connect(sandbox_id, timeout=timeout)), self._loop)

    def list(
        self, *, state: list[str] | None = None, metadata: Mapping[str, str] | None = None, all_teams: bool = False
    ) -> list[SandboxInfo]:
        """The sandboxes in these states (all when ``state`` is None) with this metadata; with
        ``all_teams``, every team's (the deployment's admin key only: ``X-Team-ID: *``)."""
        return self._block(self._target.list(state=state, metadata=metadata, all_teams=all_teams))

    def templates(self) -> builtins.list[dict[str, Any]]:
        """The node's templates."""
        return self._block(self._target.templates())

    def warm_pool(self, template: str, size: int | None | Literal["keep"] = "keep") -> dict[str, Any]:
        """The template's warm pool (idle sandboxes restored ahead of creates); with ``size``, first
        set the most it keeps (None: back to the node's default, ``AENV_WARM_POOL``)."""
        return self._block(self._target.warm_pool(template, size))

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
        """Pull ``image`` (an OCI reference; ``username``/``password`` for a private registry,
        used for this pull only) and commit it as template ``name``. With ``on_log`` or
        ``on_progress(layer, layers, done, total)`` the node streams the pull as it goes."""
        return self._block(
            self._target.template_from_image(
                name, image, username=username, password=password, on_log=on_log, on_progress=on_progress
            )
        )

    def fetch_template(self, name: str, *, on_progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Bring a committed template's or snapshot's files into the node's cache from the
        repository, ahead of its first create; ``on_progress(done, total)`` in bytes. Returns
        ``{"template" | "snapshot": ..., "fetchedBytes": N}``."""
        return self._block(self._target.fetch_template(name, on_progress=on_progress))

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
        """Build template ``name`` from ``context``/``dockerfile``; build logs go to ``on_log``,
        ``on_upload(sent, total)`` follows the packed context's upload. An absolute ``dockerfile``
        may be anywhere (as ``docker build -f``): one outside the context is sent along with it
        under a name of its own."""
        return self._block(
            self._target.build(
                name, context, dockerfile=dockerfile, build_args=build_args, on_log=on_log, on_upload=on_upload
            )
        )

    def nodes(self) -> builtins.list[dict[str, Any]]:
        """A cluster's nodes with their load (a gateway's ``GET /nodes``; a lone node has none):
        E2B's node fields (``nodeID``, ``status``: ready, draining or unhealthy, ``sandboxCount``,
        ``allocatedCPU``, ...) and aenv's (``address``, ``room``, ``maxSandboxes``, ...)."""
        return self._block(self._target.nodes())

    def node(self, node_id: str) -> dict[str, Any]:
        """One node of a cluster (a gateway's ``GET /nodes/{id}``)."""
        return self._block(self._target.node(node_id))

    def drain_node(
        self, node_id: str, *, move: bool = False, on_progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Drain a cluster's node (a gateway's ``POST /nodes/{id}/drain``): it takes no new work and
        pauses its running sandboxes durably (``move``: and resumes them on other nodes). Each
        progress report goes to ``on_progress``; returns the last one (``done``)."""
        return self._block(self._target.drain_node(node_id, move=move, on_progress=on_progress))

    def undrain_node(self, node_id: str) -> dict[str, Any]:
        """Take a drained (or draining) node back (a gateway's ``POST /nodes/{id}/undrain``): it
        takes new work again and a drain under way stops; a node not draining is left as it is.
        Returns the node as it is after (``status`` ready)."""
        return self._block(self._target.undrain_node(node_id))

    def logs(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's recent commands (newest first, with their exit codes) and its log (the node's
        events for it and its agent's lines, oldest first)."""
        return self._block(self._target.logs(sandbox_id))

    def rollout_log(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """A sandbox's rollout log by id (see the sandbox's ``rollout_log``), without resuming it."""
        return self._block(self._target.rollout_log(sandbox_id))

    def overview(self) -> dict[str, Any]:
        """What the dashboard shows of a node or a cluster: ``nodes`` (state, load, capacity,
        cache use) and ``stats`` (lifecycle counters and latency histograms, commands by outcome
        and their start latency, since start)."""
        return self._block(self._target.overview())

    def images(self) -> builtins.list[dict[str, Any]]:
        """The images the node holds as templates, or evicted: reference, digest, template id,
        size (its compressed layers), bytes stored here, last use, in use, state (local or evicted)."""
        return self._block(self._target.images())

    def prefetch_images(self, images: Sequence[str]) -> dict[str, Any]:
        """Start pulling ``images`` and making them templates ahead of their first creates; the
        job (``prefetchID``, each image's ``state``: pending, pulling, ready or failed)."""
        return self._block(self._target.prefetch_images(images))

    def prefetch_status(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress: each image's state, bytes pulled, template id or error."""
        return self._block(self._target.prefetch_status(prefetch_id))

    def repository(self) -> dict[str, Any]:
        """Where the node commits templates and snapshots, and what is not committed yet."""
        return self._block(self._target.repository())

    def repository_gc(self) -> dict[str, Any]:
        """Collect repository chunks no template or snapshot needs any more."""
        return self._block(self._target.repository_gc())

    def snapshots(self) -> builtins.list[dict[str, Any]]:
        """Every snapshot, newest first (the API answers them in pages)."""
        return self._block(self._target.snapshots())

    def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (sandboxes made from it live on)."""
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
