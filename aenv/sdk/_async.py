"""The native async client. The data plane is E2B's envd API (Connect JSON), as the server serves it."""

from __future__ import annotations

import asyncio
import base64
import builtins
import json
import os
import tempfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Literal, TypeVar

import httpx

from aenv.errors import AenvError, CommandFailed, SandboxGone, SandboxNotFound, WrongState, from_body
from aenv.sdk._config import ClientConfig
from aenv.sdk._templates import ProgressFn, _chunks_of, _pack_context, _recipe_in, _template_stream
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

T = TypeVar("T")
SCORING_HEADER = "Aenv-Scoring"  # a scoring command may run in the grace period after a timeout


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
    ) -> CommandResult:
        """Run a command (a shell string through `bash -l -c`, or an argv list) and wait for it.

        ``timeout``: seconds the command may run, 60 by default (``DEFAULT_EXEC_TIMEOUT``); past
        it the sandbox's agent kills it and this raises ``OperationTimeout``. ``None`` or 0: no
        limit. A non-zero exit is no error (see ``exit_code``) unless ``check``: then it raises
        ``CommandFailed`` with the exit code and the end of the output. ``scoring``: a scoring
        command, which may still run in the grace period after the sandbox's timeout
        (``create(grace=...)``). A sandbox that is gone, or goes while the command runs (killed,
        timed out, died), raises ``SandboxGone``. On a paused sandbox this raises ``WrongState``
        (resume it first) unless it was created with ``auto_resume``."""
        try:
            result = await self._exec(cmd, user, cwd, envs, timeout, on_stdout, on_stderr, scoring)
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
        out: list[str] = []
        err: list[str] = []
        exit_code, error = -1, None
        request_timeout = httpx.Timeout(self.client.config.request_timeout, read=(timeout + 30) if timeout else None)
        async with self.client._http.stream(
            "POST",
            "/process.Process/Start",
            content=_envelope({"process": process, "stdin": False}),
            headers=self._headers(headers),
            timeout=request_timeout,
        ) as response:
            if response.status_code != 200:
                await response.aread()
                raise_for_envd(response, self.sandbox_id)
            async for flags, msg in _envelopes(response):
                if flags & 0x02:
                    if msg.get("error"):
                        raise _connect_error(msg["error"])
                    break
                event = msg.get("event", {})
                data = event.get("data")
                if data:
                    for name, sink, fn in (("stdout", out, on_stdout), ("stderr", err, on_stderr)):
                        if name in data:
                            text = base64.b64decode(data[name]).decode(errors="replace")
                            sink.append(text)
                            if fn:
                                fn(text)
                elif "end" in event:
                    exit_code = int(event["end"].get("exitCode", 0))
                    error = event["end"].get("error")
        return CommandResult(exit_code, "".join(out), "".join(err), error)

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
        r = await self.client._http.post(
            "/files",
            params=params,
            content=payload,
            headers=self._headers({"Content-Type": "application/octet-stream"}),
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

    async def read(self, path: str, *, user: str | None = None) -> bytes:
        """The bytes of ``path`` in the sandbox."""
        params = {"path": path, **({"username": user} if user else {})}
        r = await self.client._http.get("/files", params=params, headers=self._headers())
        raise_for_envd(r, self.sandbox_id)
        return r.content

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
    ) -> list[AsyncSandbox]:
        """N children from this sandbox's exact state; raises if any child failed (others are killed).
        ``metadata`` is added to this sandbox's metadata for the children: one map for all, or a
        list of ``count`` maps, one per child (e.g. ``[{"child": str(i)} for i in range(n)]``)."""
        payload: dict[str, Any] = {"count": count}
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


class AsyncClient:
    """Entry point: ``async with AsyncClient() as c: sbx = await c.create()``."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, request_timeout: float | None = None
    ) -> None:
        self.config = ClientConfig.resolve(url, api_key, request_timeout)
        self._auth = {"X-API-Key": self.config.api_key} if self.config.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.config.url, timeout=self.config.request_timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client's connections (its sandboxes live on)."""
        await self._http.aclose()

    async def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        r = await self._http.get(path, params=params, headers=self._auth)
        _raise_for(r)
        return r.json()

    async def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        r = await self._http.post(path, json=body, headers=self._auth)
        _raise_for(r)
        return r.json() if r.content else {}

    async def create(
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
    ) -> AsyncSandbox:
        """A new sandbox; with ``auto_pause`` its timeout pauses it (keeping only its file system
        unless ``keep_memory``) instead of killing it; with ``auto_resume`` its use (a command, a
        file, its ports) resumes it when paused with its memory. ``timeout``: seconds it runs
        (the node's default, 300, when None), and again after each resume that names none.
        ``grace``: seconds it is held after its timeout for scoring: its commands stop at the
        timeout, only ``exec(..., scoring=True)`` runs until the grace period ends it."""
        body: dict[str, Any] = {"templateID": template, "metadata": dict(metadata or {}), "envVars": dict(envs or {})}
        if timeout is not None:
            body["timeout"] = timeout
        if grace:
            body["grace"] = grace
        if auto_pause:
            body["autoPause"] = True
        if auto_resume:
            body["autoResume"] = True
        if not keep_memory:
            body["autoPauseMemory"] = False
        if limits:
            body["limits"] = dict(limits)
        if image is not None:  # an OCI image reference, pulled and built on its first create
            del body["templateID"]
            body["image"] = image
        return AsyncSandbox(self, await self._post("/v2/sandboxes", body))

    async def connect(self, sandbox_id: str, *, timeout: int | None = None) -> AsyncSandbox:
        """A handle on an existing sandbox; a paused one is resumed, with its own timeout unless
        ``timeout`` names one (as a sandbox's ``resume``)."""
        body = await self._post(f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": timeout} if timeout else {})
        return AsyncSandbox(self, body)

    async def list(
        self, *, state: list[str] | None = None, metadata: Mapping[str, str] | None = None
    ) -> list[SandboxInfo]:
        """The sandboxes in these states (all when ``state`` is None) with this metadata."""
        from urllib.parse import quote

        params: dict[str, Any] = {}
        if state:
            params["state"] = ",".join(state)
        if metadata:
            params["metadata"] = "&".join(f"{quote(k)}={quote(v)}" for k, v in metadata.items())
        out: builtins.list[SandboxInfo] = []
        token: str | None = None
        while True:
            if token:
                params["nextToken"] = token
            r = await self._http.get("/v2/sandboxes", params=params, headers=self._auth)
            _raise_for(r)
            out += [SandboxInfo.from_json(b) for b in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                return out

    async def templates(self) -> builtins.list[dict[str, Any]]:
        """The node's templates."""
        result: builtins.list[dict[str, Any]] = await self._get("/templates")
        return result

    async def warm_pool(self, template: str, size: int | None | Literal["keep"] = "keep") -> dict[str, Any]:
        """The template's warm pool (idle sandboxes restored ahead of creates); with ``size``, first
        set the most it keeps (None: back to the node's default, ``AENV_WARM_POOL``)."""
        from urllib.parse import quote

        path = f"/templates/{quote(template, safe='')}/warm-pool"
        if size == "keep":
            result: dict[str, Any] = await self._get(path)
            return result
        r = await self._http.put(path, json={"size": size}, headers=self._auth)
        _raise_for(r)
        answer: dict[str, Any] = r.json()
        return answer

    async def template_from_image(
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
        body: dict[str, Any] = {"name": name, "image": image}
        if username:
            body.update(username=username, password=password or "")
        if on_log is None and on_progress is None:
            r = await self._http.post("/templates/from-image", json=body, headers=self._auth, timeout=3600)
            _raise_for(r)
            result: dict[str, Any] = r.json()
            return result
        headers = {**self._auth, "Accept": "application/x-ndjson"}
        async with self._http.stream("POST", "/templates/from-image", json=body, headers=headers, timeout=None) as r:
            return await _template_stream(r, on_log, on_progress)

    async def fetch_template(
        self, name: str, *, on_progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Bring a committed template's or snapshot's files into the node's cache from the
        repository, ahead of its first create; ``on_progress(done, total)`` in bytes. Returns
        ``{"template" | "snapshot": ..., "fetchedBytes": N}``."""
        from urllib.parse import quote

        path = f"/templates/{quote(name, safe='')}/fetch"
        if on_progress is None:
            r = await self._http.post(path, headers=self._auth, timeout=None)
            _raise_for(r)
            result: dict[str, Any] = r.json()
            return result
        headers = {**self._auth, "Accept": "application/x-ndjson"}
        async with self._http.stream("POST", path, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                item = json.loads(line) if line.strip() else {}
                if "progress" in item:
                    on_progress(item["progress"]["done"], item["progress"]["total"])
                elif "error" in item:
                    raise from_body(int(item["error"].get("code", 500)), item["error"])
                elif "fetchedBytes" in item:
                    return dict(item)
        raise AenvError("the fetch's stream ended without a result")

    async def build(
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
        dockerfile, outside = _recipe_in(Path(context), dockerfile)
        params: builtins.list[tuple[str, Any]] = [("name", name), ("dockerfile", dockerfile)]
        params += [("buildArg", f"{k}={v}") for k, v in (build_args or {}).items()]
        # Packed to a temporary file, not memory: contexts of several GiB exist (datasets, weights).
        with tempfile.TemporaryFile() as packed:
            await asyncio.to_thread(_pack_context, packed, Path(context), outside, dockerfile)
            size = packed.tell()
            packed.seek(0)
            return await self._send_build(packed, size, params, on_log, on_upload)

    async def _send_build(
        self,
        packed: BinaryIO,
        size: int,
        params: builtins.list[tuple[str, Any]],
        on_log: Callable[[str], None] | None,
        on_upload: ProgressFn | None,
    ) -> dict[str, Any]:
        headers = {**self._auth, "Content-Length": str(size)}
        body = _chunks_of(packed, size, on_upload)
        async with self._http.stream(
            "POST", "/templates/build", params=params, content=body, headers=headers, timeout=None
        ) as r:
            return await _template_stream(r, on_log, None)

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """A cluster's nodes with their load (a gateway's ``GET /nodes``; a lone node has none):
        E2B's node fields (``nodeID``, ``status``: ready, draining or unhealthy, ``sandboxCount``,
        ``allocatedCPU``, ...) and aenv's (``address``, ``room``, ``maxSandboxes``, ...)."""
        result: builtins.list[dict[str, Any]] = await self._get("/nodes")
        return result

    async def node(self, node_id: str) -> dict[str, Any]:
        """One node of a cluster (a gateway's ``GET /nodes/{id}``)."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/nodes/{quote(node_id, safe='')}")
        return result

    async def drain_node(
        self, node_id: str, *, move: bool = False, on_progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Drain a cluster's node (a gateway's ``POST /nodes/{id}/drain``): it takes no new work and
        pauses its running sandboxes durably (``move``: and resumes them on other nodes). Each
        progress report goes to ``on_progress``; returns the last one (``done``)."""
        from urllib.parse import quote

        path = f"/nodes/{quote(node_id, safe='')}/drain"
        last: dict[str, Any] | None = None
        async with self._http.stream("POST", path, json={"move": move}, headers=self._auth, timeout=None) as r:
            if r.status_code != 200:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                last = json.loads(line)
                if on_progress is not None:
                    on_progress(last)
        if last is None or not last.get("done"):
            raise AenvError("the drain's progress stream ended before the drain did")
        return last

    async def logs(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's recent commands (newest first, with their exit codes) and its log (the node's
        events for it and its agent's lines, oldest first)."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/sandboxes/{quote(sandbox_id, safe='')}/logs")
        return result

    async def rollout_log(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """A sandbox's rollout log by id (see the sandbox's ``rollout_log``), without resuming it."""
        from urllib.parse import quote

        r = await self._http.get(f"/sandboxes/{quote(sandbox_id, safe='')}/rollout-log", headers=self._auth)
        _raise_for(r)
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    async def overview(self) -> dict[str, Any]:
        """What the dashboard shows of a node or a cluster: ``nodes`` (state, load, capacity,
        cache use) and ``stats`` (lifecycle counters and latency histograms, commands by outcome
        and their start latency, since start)."""
        nodes, stats = await asyncio.gather(self._get("/dashboard/api/nodes"), self._get("/dashboard/api/stats"))
        return {"nodes": nodes, "stats": stats}

    async def images(self) -> builtins.list[dict[str, Any]]:
        """The images the node holds as templates, or evicted: reference, digest, template id,
        size (its compressed layers), bytes stored here, last use, in use, state (local or evicted)."""
        result: builtins.list[dict[str, Any]] = await self._get("/images")
        return result

    async def prefetch_images(self, images: Sequence[str]) -> dict[str, Any]:
        """Start pulling ``images`` and making them templates ahead of their first creates; the
        job (``prefetchID``, each image's ``state``: pending, pulling, ready or failed)."""
        result: dict[str, Any] = await self._post("/images/prefetch", {"images": list(images)})
        return result

    async def prefetch_status(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress: each image's state, bytes pulled, template id or error."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/images/prefetch/{quote(prefetch_id, safe='')}")
        return result

    async def repository(self) -> dict[str, Any]:
        """Where the node commits templates and snapshots, and what is not committed yet."""
        result: dict[str, Any] = await self._get("/repository")
        return result

    async def repository_gc(self) -> dict[str, Any]:
        """Collect repository chunks no template or snapshot needs any more."""
        result: dict[str, Any] = await self._post("/repository/gc", {})
        return result

    async def snapshots(self) -> builtins.list[dict[str, Any]]:
        """Every snapshot, newest first (the API answers them in pages)."""
        out: builtins.list[dict[str, Any]] = []
        params: dict[str, Any] = {}
        while True:
            r = await self._http.get("/snapshots", params=params, headers=self._auth)
            _raise_for(r)
            out += r.json()
            params["nextToken"] = r.headers.get("x-next-token")
            if not params["nextToken"]:
                return out

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (sandboxes made from it live on)."""
        r = await self._http.delete(f"/snapshots/{snapshot_id}", headers=self._auth)
        _raise_for(r)
