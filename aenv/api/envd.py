"""The envd data plane (process.Process, filesystem.Filesystem, /files, /health), served on the
host and carried out by the guest agent over the channel.

Requests reach this module already routed to one sandbox (by ``E2b-Sandbox-Id`` or by host name).
Reaching the agent and streaming its answers back (keepalives, a stream dropped when the sandbox
goes away) is aenv/api/envd_streams.py's.
"""

from __future__ import annotations

import base64
import hmac
import posixpath
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from aenv.api import connect, signed, uploads
from aenv.api.connect import BOOL, BYTES, ENUM, PATH, STRING, UINT16, UINT32, ConnectError, Message
from aenv.api.envd_streams import (
    DroppableStream,
    StreamDropped,
    agent_link,
    connect_error,
    open_first,
    server_stream,
)
from aenv.api.proxy import not_woken, sandbox_gone, sandbox_paused
from aenv.channel import DATA, END, ChannelClosed, Stream, end_error
from aenv.errors import (
    AenvError,
    AgentTimeout,
    AgentUnavailable,
    ClusterUnavailable,
    InsufficientStorage,
    InvalidRequest,
    RequestTimeout,
    WrongState,
    error_body,
    error_headers,
)
from aenv.guest import metadata
from aenv.node.service import (
    SCORING_HEADER,
    AgentLink,
    LiveSandbox,
    NodeService,
    RolloutLogs,
    SandboxState,
    grace_refusal,
)

ENVD_PORT = 49983
UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"
TOKEN_MISMATCH = "access token present in header but does not match"
METADATA_HEADER = "x-metadata-"  # envd's X-Metadata-<key> upload headers

Handler = Callable[[Request, LiveSandbox, str | None], Awaitable[Response]]


def _user(request: Request) -> str | None:
    """The user of E2B's ``Authorization: Basic <user:>`` header, if any."""
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:]).decode().split(":", 1)[0]
        except ValueError:
            return None
        return connect.checked_value(name, STRING, "the user") if name else None
    return None


# -- process.Process -------------------------------------------------------------------------------
# The messages of envd's services as aenv reads them (proto3 JSON; see connect.checked).
SELECTOR: Message = {"pid": UINT32, "tag": STRING}
PTY: Message = {"size": {"cols": UINT16, "rows": UINT16}}
INPUT: Message = {"stdin": BYTES, "pty": BYTES}
START: Message = {
    "process": {"cmd": STRING, "args": [STRING], "envs": ("map", STRING), "cwd": PATH},
    "pty": PTY,
    "tag": STRING,
    "stdin": BOOL,
}
STREAM_INPUT: Message = {"start": {"process": SELECTOR}, "data": {"input": INPUT}, "keepalive": {}}
WATCH: Message = {"path": PATH, "recursive": BOOL, "includeEntry": BOOL}


async def process_start(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request, START)
    proc = msg.get("process") or {}
    if not proc.get("cmd"):
        return Response(
            connect.end_stream(ConnectError("invalid_argument", "process.cmd is required")),
            media_type=connect.STREAM_CONTENT_TYPE,
        )
    params: dict[str, Any] = {"process": proc, "user": user, "timeoutMs": connect.timeout_ms(request)}
    if msg.get("pty"):
        params["pty"] = msg["pty"]
    if msg.get("tag") is not None:
        params["tag"] = msg["tag"]
    if "stdin" in msg:
        params["stdin"] = msg["stdin"]
    scoring = request.headers.get(SCORING_HEADER, "").strip().lower() in ("1", "true")
    refused = None if scoring else grace_refusal(sb)
    if refused is not None:  # past its timeout: only scoring commands (aenv/node/grace.py)
        return Response(
            connect.end_stream(ConnectError("failed_precondition", refused)), media_type=connect.STREAM_CONTENT_TYPE
        )
    record = sb.commands.start(proc, user=user or sb.rec.user or None, tag=msg.get("tag"), scoring=scoring)
    rollouts: RolloutLogs = request.state.rollouts
    record.output = rollouts.tail()
    record.on_end = lambda done: rollouts.append(sb.id, {"sandboxID": sb.id, **done.log_entry()})
    return await server_stream(request, sb, "process.start", params, record)


async def process_connect(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request, {"process": SELECTOR})
    return await server_stream(request, sb, "process.connect", {"process": msg.get("process") or {}})


async def _unary(sb: LiveSandbox, method: str, params: dict[str, Any], disk_mb: int | None = None) -> Response:
    try:
        result = await agent_link(sb).call(method, params)
    except Exception as exc:
        err = connect_error(exc)
        if err.code == "resource_exhausted" and method.startswith("fs."):
            # A full disk: envd answers a filesystem RPC that meets one with internal (the SDKs
            # read resource_exhausted as rate limiting, which a full disk is not).
            err = ConnectError("internal", _disk_full(err.message, disk_mb))
        return connect.unary_error(err)
    return JSONResponse(result if result is not None else {})


def _disk_full(message: str, disk_mb: int | None) -> str:
    return f"{message} (the sandbox's disk quota, diskSizeMB, is {disk_mb} MiB)"


def _unary_handler(method: str, schema: Message) -> Handler:
    async def handle(request: Request, sb: LiveSandbox, user: str | None) -> Response:
        try:
            params = await connect.read_request(request, schema)
        except ConnectError as exc:
            return connect.unary_error(exc)
        params["user"] = user
        return await _unary(sb, method, params, request.state.disk_mb)

    return handle


async def process_stream_input(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    reader = connect.EnvelopeReader(request, STREAM_INPUT)
    selector: dict[str, Any] | None = None
    try:
        while (msg := await reader.next()) is not None:
            if "start" in msg:
                selector = msg["start"].get("process") or {}
            elif "data" in msg and selector is not None:
                data = msg["data"].get("input") or {}
                await agent_link(sb).call("process.input", {"process": selector, "input": data})
    except Exception as exc:
        return Response(connect.end_stream(connect_error(exc)), media_type=connect.STREAM_CONTENT_TYPE)
    return Response(connect.message_envelope({}) + connect.end_stream(), media_type=connect.STREAM_CONTENT_TYPE)


async def fs_watch_dir(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request, WATCH)
    params = {
        "path": msg.get("path", ""),
        "recursive": msg.get("recursive", False),
        "includeEntry": msg.get("includeEntry", False),
        "user": user,
    }
    return await server_stream(request, sb, "fs.watch", params)


# Client streams: their requests' bodies are what a client types, and may pause for as long as it likes.
CLIENT_STREAMS = frozenset({"/process.Process/StreamInput"})
RPC: dict[str, Handler] = {
    "/process.Process/Start": process_start,
    "/process.Process/Connect": process_connect,
    "/process.Process/List": _unary_handler("process.list", {}),
    "/process.Process/SendInput": _unary_handler("process.input", {"process": SELECTOR, "input": INPUT}),
    "/process.Process/SendSignal": _unary_handler("process.signal", {"process": SELECTOR, "signal": ENUM}),
    "/process.Process/CloseStdin": _unary_handler("process.close_stdin", {"process": SELECTOR}),
    "/process.Process/Update": _unary_handler("process.update", {"process": SELECTOR, "pty": PTY}),
    "/process.Process/StreamInput": process_stream_input,
    "/filesystem.Filesystem/Stat": _unary_handler("fs.stat", {"path": PATH}),
    "/filesystem.Filesystem/ListDir": _unary_handler("fs.list", {"path": PATH, "depth": UINT32}),
    "/filesystem.Filesystem/MakeDir": _unary_handler("fs.mkdir", {"path": PATH}),
    "/filesystem.Filesystem/Move": _unary_handler("fs.move", {"source": PATH, "destination": PATH}),
    "/filesystem.Filesystem/Remove": _unary_handler("fs.remove", {"path": PATH}),
    "/filesystem.Filesystem/CreateWatcher": _unary_handler("fs.watch_create", WATCH),
    "/filesystem.Filesystem/GetWatcherEvents": _unary_handler("fs.watch_events", {"watcherId": STRING}),
    "/filesystem.Filesystem/RemoveWatcher": _unary_handler("fs.watch_remove", {"watcherId": STRING}),
    "/filesystem.Filesystem/WatchDir": fs_watch_dir,
}


# -- /files ------------------------------------------------------------------------------------------
def _file_error(request: Request, exc: BaseException) -> JSONResponse:
    """A failed /files request as envd answers it: ``{code: <HTTP status>, message}``."""
    if isinstance(exc, AenvError) and exc.status < 500:  # the client's mistake, found on the host
        return JSONResponse(error_body(exc), status_code=exc.status)
    err = connect_error(exc)
    if err.code == "resource_exhausted":
        full = InsufficientStorage(_disk_full(err.message, request.state.disk_mb))
        return JSONResponse(error_body(full), status_code=full.status)
    status = 502 if err.code == "unavailable" else connect.CODE_STATUS[err.code]
    return JSONResponse({"code": status, "message": err.message}, status_code=status)


def files_refusal(request: Request, token: str) -> str | None:
    """Why envd would refuse this /files request to a secure sandbox (its words, for a 401), or None.

    As envd: the access token header when one is given, else the signature (aenv/api/signed.py:
    read for a GET, write for a POST), then its expiry."""
    given = request.headers.get("x-access-token")
    if given:
        return None if hmac.compare_digest(given.encode(), token.encode()) else TOKEN_MISMATCH
    if not request.query_params.get("signature"):
        return "missing signature query parameter"
    if not signed.signed_by(request, token):
        return "invalid signature"
    expiration = signed.expiration_of(request)
    if expiration is not None and expiration < time.time():
        return "signature is already expired"
    return None


def _query_path(request: Request) -> str | None:
    path = request.query_params.get("path")
    return None if path is None else connect.path_string(path, "path")


def _query_user(request: Request, user: str | None) -> str | None:
    name = request.query_params.get("username")
    return connect.checked_value(name, connect.STRING, "username") if name else user


async def files_get(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    try:
        path, user = _query_path(request) or "", _query_user(request, user)
        link = agent_link(sb)
        stream, first = await open_first(link, "fs.read", {"path": path, "user": user})
    except Exception as exc:
        return _file_error(request, exc)
    sb.exchanges.add(stream)  # a pause lets the download finish first, a while
    entry = first.get("entry") if isinstance(first, dict) else None
    entry = entry if isinstance(entry, dict) else {}  # what the agent says is only a hint

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await link.within(stream.recv(), "fs.read")  # a stalled agent cuts the download short
                if item.kind == DATA:
                    yield item.data
                elif item.kind == END:
                    error = end_error(item.msg)
                    if error is not None:  # cut short: the client must not take it for the whole file
                        raise StreamDropped(error.message)
                    return
        finally:
            if not stream.remote_ended:
                stream.cancel()

    name, size = entry.get("name"), entry.get("size")
    headers = {
        "Content-Disposition": f'inline; filename="{quote(name if isinstance(name, str) else "file")}"',
        "Vary": "Accept-Encoding",
    }
    if isinstance(size, int) and not isinstance(size, bool) and size >= 0:
        headers["Content-Length"] = str(size)
    return DroppableStream(body(), media_type="application/octet-stream", headers=headers)


def _upload_metadata(request: Request) -> dict[str, str]:
    """envd's ``X-Metadata-<key>`` upload headers: keys lowercased, the first value of each, checked
    as envd checks them (400 "invalid metadata: ...") before anything reaches the sandbox."""
    found: dict[str, str] = {}
    for raw_name, raw_value in request.headers.raw:
        name = raw_name.decode("latin-1").lower()
        if name.startswith(METADATA_HEADER) and len(name) > len(METADATA_HEADER):
            found.setdefault(name[len(METADATA_HEADER) :], raw_value.decode("latin-1"))
    try:
        metadata.validate(found)
    except metadata.Invalid as exc:
        raise InvalidRequest(f"invalid metadata: {exc}") from exc
    return found


def _kept_metadata(written: dict[str, Any]) -> dict[str, str] | None:
    """The metadata the agent says the file has: a map of strings, or nothing."""
    kept = written.get("metadata")
    if isinstance(kept, dict) and kept and all(isinstance(k, str) and isinstance(v, str) for k, v in kept.items()):
        return kept
    return None


async def _write_file(
    sb: LiveSandbox, path: str, user: str | None, chunks: AsyncIterator[bytes], meta: dict[str, str]
) -> dict[str, Any]:
    """Write ``chunks`` into the sandbox as they come; the channel's credit window is all that is
    ever buffered. If the agent gives up (a full disk), its reason is what this raises. The file's
    metadata becomes ``meta`` (none clears it, as envd)."""
    link = agent_link(sb)
    stream = await link.open("fs.write", {"path": path, "user": user, "metadata": meta})
    try:
        try:
            async for chunk in chunks:
                if chunk:
                    await link.within(stream.send_data(chunk), "fs.write")
            await link.within(stream.send_eof(), "fs.write")
        except ChannelClosed:
            if not stream.remote_ended:
                raise
            # The agent ended the write before all was sent (e.g. refused the path): its answer says why.
        result = await link.within(stream.result(), "fs.write")
    except BaseException as exc:
        if not stream.remote_ended:
            await _withdraw(link, stream, waiting=not isinstance(exc, AgentTimeout | AgentUnavailable))
        raise
    written = result if isinstance(result, dict) else {}
    entry = {
        "path": str(written.get("path", path)),
        "name": str(written.get("name", posixpath.basename(path))),
        "type": "file",
    }
    kept = _kept_metadata(written)
    return {**entry, "metadata": kept} if kept else entry


async def _withdraw(link: AgentLink, stream: Stream, *, waiting: bool) -> None:
    """Give up a write. Unless the agent is not answering anyway, wait (within the deadline) for
    it to remove what it wrote: the client must not hear of the failure and then find the file."""
    try:
        if waiting:
            await link.within(stream.withdraw(), "fs.write")
    except (AgentTimeout, ChannelClosed):
        pass
    finally:
        stream.cancel()


async def _part_bytes(events: AsyncIterator[uploads.PartEvent]) -> AsyncIterator[bytes]:
    async for event in events:
        if isinstance(event, uploads.PartEnd):
            return
        if isinstance(event, bytes):
            yield event
    # A body cut short (no closing boundary) is not a whole file, whatever arrived of it.
    raise InvalidRequest("the multipart upload ends inside a file part")


async def _write_parts(
    request: Request, sb: LiveSandbox, path: str | None, user: str | None, meta: dict[str, str]
) -> list[dict[str, Any]]:
    """Each ``file`` part of a multipart upload, written into the sandbox while it arrives: to
    ``path`` when given (then only one file may come), else to the part's filename. As in envd, a
    part is a file by its field name alone: a browser's ``FormData.append("file", text)`` or
    ``curl -F file=<x`` sends no filename, and the path parameter says where it goes."""
    written: list[dict[str, Any]] = []
    events = uploads.multipart_parts(request)
    async for event in events:
        if not isinstance(event, uploads.PartStart) or event.name != "file":
            continue  # another field, or the bytes of one: skipped
        if path and written:
            raise InvalidRequest("the path parameter names one file, and this upload has several")
        target = connect.path_string(path or event.filename or "", "the file part's filename")
        if not target:
            raise InvalidRequest("a file part has no filename")
        written.append(await _write_file(sb, target, user, _part_bytes(events), meta))
    if not written:
        raise InvalidRequest("no file part in the upload")
    return written


async def files_post(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    try:
        path, user, meta = _query_path(request), _query_user(request, user), _upload_metadata(request)
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            written = await _write_parts(request, sb, path, user, meta)
        elif not path:
            raise InvalidRequest("the path query parameter is required")
        else:
            written = [await _write_file(sb, path, user, uploads.decoded(request), meta)]
    except Exception as exc:
        return _file_error(request, exc)
    return JSONResponse(written)


async def envs(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    return await _unary(sb, "sys.envs", {})


async def sandbox_metrics(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    return await _unary(sb, "sys.metrics", {})


SYSTEM: dict[str, Handler] = {"/envs": envs, "/metrics": sandbox_metrics}


# -- entry point ------------------------------------------------------------------------------------
def _endpoint(request: Request) -> Handler | None:
    method, path = request.method, request.url.path
    if path == "/files" and method in ("GET", "POST"):
        return files_get if method == "GET" else files_post
    if method == "POST" and path in RPC:
        return RPC[path]
    if method == "GET" and path in SYSTEM:
        return SYSTEM[path]
    return None


def _paused(node: NodeService, sandbox_id: str, exc: AenvError) -> JSONResponse | None:
    """The answer for a paused sandbox its traffic did not resume: E2B's edge's 502 "The sandbox
    was not found" (what the E2B SDKs read as "not running"), saying that it is paused and how to
    resume it, with ``state: paused`` for clients that tell the two apart (aenv's SDK). An
    auto-resume that failed (a full node) is its error's answer, saying so. None when it is not
    paused, or the cluster must answer (503)."""
    try:
        sb = node.get(sandbox_id)
    except AenvError:
        return None
    if sb.state != SandboxState.PAUSED or isinstance(exc, ClusterUnavailable):
        return None
    if not isinstance(exc, WrongState):
        body = {**error_body(exc), "message": f"The sandbox is paused and its auto-resume failed: {exc.message}"}
        headers = error_headers(exc)
        return JSONResponse({**body, "sandboxId": sandbox_id}, status_code=exc.status, headers=headers)
    why = " without its memory: only a connect resumes it" if sb.rec.filesystem_only else ""
    how = "" if sb.rec.filesystem_only or sb.rec.auto_resume else " (or create it with autoResume: its use resumes it)"
    return sandbox_paused(sandbox_id, why, how)


def _refusal(request: Request, token: str) -> str | None:
    if request.url.path == "/files" and request.method in ("GET", "POST"):
        return files_refusal(request, token)
    given = request.headers.get("x-access-token")
    return None if given is not None and hmac.compare_digest(given.encode(), token.encode()) else UNAUTHORIZED


async def handle(request: Request, node: NodeService, sandbox_id: str) -> Response:
    """Serve one envd request for ``sandbox_id``.

    The access token is checked on the record, before anything resumes the sandbox or reaches its
    agent: a caller without the token cannot wake a paused sandbox."""
    path = request.url.path
    try:
        sb = node.get(sandbox_id)
    except AenvError:
        return sandbox_gone(sandbox_id)
    if request.method == "GET" and path == "/health":
        if sb.state.value != "running" or sb.link is None or sb.killer is not None:
            return sandbox_gone(sandbox_id)
        return Response(status_code=204)
    if path == "/files" and (too_long := signed.too_long(request)) is not None:
        return too_long  # before its signature is hashed
    refusal = _refusal(request, node.access_token(sandbox_id)) if sb.rec.secure else None
    if refusal is not None:
        code = 401 if path == "/files" else "unauthenticated"
        return JSONResponse({"code": code, "message": refusal}, status_code=401)
    endpoint = _endpoint(request)
    if endpoint is None:
        return JSONResponse(
            {"code": "unimplemented", "message": f"{request.method} {path} is not an envd endpoint"}, status_code=404
        )
    try:
        sb = await node.ensure_running(sandbox_id)
    except AenvError as exc:
        return _paused(node, sandbox_id, exc) or not_woken(sandbox_id, exc)
    request.state.disk_mb = node.limits_of(sb.rec).disk_mb  # what a full disk's answer names
    request.state.rollouts = node.rollouts  # where a command's entry goes when it ends
    sb.opening += 1  # no await since it was found running: a pause from now on waits for it, a while
    try:
        return await endpoint(request, sb, _user(request))
    except RequestTimeout as exc:  # the client's body stopped coming (see aenv.api.app)
        error = ConnectError("deadline_exceeded", exc.message)
        return _file_error(request, exc) if path == "/files" else connect.unary_error(error)
    except ConnectError as exc:
        return _file_error(request, exc) if path == "/files" else connect.unary_error(exc)
    finally:
        sb.opening -= 1
