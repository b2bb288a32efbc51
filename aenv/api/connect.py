"""The Connect protocol, JSON codec only, as E2B's SDKs speak it to envd.

Unary calls: a JSON body in, a JSON body out; errors are ``{"code": "<connect code>", "message"}``
with a matching HTTP status. Server streams: ``application/connect+json`` bodies of envelopes
(``flags:u8 length:u32`` + JSON), ending with an end-stream envelope (flags 0x02).
"""

from __future__ import annotations

import json
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

STREAM_CONTENT_TYPE = "application/connect+json"
ENVELOPE = struct.Struct("!BI")
END_STREAM = 0x02

# Connect code -> HTTP status (connectrpc's table).
CODE_STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code if code in CODE_STATUS else "unknown"
        self.message = message


def envelope(payload: bytes, flags: int = 0) -> bytes:
    return ENVELOPE.pack(flags, len(payload)) + payload


def message_envelope(msg: Any) -> bytes:
    return envelope(json.dumps(msg, separators=(",", ":")).encode())


def end_stream(error: ConnectError | None = None) -> bytes:
    body: dict[str, Any] = {}
    if error is not None:
        body["error"] = {"code": error.code, "message": error.message}
    return envelope(json.dumps(body).encode(), END_STREAM)


def unary_error(error: ConnectError) -> JSONResponse:
    return JSONResponse({"code": error.code, "message": error.message}, status_code=CODE_STATUS[error.code])


def decode_envelopes(data: bytes) -> list[Any]:
    out = []
    off = 0
    while off + ENVELOPE.size <= len(data):
        flags, length = ENVELOPE.unpack_from(data, off)
        off += ENVELOPE.size
        chunk = data[off : off + length]
        off += length
        if flags & END_STREAM:
            break
        out.append(json.loads(chunk) if chunk else {})
    return out


class EnvelopeReader:
    """Reads envelopes one by one from a streaming request body (client streams)."""

    def __init__(self, request: Request) -> None:
        self._chunks = request.stream()
        self._buf = b""

    async def next(self) -> Any | None:
        while True:
            if len(self._buf) >= ENVELOPE.size:
                flags, length = ENVELOPE.unpack_from(self._buf)
                if len(self._buf) >= ENVELOPE.size + length:
                    payload = self._buf[ENVELOPE.size : ENVELOPE.size + length]
                    self._buf = self._buf[ENVELOPE.size + length :]
                    if flags & END_STREAM:
                        return None
                    return json.loads(payload) if payload else {}
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                return None
            self._buf += chunk


async def read_request(request: Request) -> dict[str, Any]:
    """The one message of a unary or server-streaming request, in either encoding."""
    body = await request.body()
    ctype = request.headers.get("content-type", "")
    try:
        if ctype.startswith("application/connect+json"):
            msgs = decode_envelopes(body)
            msg = msgs[0] if msgs else {}
        else:
            msg = json.loads(body) if body.strip() else {}
    except (ValueError, struct.error) as exc:
        raise ConnectError("invalid_argument", f"cannot decode request: {exc}") from exc
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", "request message must be a JSON object")
    return msg


def timeout_ms(request: Request) -> int | None:
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be an integer") from exc
    return value if value > 0 else None


def get(msg: dict[str, Any], camel: str, default: Any = None) -> Any:
    """Proto3 JSON: accept lowerCamelCase and the original snake_case."""
    if camel in msg:
        return msg[camel]
    snake = "".join(f"_{c.lower()}" if c.isupper() else c for c in camel)
    return msg.get(snake, default)
