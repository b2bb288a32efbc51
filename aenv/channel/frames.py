"""The channel's wire: frame kinds and their size limits, the strict JSON codec, and the errors.

Everything here is about one frame at a time (no state): what a frame looks like, what it may
carry, how a payload is encoded and checked. :mod:`aenv.channel.stream` and
:mod:`aenv.channel.connection` build streams and the pipe's reader and writer on it. Stdlib only.
"""

from __future__ import annotations

import json
import struct
from typing import Any

HEADER = struct.Struct("!BII")
GRANT = struct.Struct("!I")
MAX_PAYLOAD = 256 * 1024  # one DATA frame
MAX_JSON = 4 * 1024 * 1024  # one OPEN, MSG or END frame: a request, an event, a result
MAX_CTRL = 1024 * 1024  # one CTRL frame (a thaw carries the sandbox's env)
MAX_GUEST_STREAMS = 256  # streams the guest may have open at once (its egress connections)

OPEN, MSG, DATA, EOF, END, CREDIT, CTRL = 1, 2, 3, 4, 5, 6, 7
# The largest payload of each kind of frame; a kind not listed is a protocol violation.
MAX_LENGTH = {
    OPEN: MAX_JSON,
    MSG: MAX_JSON,
    DATA: MAX_PAYLOAD,
    EOF: 0,
    END: MAX_JSON,
    CREDIT: GRANT.size,
    CTRL: MAX_CTRL,
}

PROTOCOL_VIOLATION = "protocol violation"  # how the close reason of a channel the peer broke begins


class ChannelClosed(ConnectionError):
    """The pipe under the channel is gone (sandbox stopped, paused or killed)."""


class ProtocolViolation(Exception):
    """The peer sent something the protocol does not allow: nothing more from it can be trusted."""


class StreamError(Exception):
    """The far side ended a stream with an error; ``code`` is a Connect-style code string."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class Unsendable(StreamError):
    """A message this side refused to send: not strict JSON, or larger than its frame allows."""


def encode(kind: int, stream: int, payload: bytes = b"") -> bytes:
    return HEADER.pack(kind, stream, len(payload)) + payload


def dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()


def _sendable(obj: Any, limit: int, what: str) -> bytes:
    try:
        payload = dumps(obj)
    except ValueError as exc:  # NaN or Infinity: the peer would refuse it
        raise Unsendable("invalid_argument", f"{what} is not JSON: {exc}") from exc
    if len(payload) > limit:
        # out_of_range, not resource_exhausted: what was asked for is too large (a listing of a whole
        # tree), not a resource running out (the SDKs read resource_exhausted as rate limiting).
        raise Unsendable("out_of_range", f"{what} is {len(payload)} bytes, more than the limit of {limit}")
    return payload


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)


def loads(payload: bytes, what: str = "a message") -> Any:
    """Strict JSON: UTF-8 only, no NaN/Infinity, nesting within the recursion limit."""
    try:
        return _DECODER.decode(payload.decode())
    except (ValueError, RecursionError) as exc:
        raise ProtocolViolation(f"{what} is not JSON: {str(exc)[:200]}") from None


def _object(payload: bytes, what: str) -> dict[str, Any]:
    body = loads(payload, what)
    if not isinstance(body, dict):
        raise ProtocolViolation(f"{what} is not a JSON object")
    return body


def end_error(body: Any) -> StreamError | None:
    """The error an END's body carries, if any, whatever shape the peer gave it."""
    err = body.get("error") if isinstance(body, dict) else None
    if not err:
        return None
    if not isinstance(err, dict):
        return StreamError("unknown", str(err)[:1000])
    return StreamError(str(err.get("code", "unknown"))[:100], str(err.get("message", ""))[:10_000])


def _result_of(body: Any) -> Any:
    error = end_error(body)
    if error is not None:
        raise error
    return body.get("result") if isinstance(body, dict) else None


def _bad_header(kind: int, sid: int, length: int) -> str:
    if kind not in MAX_LENGTH:
        return f"a frame of unknown kind {kind} on stream {sid}"
    return f"a frame of kind {kind} on stream {sid} with {length} bytes, more than the {MAX_LENGTH[kind]} it may have"
