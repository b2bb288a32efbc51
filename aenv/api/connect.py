"""The Connect protocol, JSON codec only, as E2B's SDKs speak it to envd.

Unary calls: a JSON body in, a JSON body out; errors are ``{"code": "<connect code>", "message"}``
with a matching HTTP status. Server streams: ``application/connect+json`` bodies of envelopes
(``flags:u8 length:u32`` + JSON), ending with an end-stream envelope (flags 0x02).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import struct
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse

from aenv.errors import parse_json

STREAM_CONTENT_TYPE = "application/connect+json"
ENVELOPE = struct.Struct("!BI")
END_STREAM = 0x02
# The largest request message read (a whole unary body, or one envelope of a client stream).
MAX_MESSAGE = 32 * 2**20

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
        out.append(parse_json(chunk) if chunk else {})
    return out


def _too_large() -> ConnectError:
    return ConnectError("resource_exhausted", f"request message larger than {MAX_MESSAGE} bytes")


def _decode(payload: bytes, schema: Message) -> dict[str, Any]:
    try:
        msg = parse_json(payload) if payload.strip() else {}
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"cannot decode request: {exc}") from exc
    return checked(msg, schema)


class EnvelopeReader:
    """Reads envelopes one by one from a streaming request body (client streams), each checked
    against ``schema`` and at most MAX_MESSAGE bytes.

    Each message costs its own bytes (the body is read through an offset, not re-sliced: a 1 MiB
    chunk of empty envelopes took 3 s) and lets the event loop run before it is taken, so a body of
    tiny envelopes does not hold the node's loop."""

    def __init__(self, request: Request, schema: Message) -> None:
        self._chunks = request.stream()
        self._buf = bytearray()
        self._at = 0  # where the next envelope starts in _buf
        self._schema = schema

    async def next(self) -> dict[str, Any] | None:
        await asyncio.sleep(0)
        while True:
            available = len(self._buf) - self._at
            if available >= ENVELOPE.size:
                flags, length = ENVELOPE.unpack_from(self._buf, self._at)
                if length > MAX_MESSAGE:
                    raise _too_large()
                if available >= ENVELOPE.size + length:
                    start = self._at + ENVELOPE.size
                    payload = bytes(self._buf[start : start + length])
                    self._at = start + length
                    if flags & END_STREAM:
                        return None
                    return _decode(payload, self._schema)
            del self._buf[: self._at]  # once per chunk read: what was taken goes
            self._at = 0
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                return None
            self._buf += chunk


async def _read_body(request: Request) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > MAX_MESSAGE + ENVELOPE.size:
        raise _too_large()
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_MESSAGE + ENVELOPE.size:
            raise _too_large()
    return bytes(body)


async def read_request(request: Request, schema: Message) -> dict[str, Any]:
    """The one message of a unary or server-streaming request, in either encoding, checked
    against ``schema``."""
    body = await _read_body(request)
    if request.headers.get("content-type", "").startswith("application/connect+json"):
        if len(body) < ENVELOPE.size:
            return checked({}, schema)
        flags, length = ENVELOPE.unpack_from(body)
        return checked({}, schema) if flags & END_STREAM else _decode(body[ENVELOPE.size :][:length], schema)
    return _decode(body, schema)


def keepalive_interval(request: Request, default: float) -> float:
    """The client's ``Keepalive-Ping-Interval`` in seconds, within [1, 3600]."""
    try:
        value = float(request.headers.get("keepalive-ping-interval") or default)
    except ValueError:
        return default
    return min(max(value, 1.0), 3600.0) if math.isfinite(value) else default


def timeout_ms(request: Request) -> int | None:
    raw = request.headers.get("connect-timeout-ms")
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError as exc:
        raise ConnectError("invalid_argument", "Connect-Timeout-Ms must be an integer") from exc
    return value if value > 0 else None


# -- proto3 JSON checking ------------------------------------------------------------------------------
# A message schema maps each field (lowerCamelCase) to a kind: one of the scalar names below, a nested
# schema (a message), [kind] (repeated) or ("map", kind) (a map with string keys). Fields the schema
# does not name are dropped, null means unset, snake_case names are accepted as proto3 JSON allows.
# What passes reaches the guest agent with the types it expects, so no client value can fail there.
STRING, PATH, UINT32, UINT16, BOOL, BYTES, ENUM = "string", "path", "uint32", "uint16", "bool", "bytes", "enum"
Kind = Any
Message = dict[str, Kind]
PATH_MAX, NAME_MAX = 4096, 255  # Linux's limits, in bytes


def checked(msg: Any, schema: Message, where: str = "") -> dict[str, Any]:
    if not isinstance(msg, dict):
        raise ConnectError("invalid_argument", f"{where or 'request message'} must be a JSON object")
    out: dict[str, Any] = {}
    for key, value in msg.items():
        name = key if key in schema else _camel(key)
        if name in schema and value is not None:
            out[name] = checked_value(value, schema[name], f"{where}.{name}" if where else name)
    return out


def _camel(snake: str) -> str:
    head, *rest = snake.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def checked_value(value: Any, kind: Kind, where: str) -> Any:
    if isinstance(kind, dict):
        return checked(value, kind, where)
    if isinstance(kind, list):
        if not isinstance(value, list):
            raise ConnectError("invalid_argument", f"{where} must be a list")
        return [checked_value(v, kind[0], f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(kind, tuple):
        if not isinstance(value, dict):
            raise ConnectError("invalid_argument", f"{where} must be a JSON object")
        return {_string(k, f"{where} key"): checked_value(v, kind[1], f"{where}.{k}") for k, v in value.items()}
    return SCALARS[kind](value, where)


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise ConnectError("invalid_argument", f"{where} must be a string")
    if "\x00" in value:
        raise ConnectError("invalid_argument", f"{where} must not contain NUL bytes")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ConnectError("invalid_argument", f"{where} is not valid UTF-8") from None
    return value


def path_string(value: Any, where: str) -> str:
    """A string usable as a file path: no NUL, at most PATH_MAX bytes, names of at most NAME_MAX."""
    path = _string(value, where)
    encoded = path.encode()
    if len(encoded) > PATH_MAX or any(len(name) > NAME_MAX for name in encoded.split(b"/")):
        raise ConnectError("invalid_argument", f"{where} is longer than a path can be")
    return path


def _unsigned(value: Any, where: str, bits: int) -> int:
    """Proto3 JSON integers: a JSON number, or a string of digits; never a boolean."""
    if isinstance(value, str) and value.isascii() and value.isdecimal():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**bits:
        raise ConnectError("invalid_argument", f"{where} must be an unsigned {bits}-bit integer")
    return value


def _uint32(value: Any, where: str) -> int:
    return _unsigned(value, where, 32)


def _uint16(value: Any, where: str) -> int:
    """A uint32 in the protocol that the kernel keeps in 16 bits (a terminal's columns and rows)."""
    return _unsigned(value, where, 16)


def _bool(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConnectError("invalid_argument", f"{where} must be true or false")
    return value


def _bytes(value: Any, where: str) -> str:
    """Base64 in either alphabet, padded or not (proto3 JSON); passed on in the standard one."""
    text = _string(value, where).replace("-", "+").replace("_", "/")
    try:
        raw = base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConnectError("invalid_argument", f"{where} must be base64") from None
    return base64.b64encode(raw).decode()


def _enum(value: Any, where: str) -> str | int:
    if isinstance(value, str):
        return _string(value, where)
    return _uint32(value, where)


SCALARS = {
    STRING: _string,
    PATH: path_string,
    UINT32: _uint32,
    UINT16: _uint16,
    BOOL: _bool,
    BYTES: _bytes,
    ENUM: _enum,
}
