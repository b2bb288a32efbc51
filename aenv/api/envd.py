"""The envd data plane (process.Process, filesystem.Filesystem, /files, /health), served on the
host and carried out by the guest agent over the channel.

Requests reach this module already routed to one sandbox (by ``E2b-Sandbox-Id`` or by host name).
"""

from __future__ import annotations

import asyncio
import base64
import gzip
import hashlib
import hmac
import time
import zlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any
from urllib.parse import quote

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from aenv.api import connect
from aenv.api.connect import ConnectError
from aenv.api.proxy import sandbox_gone
from aenv.channel import DATA, END, MSG, ChannelClosed, Stream, StreamError
from aenv.errors import AenvError, AgentTimeout, AgentUnavailable
from aenv.node.agentlink import AgentLink
from aenv.node.orchestrator import LiveSandbox, Node

KEEPALIVE_DEFAULT = 90.0
ENVD_PORT = 49983
UNAUTHORIZED = "unauthorized access, please provide a valid access token or method signing if supported"

Handler = Callable[[Request, LiveSandbox, str | None], Awaitable[Response]]


def _user(request: Request) -> str | None:
    auth = request.headers.get("authorization", "")
    if auth.lower().startswith("basic "):
        try:
            name = base64.b64decode(auth[6:]).decode().split(":", 1)[0]
        except ValueError:
            return None
        return name or None
    return None


def _connect_error(exc: BaseException) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, StreamError):
        return ConnectError(exc.code, exc.message)
    if isinstance(exc, AgentTimeout):
        return ConnectError("deadline_exceeded", exc.message)
    if isinstance(exc, ChannelClosed | AenvError):
        return ConnectError("unavailable", f"The sandbox was not found: {exc}")
    return ConnectError("internal", str(exc))


# -- process.Process -------------------------------------------------------------------------------
async def _stream_events(
    request: Request, link: AgentLink, stream: Stream, *, first: Any = None
) -> AsyncIterator[bytes]:
    """Forward a guest stream of JSON messages as Connect envelopes, with keepalives.

    A quiet stream is normal (a command that prints nothing); a quiet agent is not: at each
    keepalive the agent is pinged, and a ping it has not answered ends the stream with an error."""
    try:
        interval = float(request.headers.get("keepalive-ping-interval") or KEEPALIVE_DEFAULT)
    except ValueError:
        interval = KEEPALIVE_DEFAULT
    finished = False
    ping: asyncio.Future[None] | None = None
    try:
        if first is not None:
            yield connect.message_envelope(first)
        while True:
            try:
                item = await asyncio.wait_for(stream.recv(), timeout=max(interval, 1.0))
            except TimeoutError:
                if ping is not None and ping.done() and ping.exception() is not None:
                    yield connect.end_stream(_connect_error(ping.exception()))  # type: ignore[arg-type]
                    return
                yield connect.message_envelope({"event": {"keepalive": {}}})
                if ping is None or ping.done():
                    ping = asyncio.ensure_future(link.ping())
                    ping.add_done_callback(lambda t: t.cancelled() or t.exception())  # read above, or dropped
                continue
            if item.kind == MSG:
                yield connect.envelope(item.data)
            elif item.kind == END:
                finished = True
                err = item.msg.get("error") if isinstance(item.msg, dict) else None
                yield connect.end_stream(ConnectError(err["code"], err["message"]) if err else None)
                return
    finally:
        if ping is not None:
            ping.cancel()
        if not finished:  # the client left (or the agent is gone): stop following, the process keeps running
            stream.cancel()


def _link(sb: LiveSandbox) -> AgentLink:
    if sb.link is None:  # paused or killed since the request was routed
        raise AgentUnavailable(f"sandbox {sb.id} is {sb.state.value}", sandbox_id=sb.id)
    return sb.link


async def _open_first(link: AgentLink, method: str, params: dict[str, Any]) -> tuple[Stream, Any]:
    """Open a stream and wait (within the agent deadline) for its first message, so errors
    before it become a proper error answer."""
    stream = await link.open(method, params)
    try:
        item = await link.within(stream.recv(), method)
    except BaseException:
        stream.cancel()
        raise
    if item.kind == END:
        err = (item.msg or {}).get("error") or {"code": "internal", "message": "stream ended early"}
        raise ConnectError(err["code"], err["message"])
    return stream, item.msg


async def _server_stream(request: Request, sb: LiveSandbox, method: str, params: dict[str, Any]) -> Response:
    try:
        link = _link(sb)
        stream, first = await _open_first(link, method, params)
    except Exception as exc:
        body = connect.end_stream(_connect_error(exc))
        return Response(body, media_type=connect.STREAM_CONTENT_TYPE)
    return StreamingResponse(_stream_events(request, link, stream, first=first), media_type=connect.STREAM_CONTENT_TYPE)


async def process_start(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request)
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
        params["stdin"] = bool(msg["stdin"])
    return await _server_stream(request, sb, "process.start", params)


async def process_connect(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request)
    return await _server_stream(request, sb, "process.connect", {"process": msg.get("process") or {}})


async def _unary(sb: LiveSandbox, method: str, params: dict[str, Any]) -> Response:
    try:
        result = await _link(sb).call(method, params)
    except Exception as exc:
        return connect.unary_error(_connect_error(exc))
    return JSONResponse(result if result is not None else {})


def _unary_handler(method: str, keys: tuple[str, ...]) -> Handler:
    async def handle(request: Request, sb: LiveSandbox, user: str | None) -> Response:
        try:
            msg = await connect.read_request(request)
        except ConnectError as exc:
            return connect.unary_error(exc)
        params = {k: connect.get(msg, k) for k in keys if connect.get(msg, k) is not None}
        params["user"] = user
        return await _unary(sb, method, params)

    return handle


async def process_stream_input(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    reader = connect.EnvelopeReader(request)
    selector: dict[str, Any] | None = None
    try:
        while (msg := await reader.next()) is not None:
            if "start" in msg:
                selector = (msg["start"] or {}).get("process") or {}
            elif "data" in msg and selector is not None:
                data = (msg["data"] or {}).get("input") or {}
                await _link(sb).call("process.input", {"process": selector, "input": data})
    except Exception as exc:
        return Response(connect.end_stream(_connect_error(exc)), media_type=connect.STREAM_CONTENT_TYPE)
    return Response(connect.message_envelope({}) + connect.end_stream(), media_type=connect.STREAM_CONTENT_TYPE)


async def fs_watch_dir(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    msg = await connect.read_request(request)
    params = {
        "path": connect.get(msg, "path", ""),
        "recursive": bool(connect.get(msg, "recursive", False)),
        "includeEntry": bool(connect.get(msg, "includeEntry", False)),
        "user": user,
    }
    return await _server_stream(request, sb, "fs.watch", params)


RPC: dict[str, Handler] = {
    "/process.Process/Start": process_start,
    "/process.Process/Connect": process_connect,
    "/process.Process/List": _unary_handler("process.list", ()),
    "/process.Process/SendInput": _unary_handler("process.input", ("process", "input")),
    "/process.Process/SendSignal": _unary_handler("process.signal", ("process", "signal")),
    "/process.Process/CloseStdin": _unary_handler("process.close_stdin", ("process",)),
    "/process.Process/Update": _unary_handler("process.update", ("process", "pty")),
    "/process.Process/StreamInput": process_stream_input,
    "/filesystem.Filesystem/Stat": _unary_handler("fs.stat", ("path",)),
    "/filesystem.Filesystem/ListDir": _unary_handler("fs.list", ("path", "depth")),
    "/filesystem.Filesystem/MakeDir": _unary_handler("fs.mkdir", ("path",)),
    "/filesystem.Filesystem/Move": _unary_handler("fs.move", ("source", "destination")),
    "/filesystem.Filesystem/Remove": _unary_handler("fs.remove", ("path",)),
    "/filesystem.Filesystem/CreateWatcher": _unary_handler("fs.watch_create", ("path", "recursive", "includeEntry")),
    "/filesystem.Filesystem/GetWatcherEvents": _unary_handler("fs.watch_events", ("watcherId",)),
    "/filesystem.Filesystem/RemoveWatcher": _unary_handler("fs.watch_remove", ("watcherId",)),
    "/filesystem.Filesystem/WatchDir": fs_watch_dir,
}


# -- /files ------------------------------------------------------------------------------------------
def _file_error(exc: BaseException) -> JSONResponse:
    err = _connect_error(exc)
    status = {
        "not_found": 404,
        "invalid_argument": 400,
        "unauthenticated": 401,
        "permission_denied": 403,
        "deadline_exceeded": 504,
    }.get(err.code)
    if err.code == "resource_exhausted":
        status = 507
    if status is None:
        return JSONResponse({"code": 500, "message": err.message}, status_code=500)
    return JSONResponse({"code": status, "message": err.message}, status_code=status)


def signature(path: str, operation: str, username: str | None, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{username or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def files_authorized(request: Request, token: str, operation: str) -> bool:
    if request.headers.get("x-access-token") is not None:
        return request.headers["x-access-token"] == token
    sig = request.query_params.get("signature")
    if not sig:
        return False
    exp_raw = request.query_params.get("signature_expiration")
    expiration = int(exp_raw) if exp_raw and exp_raw.isdigit() else None
    if expiration is not None and expiration < time.time():
        return False
    path = request.query_params.get("path", "")
    expected = signature(path, operation, request.query_params.get("username"), token, expiration)
    return hmac.compare_digest(sig.encode(), expected.encode())


def signed_for(request: Request, node: Node) -> str | None:
    """The secure sandbox whose token signed this /files URL.

    Signed URLs from ``download_url()``/``upload_url()`` carry no sandbox id when the SDK's
    sandbox URL is a single proxy (E2B_SANDBOX_URL): the signature itself names the sandbox.
    """
    operation = "write" if request.method == "POST" else "read"
    for sb in node.list():
        if sb.rec.secure and files_authorized(request, node.access_token(sb.rec.id), operation):
            return sb.rec.id
    return None


async def files_get(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    path = request.query_params.get("path", "")
    user = request.query_params.get("username") or user
    try:
        link = _link(sb)
        stream, first = await _open_first(link, "fs.read", {"path": path, "user": user})
    except Exception as exc:
        return _file_error(exc)
    entry = first.get("entry", {})

    async def body() -> AsyncIterator[bytes]:
        try:
            while True:
                item = await link.within(stream.recv(), "fs.read")  # a stalled agent cuts the download short
                if item.kind == DATA:
                    yield item.data
                elif item.kind == END:
                    return
        finally:
            if not stream.remote_ended:
                stream.cancel()

    name = entry.get("name", "file")
    headers = {
        "Content-Disposition": f'inline; filename="{quote(name)}"',
        "Content-Length": str(entry.get("size", 0)),
        "Vary": "Accept-Encoding",
    }
    return StreamingResponse(body(), media_type="application/octet-stream", headers=headers)


async def _write_file(sb: LiveSandbox, path: str, user: str | None, chunks: AsyncIterator[bytes]) -> dict[str, Any]:
    link = _link(sb)
    stream = await link.open("fs.write", {"path": path, "user": user})
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
        result: dict[str, Any] = await link.within(stream.result(), "fs.write")
    except BaseException:
        if not stream.remote_ended:
            stream.cancel()
        raise
    return {"path": result["path"], "name": result["name"], "type": "file"}


async def _decoded(request: Request) -> AsyncIterator[bytes]:
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding in ("gzip", "deflate"):
        inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
        async for chunk in request.stream():
            yield inflater.decompress(chunk)
        yield inflater.flush()
    else:
        async for chunk in request.stream():
            yield chunk


async def files_post(request: Request, sb: LiveSandbox, user: str | None) -> Response:
    path = request.query_params.get("path")
    user = request.query_params.get("username") or user
    ctype = request.headers.get("content-type", "")
    written: list[dict[str, Any]] = []
    try:
        if ctype.startswith("multipart/form-data"):
            form = await request.form(max_part_size=64 * 2**20)
            uploads = [(k, v) for k, v in form.multi_items() if k == "file" and not isinstance(v, str)]
            if not uploads:
                return JSONResponse({"code": 400, "message": "no file part in the upload"}, status_code=400)
            for _, upload in uploads:
                target = path if (path and len(uploads) == 1) else (upload.filename or "")  # type: ignore[union-attr]
                if not target:
                    return JSONResponse({"code": 400, "message": "a file part has no filename"}, status_code=400)

                async def chunks(u: Any = upload) -> AsyncIterator[bytes]:
                    while data := await u.read(1024 * 1024):
                        yield data

                written.append(await _write_file(sb, target, user, chunks()))
        else:
            if not path:
                return JSONResponse({"code": 400, "message": "the path query parameter is required"}, status_code=400)
            written.append(await _write_file(sb, path, user, _decoded(request)))
    except (zlib.error, gzip.BadGzipFile) as exc:
        return JSONResponse({"code": 400, "message": f"cannot decode the upload: {exc}"}, status_code=400)
    except Exception as exc:
        return _file_error(exc)
    return JSONResponse(written)


# -- entry point ------------------------------------------------------------------------------------
async def handle(request: Request, node: Node, sandbox_id: str) -> Response:
    """Serve one envd request for ``sandbox_id``."""
    path = request.url.path
    if request.method == "GET" and path == "/health":
        try:
            sb = node.get(sandbox_id)
        except AenvError:
            return sandbox_gone(sandbox_id)
        if sb.state.value != "running" or sb.link is None:
            return sandbox_gone(sandbox_id)
        return Response(status_code=204)
    try:
        sb = await node.ensure_running(sandbox_id)
    except AenvError:
        return sandbox_gone(sandbox_id)
    token = node.access_token(sandbox_id) if sb.rec.secure else None
    user = _user(request)
    if path == "/files" and request.method in ("GET", "POST"):
        if token is not None and not files_authorized(request, token, "read" if request.method == "GET" else "write"):
            return JSONResponse({"code": 401, "message": UNAUTHORIZED}, status_code=401)
        return await (files_get if request.method == "GET" else files_post)(request, sb, user)
    if token is not None and request.headers.get("x-access-token") != token:
        return JSONResponse({"code": "unauthenticated", "message": UNAUTHORIZED}, status_code=401)
    if request.method == "POST" and path in RPC:
        try:
            return await RPC[path](request, sb, user)
        except ConnectError as exc:
            return connect.unary_error(exc)
    if request.method == "GET" and path == "/envs":
        return await _unary(sb, "sys.envs", {})
    if request.method == "GET" and path == "/metrics":
        return await _unary(sb, "sys.metrics", {})
    return JSONResponse(
        {"code": "unimplemented", "message": f"{request.method} {path} is not an envd endpoint"}, status_code=404
    )
