"""A sandbox in the native async SDK: its commands, files and terminal (envd's API, as the server
serves it) and its own lifecycle (pause, resume, snapshot, fork, kill).

Apart from :mod:`aenv.sdk._client` (the entry point and the node-wide calls) because a sandbox is the
resource users hold and call most; both are imported from :mod:`aenv.sdk`.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import httpx

from aenv.errors import (
    AenvError,
    CommandFailed,
    PayloadTooLarge,
    SandboxGone,
    SandboxNotFound,
    WrongState,
    from_body,
)
from aenv.sdk._templates import ProgressFn, _chunks_of
from aenv.sdk._wire import (
    DEFAULT_EXEC_TIMEOUT,
    ENVD_PORT,
    CommandResult,
    OutputFn,
    PtySession,
    raise_for_envd,
)
from aenv.sdk._wire import connect_error as _connect_error
from aenv.sdk._wire import envelope as _envelope
from aenv.sdk._wire import envelopes as _envelopes
from aenv.sdk._wire import gone as _gone
from aenv.sdk._wire import raise_for as _raise_for

if TYPE_CHECKING:
    from aenv.sdk._client import AsyncClient

T = TypeVar("T")
SCORING_HEADER = "Aenv-Scoring"  # a scoring command may run in the grace period after a timeout
SEND_CHUNK = 1 << 20  # bytes of a write handed to httpx at a time
KILLED_END_WAIT = 2.0  # seconds a command killed for its output has to end before exec stops following it


@dataclass(frozen=True, slots=True)
class SandboxInfo:
    sandbox_id: str
    template_id: str
    state: str
    metadata: dict[str, str] = field(default_factory=dict)
    started_at: str = ""
    end_at: str = ""
    parent_id: str | None = None
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_json(cls, body: Mapping[str, Any]) -> SandboxInfo:
        return cls(
            sandbox_id=body["sandboxID"],
            template_id=body.get("templateID", ""),
            state=body.get("state", "running"),
            metadata=dict(body.get("metadata") or {}),
            started_at=body.get("startedAt", ""),
            end_at=body.get("endAt", ""),
            parent_id=body.get("parentID"),
            raw=dict(body),
        )


class AsyncSandbox:
    """One sandbox. Obtain it from :class:`AsyncClient` (create, get, fork)."""

    def __init__(self, client: AsyncClient, body: Mapping[str, Any]) -> None:
        self.client = client
        self.sandbox_id: str = body["sandboxID"]
        self.template_id: str = body.get("templateID", "")
        self._token: str | None = body.get("envdAccessToken")

    def __repr__(self) -> str:
        return f"AsyncSandbox({self.sandbox_id!r})"

    async def __aenter__(self) -> AsyncSandbox:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.kill()

    # -- data plane ------------------------------------------------------------------------------------
    def _headers(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        h = {"E2b-Sandbox-Id": self.sandbox_id, "E2b-Sandbox-Port": str(ENVD_PORT)}
        if self._token:
            h["X-Access-Token"] = self._token
        h.update(extra or {})
        return h

    async def _rpc(self, path: str, msg: Mapping[str, Any]) -> Any:
        r = await self.client._http.post(f"/{path}", json=msg, headers=self._headers({"Connect-Protocol-Version": "1"}))
        if r.status_code in (409, 502):  # the node's answer for a paused or gone sandbox
            raise_for_envd(r, self.sandbox_id)
        if r.status_code >= 400:
            raise _connect_error(r.json())
        return r.json()

    async def exec(
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
        try:
            result = await self._exec(cmd, user, cwd, envs, timeout, on_stdout, on_stderr, scoring, max_output)
        except httpx.TransportError as exc:  # the node dropped the stream: is the sandbox gone?
            await self._raise_if_gone(exc)
            raise
        except AenvError as exc:
            if "unavailable" in exc.message and "not found" in exc.message:
                await self._raise_if_gone(exc)
            raise
        if check and result.exit_code != 0:
            shown = cmd if isinstance(cmd, str) else " ".join(cmd)
            raise CommandFailed(shown, result.exit_code, result.stdout, result.stderr, sandbox_id=self.sandbox_id)
        return result

    async def _raise_if_gone(self, cause: BaseException) -> None:
        """Raise ``SandboxGone`` (from ``cause``) if the sandbox is no more, ``WrongState`` if paused."""
        try:
            r = await self.client._http.get(f"/sandboxes/{self.sandbox_id}", headers=self.client._auth)
        except httpx.HTTPError:
            return
        if r.status_code == 404:
            raise _gone(self.sandbox_id) from cause
        if r.status_code == 200 and r.json().get("state") == "paused":
            raise WrongState(f"sandbox {self.sandbox_id} was paused", sandbox_id=self.sandbox_id) from cause

    async def _exec(
        self,
        cmd: str | list[str],
        user: str | None,
        cwd: str | None,
        envs: Mapping[str, str] | None,
        timeout: float | None,
        on_stdout: OutputFn | None,
        on_stderr: OutputFn | None,
        scoring: bool,
        max_output: int | None = None,
    ) -> CommandResult:
        argv = ["/bin/bash", "-l", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        process: dict[str, Any] = {"cmd": argv[0], "args": argv[1:]}
        if envs:
            process["envs"] = dict(envs)
        if cwd:
            process["cwd"] = cwd
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
        if timeout:
            headers["Connect-Timeout-Ms"] = str(int(timeout * 1000))
        if user:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        if scoring:
            headers[SCORING_HEADER] = "1"
        out, err = bytearray(), bytearray()
        exit_code, error, pid, truncated = -1, None, None, False
        request_timeout = httpx.Timeout(self.client.config.request_timeout, read=(timeout + 30) if timeout else None)
        try:
            async with (
                asyncio.timeout(None) as following,
                self.client._http.stream(
                    "POST",
                    "/process.Process/Start",
                    content=_envelope({"process": process, "stdin": False}),
                    headers=self._headers(headers),
                    timeout=request_timeout,
                ) as response,
            ):
                if response.status_code != 200:
                    await response.aread()
                    raise_for_envd(response, self.sandbox_id)
                async for flags, msg in _envelopes(response):
                    if flags & 0x02:
                        if msg.get("error") and not truncated:
                            raise _connect_error(msg["error"])
                        break
                    event = msg.get("event", {})
                    data = event.get("data")
                    if "start" in event:
                        pid = event["start"].get("pid")
                    elif data:
                        for name, sink, fn in (("stdout", out, on_stdout), ("stderr", err, on_stderr)):
                            if name not in data or truncated:
                                continue
                            chunk = base64.b64decode(data[name])
                            if max_output is not None and len(sink) + len(chunk) > max_output:
                                chunk = chunk[: max_output - len(sink)]
                                truncated = True
                            sink += chunk
                            if fn and chunk:
                                fn(chunk.decode(errors="replace"))
                        if truncated and following.when() is None:
                            # Past the bound: the command is killed; its end is awaited a moment (a
                            # child that left its session may hold the pipe open), what comes is dropped.
                            await self._kill_process(pid)
                            following.reschedule(asyncio.get_running_loop().time() + KILLED_END_WAIT)
                    elif "end" in event:
                        exit_code = int(event["end"].get("exitCode", 0))
                        error = event["end"].get("error")
        except TimeoutError:
            if not truncated:
                raise
        return CommandResult(exit_code, out.decode(errors="replace"), err.decode(errors="replace"), error, truncated)

    async def _kill_process(self, pid: int | None) -> None:
        """SIGKILL a command's session (what it started with it goes too); one that has ended is no error."""
        if pid is None:
            return
        try:
            await self._rpc("process.Process/SendSignal", {"process": {"pid": pid}, "signal": "SIGNAL_SIGKILL"})
        except (AenvError, httpx.HTTPError):
            pass

    async def pty(
        self, *, cols: int = 80, rows: int = 24, user: str | None = None, cmd: list[str] | None = None
    ) -> PtySession:
        """An interactive terminal running ``cmd`` (a login shell by default) of ``cols`` x ``rows``."""
        argv = cmd or ["/bin/bash", "-i", "-l"]
        body = {
            "process": {"cmd": argv[0], "args": argv[1:], "envs": {"TERM": "xterm-256color", "LANG": "C.UTF-8"}},
            "pty": {"size": {"cols": cols, "rows": rows}},
        }
        headers = {"Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
        if user:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:".encode()).decode()
        request = self.client._http.build_request(
            "POST",
            "/process.Process/Start",
            content=_envelope(body),
            headers=self._headers(headers),
            timeout=httpx.Timeout(30, read=None),
        )
        response = await self.client._http.send(request, stream=True)
        if response.status_code != 200:
            await response.aread()
            raise_for_envd(response, self.sandbox_id)
        stream = _envelopes(response)
        flags, first = await stream.__anext__()
        if flags & 0x02:
            await response.aclose()
            raise _connect_error(first.get("error") or {})
        return PtySession(self, response, stream, int(first["event"]["start"]["pid"]))

    async def write(self, path: str, data: bytes | str, *, user: str | None = None) -> None:
        """Write ``data`` (text as UTF-8) to ``path`` in the sandbox, making its directories."""
        payload = data.encode() if isinstance(data, str) else data
        params = {"path": path, **({"username": user} if user else {})}
        headers = {"Content-Type": "application/octet-stream", "Content-Length": str(len(payload))}
        r = await self.client._http.post(
            "/files", params=params, content=_SentOnce(payload), headers=self._headers(headers)
        )
        raise_for_envd(r, self.sandbox_id)

    async def write_from(
        self,
        path: str,
        local: str | os.PathLike[str],
        *,
        user: str | None = None,
        on_progress: ProgressFn | None = None,
    ) -> int:
        """Stream local file ``local`` to ``path`` in the sandbox without reading it into memory;
        ``on_progress(sent, total)`` after each chunk. Returns the bytes sent."""
        params = {"path": path, **({"username": user} if user else {})}
        with open(local, "rb") as source:
            total = os.fstat(source.fileno()).st_size
            r = await self.client._http.post(
                "/files",
                params=params,
                content=_chunks_of(source, total, on_progress),
                headers=self._headers({"Content-Type": "application/octet-stream", "Content-Length": str(total)}),
                timeout=httpx.Timeout(30, write=None, read=None),
            )
        raise_for_envd(r, self.sandbox_id)
        return total

    async def read(self, path: str, *, user: str | None = None, max_bytes: int | None = None) -> bytes:
        """The bytes of ``path`` in the sandbox. ``max_bytes``: a larger file raises
        ``PayloadTooLarge`` as soon as its size or its bytes say so (never read whole first)."""
        params = {"path": path, **({"username": user} if user else {})}
        if max_bytes is None:
            r = await self.client._http.get("/files", params=params, headers=self._headers())
            raise_for_envd(r, self.sandbox_id)
            return r.content
        too_large = PayloadTooLarge(f"{path} is larger than {max_bytes} bytes")
        data = bytearray()
        async with self.client._http.stream("GET", "/files", params=params, headers=self._headers()) as r:
            if r.status_code >= 400:
                await r.aread()
                raise_for_envd(r, self.sandbox_id)
            length = r.headers.get("content-length", "")
            if length.isdigit() and int(length) > max_bytes:
                raise too_large
            async for chunk in r.aiter_bytes():
                if len(data) + len(chunk) > max_bytes:
                    raise too_large
                data += chunk
        return bytes(data)

    async def read_to(
        self, path: str, sink: Callable[[bytes], object], *, on_size: Callable[[int], object] | None = None
    ) -> int:
        """Stream a file out of the sandbox chunk by chunk; returns its size. ``on_size`` hears
        the size the sandbox gives before the first chunk (e.g. for a progress bar's total)."""
        total = 0
        async with self.client._http.stream("GET", "/files", params={"path": path}, headers=self._headers()) as r:
            if r.status_code >= 400:
                await r.aread()
                raise_for_envd(r, self.sandbox_id)
            length = r.headers.get("content-length", "")
            if on_size is not None and length.isdigit():
                on_size(int(length))
            async for chunk in r.aiter_bytes():
                sink(chunk)
                total += len(chunk)
        return total

    async def ls(self, path: str = "", *, depth: int = 1) -> list[dict[str, Any]]:
        """The entries of directory ``path`` (``depth`` levels down), as envd lists them."""
        body = await self._rpc("filesystem.Filesystem/ListDir", {"path": path, "depth": depth})
        entries: list[dict[str, Any]] = body.get("entries", [])
        return entries

    async def remove(self, path: str) -> None:
        """Remove a file or a directory with everything in it."""
        await self._rpc("filesystem.Filesystem/Remove", {"path": path})

    # -- control plane ---------------------------------------------------------------------------------
    async def _control(self, call: Awaitable[T]) -> T:
        """A control-plane call on this sandbox: its 404 says the sandbox is gone (``SandboxGone``)."""
        try:
            return await call
        except SandboxNotFound as exc:
            if isinstance(exc, SandboxGone):
                raise
            raise SandboxGone(exc.message, sandbox_id=self.sandbox_id) from exc

    async def info(self) -> SandboxInfo:
        """Its state, template, metadata and times (``end_at``: when its timeout ends it)."""
        return SandboxInfo.from_json(await self._control(self.client._get(f"/sandboxes/{self.sandbox_id}")))

    async def rollout_log(self) -> builtins.list[dict[str, Any]]:
        """Its rollout log: each command it ran (exec, E2B's commands, a terminal) that has ended,
        oldest first, with ``exitCode``, the end of its ``stdout`` and ``stderr`` (their sizes in
        ``stdoutBytes`` / ``stderrBytes``), ``seq`` and the ``sandboxID`` that ran it: a fork
        child's log begins with its source's commands. Kept by its node while it lives, paused or
        running (``AENV_ROLLOUT_LOG_KB`` of it, oldest commands dropped first)."""
        return await self._control(self.client.rollout_log(self.sandbox_id))

    async def pause(self, *, keep_memory: bool = True) -> None:
        """Pause; without ``keep_memory`` only the file system is kept: processes end, and the
        resume boots the sandbox fresh (a new boot id, the template's start command again)."""
        await self._control(self.client._post(f"/sandboxes/{self.sandbox_id}/pause", {"memory": keep_memory}))

    async def resume(self, *, timeout: int | None = None) -> None:
        """Resume a paused sandbox (a running one is left running). Without ``timeout`` it runs
        for its own timeout again (the one it was created with, or last given by ``set_timeout``
        or a resume); with one, that becomes its timeout. A running sandbox's is only extended."""
        body = await self._control(
            self.client._post(f"/v2/sandboxes/{self.sandbox_id}/connect", {"timeout": timeout} if timeout else {})
        )
        self._token = body.get("envdAccessToken", self._token)

    async def snapshot(self, name: str | None = None, *, durable: bool = False) -> str:
        """Snapshot this sandbox (it keeps running); with ``durable`` return only once the
        snapshot repository holds it."""
        payload: dict[str, Any] = {"durable": durable}
        if name:
            payload["name"] = name
        body = await self._control(self.client._post(f"/sandboxes/{self.sandbox_id}/snapshots", payload))
        return str(body["snapshotID"])

    async def fork(
        self,
        count: int = 1,
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | Sequence[Mapping[str, str]] | None = None,
        clone_volumes: bool = False,
    ) -> list[AsyncSandbox]:
        """N children from this sandbox's exact state; raises if any child failed (others are killed).
        ``metadata`` is added to this sandbox's metadata for the children: one map for all, or a
        list of ``count`` maps, one per child (e.g. ``[{"child": str(i)} for i in range(n)]``).
        ``clone_volumes``: each child mounts its own copy of each of this sandbox's volumes, as they
        are at the fork (a volume ``<name>-<child id>``, kept until deleted), not the shared ones."""
        payload: dict[str, Any] = {"count": count}
        if clone_volumes:
            payload["volumes"] = "clone"
        if timeout is not None:
            payload["timeout"] = timeout
        if isinstance(metadata, Mapping):
            payload["metadata"] = dict(metadata)
        elif metadata is not None:
            payload["metadata"] = [dict(m) for m in metadata]
        # The node finishes a fork whoever is waiting: one cancelled here (a rollout's deadline)
        # waits on for its answer and kills the children it names.
        forking = asyncio.ensure_future(self._fork(payload, count))
        try:
            return await asyncio.shield(forking)
        except asyncio.CancelledError:
            forking.add_done_callback(_kill_when_made)
            raise

    async def _fork(self, payload: dict[str, Any], count: int) -> list[AsyncSandbox]:
        items = await self._control(self.client._post(f"/sandboxes/{self.sandbox_id}/fork", payload))
        children = [AsyncSandbox(self.client, it["sandbox"]) for it in items if _made(it)]
        try:
            if len(children) != len(items) or not children:
                errors = [it["error"] for it in items if isinstance(it, dict) and isinstance(it.get("error"), dict)]
                error = errors[0] if errors else {"message": f"the fork answered {len(children)} of {count} children"}
                raise from_body(int(error.get("code", 500)), error)
        except BaseException:
            await kill_all(children)
            raise
        return children

    async def set_timeout(self, seconds: int) -> None:
        """The sandbox ends (is paused or killed) ``seconds`` from now; a later resume without a
        timeout gives it ``seconds`` again."""
        await self._control(self.client._post(f"/sandboxes/{self.sandbox_id}/timeout", {"timeout": seconds}))

    async def kill(self) -> bool:
        """Kill it; False if it was already gone."""
        r = await self.client._http.delete(f"/sandboxes/{self.sandbox_id}", headers=self.client._auth)
        if r.status_code == 404:
            return False
        _raise_for(r)
        return True


class _SentOnce:
    """A write's bytes as httpx's ``content``, let go of once sent. Given as bytes, httpx keeps
    them with its request, which its response holds in a reference cycle: each large write stayed
    in memory until the garbage collector next ran (a SandboxFusion service writing 15 MiB files
    grew by each one until then)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    async def __aiter__(self) -> AsyncIterator[bytes]:
        data, self._data = self._data, None
        if data is None:
            raise RuntimeError("a write's bytes are sent once")
        for at in range(0, len(data), SEND_CHUNK):
            yield data[at : at + SEND_CHUNK]


def _made(item: Any) -> bool:
    child = item.get("sandbox") if isinstance(item, dict) else None
    return isinstance(child, dict) and isinstance(child.get("sandboxID"), str)


_CLEANUPS: set[asyncio.Task[None]] = set()  # kills of abandoned forks' children, held until done


def _kill_when_made(forking: asyncio.Future[list[AsyncSandbox]]) -> None:
    if forking.cancelled() or forking.exception() is not None:
        return  # nothing made (or already killed by the fork's own cleanup)
    cleanup = asyncio.ensure_future(kill_all(forking.result()))
    _CLEANUPS.add(cleanup)
    cleanup.add_done_callback(_CLEANUPS.discard)


async def kill_all(sandboxes: list[AsyncSandbox]) -> None:
    """Kill them all, each whatever happens to the others; shielded, so that a cancellation does
    not leave some of them running (the kills go on)."""
    if sandboxes:
        await asyncio.shield(asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True))
