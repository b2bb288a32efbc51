"""What the SDK reads and writes on the wire: the API's errors, envd's Connect envelopes and errors,
and a PTY session over a process stream."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

from aenv.errors import (
    AenvError,
    InvalidRequest,
    OperationTimeout,
    SandboxError,
    SandboxGone,
    WrongState,
    from_body,
)

if TYPE_CHECKING:
    from aenv.sdk._async import AsyncSandbox

ENVD_PORT = 49983
ENVELOPE = struct.Struct("!BI")
OutputFn = Callable[[str], None]
# Seconds a command may run before the sandbox's agent kills it and exec raises OperationTimeout.
DEFAULT_EXEC_TIMEOUT = 60.0


@dataclass(frozen=True, slots=True)
class CommandResult:
    exit_code: int
    stdout: str
    stderr: str
    error: str | None = None
    # exec's ``max_output``: a stream had more, so the command was killed and the rest dropped
    truncated: bool = False


def raise_for(response: httpx.Response) -> None:
    """The API's error answer as the aenv error it names (its ``error_code``, else its status)."""
    if response.status_code < 400:
        return
    raise from_body(response.status_code, _body(response))


def raise_for_envd(response: httpx.Response, sandbox_id: str) -> None:
    """An envd request's error answer. The node answers for the sandbox when it is not there to:
    paused (502 with ``state: paused``) or gone (502, E2B's "was not found")."""
    if response.status_code < 400:
        return
    body = _body(response)
    if response.status_code == 502 and isinstance(body, dict) and body.get("state") == "paused":
        how = "resume it with sandbox.resume() or client.connect(id)"
        if "without its memory" in str(body.get("message")):
            message = f"sandbox {sandbox_id} is paused without its memory: {how} (its use does not resume it)"
        else:
            message = f"sandbox {sandbox_id} is paused: {how}, or create it with auto_resume=True to resume on use"
        raise WrongState(message, sandbox_id=sandbox_id, status=502)
    if response.status_code == 502 and isinstance(body, dict) and "was not found" in str(body.get("message")):
        raise gone(sandbox_id)
    raise from_body(response.status_code, body)


def gone(sandbox_id: str) -> SandboxGone:
    return SandboxGone(
        f"sandbox {sandbox_id} is not running: it was killed or its timeout ended", sandbox_id=sandbox_id
    )


def _body(response: httpx.Response) -> Any:
    try:
        return response.json()
    except ValueError:
        return response.text


def envelope(msg: Any) -> bytes:
    payload = json.dumps(msg).encode()
    return ENVELOPE.pack(0, len(payload)) + payload


async def envelopes(response: httpx.Response) -> AsyncIterator[tuple[int, Any]]:
    buf = b""
    async for chunk in response.aiter_bytes():
        buf += chunk
        while len(buf) >= ENVELOPE.size:
            flags, length = ENVELOPE.unpack_from(buf)
            if len(buf) < ENVELOPE.size + length:
                break
            payload = buf[ENVELOPE.size : ENVELOPE.size + length]
            buf = buf[ENVELOPE.size + length :]
            yield flags, json.loads(payload) if payload else {}


def connect_error(body: Mapping[str, Any]) -> AenvError:
    code, message = str(body.get("code", "unknown")), str(body.get("message", ""))
    if code == "deadline_exceeded":
        return OperationTimeout(message)
    if code in ("invalid_argument", "not_found", "already_exists"):
        return InvalidRequest(f"{code}: {message}")
    if code == "failed_precondition":  # e.g. a command that is not a scoring one in a grace period
        return WrongState(message)
    return SandboxError(f"{code}: {message}")


class PtySession:
    """An interactive shell inside a sandbox: output events and input, resize, wait."""

    def __init__(
        self, sandbox: AsyncSandbox, response: httpx.Response, stream: AsyncIterator[tuple[int, Any]], pid: int
    ) -> None:
        self.sandbox = sandbox
        self.pid = pid
        self._response = response
        self._stream = stream
        self.exit_code: int | None = None

    async def output(self) -> AsyncIterator[bytes]:
        """What the terminal prints, chunk by chunk, until the shell ends."""
        async for flags, msg in self._stream:
            if flags & 0x02:
                return
            event = msg.get("event", {})
            if "data" in event:
                yield base64.b64decode(event["data"].get("pty", ""))
            elif "end" in event:
                self.exit_code = int(event["end"].get("exitCode", -1))

    async def send(self, data: bytes) -> None:
        """Type ``data`` into the terminal."""
        await self.sandbox._rpc(
            "process.Process/SendInput",
            {"process": {"pid": self.pid}, "input": {"pty": base64.b64encode(data).decode()}},
        )

    async def resize(self, cols: int, rows: int) -> None:
        """Change the terminal's size."""
        await self.sandbox._rpc(
            "process.Process/Update", {"process": {"pid": self.pid}, "pty": {"size": {"cols": cols, "rows": rows}}}
        )

    async def close(self) -> None:
        """Stop following the terminal (its shell runs on until it ends)."""
        await self._response.aclose()
