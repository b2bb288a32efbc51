"""Every error aenv raises, in one tree, and the one table mapping them to HTTP.

    AenvError
    ├── InvalidRequest (ValueError)          400 invalid_request
    ├── Unauthenticated (PermissionError)    401 unauthenticated
    ├── Forbidden (PermissionError)          403 forbidden (a feature this node does not offer, as E2B words it)
    ├── PayloadTooLarge                      413 payload_too_large
    ├── RequestTimeout                       408 request_timeout (a body that does not arrive in time)
    ├── NotFound (LookupError)               404 not_found
    │   ├── SandboxNotFound                  404 sandbox_not_found
    │   │   └── SandboxGone                  (the SDK's: a sandbox it held was killed, timed out or died)
    │   ├── TemplateNotFound                 404 template_not_found
    │   └── SnapshotNotFound                 404 snapshot_not_found
    ├── Conflict                             409 conflict
    │   ├── WrongState                       409 wrong_state
    │   └── CreateElsewhere                  409 create_elsewhere (another node holds this create id)
    ├── LimitExceeded                        429 limit_exceeded  (Should-Retry: false, Retry-After: 1)
    │   └── QuotaExceeded                    429 quota_exceeded (a team's quota; Retry-After: when to try again)
    ├── UpstreamError                        502 upstream_error (a registry failed or is out of reach)
    ├── ClusterUnavailable                   503 cluster_unavailable (etcd has no quorum or is out of reach)
    ├── TemplateBuilding                     503 template_building (a built-in template is being built: Retry-After)
    ├── SandboxError                         500 sandbox_error
    │   ├── RuntimeFailure                   500 runtime_failure (a driver binary failed)
    │   ├── CheckpointRefused                422 checkpoint_refused (the runtime cannot save this sandbox now)
    │   ├── ImageIncompatible                422 image_incompatible (another runsc wrote the memory image)
    │   └── AgentUnavailable (ConnectionError)  500 agent_unavailable
    ├── CommandFailed                        (the SDK's: a checked command exited non-zero)
    ├── OperationTimeout (TimeoutError)      500 operation_timeout
    │   └── AgentTimeout                     504 agent_timeout (the sandbox's agent did not answer)
    └── StorageError (OSError)               500 storage_error
        ├── RepositoryUnavailable            503 repository_unavailable
        ├── ArtifactDamaged                  500 artifact_damaged
        └── InsufficientStorage              507 insufficient_storage (a disk quota, or the node's disk, is full)

The API finds an error's entry by walking its MRO; the SDK maps a response's ``code`` back to the
class with the same table.
"""

from __future__ import annotations

import json
from typing import Any


class AenvError(Exception):
    """Root of every aenv error. ``sandbox_id``, ``argv`` and ``stderr`` give context when known."""

    def __init__(
        self,
        message: str,
        *,
        sandbox_id: str | None = None,
        argv: list[str] | None = None,
        stderr: str | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.sandbox_id = sandbox_id
        self.argv = argv
        self.stderr = stderr
        self.status = status if status is not None else http_status(type(self))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidRequest(AenvError, ValueError):
    pass


class Unauthenticated(AenvError, PermissionError):
    pass


class Forbidden(AenvError, PermissionError):
    pass


class PayloadTooLarge(AenvError):
    """A request body over the size the node accepts for it (or a build context unpacking past it)."""


class RequestTimeout(AenvError, TimeoutError):
    """A request whose body did not arrive within the time the node gives it."""


class NotFound(AenvError, LookupError):
    pass


class SandboxNotFound(NotFound):
    pass


class SandboxGone(SandboxNotFound):
    """The SDK's word for a sandbox it had a handle on that is no more: killed, past its timeout,
    or gone while a command ran in it. Never a command's failure (that is ``CommandFailed``)."""


class TemplateNotFound(NotFound):
    pass


class ImageNotFound(NotFound):
    """A registry has no such image or tag (E2B's "not found", as any NotFound on the wire)."""


class SnapshotNotFound(NotFound):
    pass


class Conflict(AenvError):
    pass


class WrongState(Conflict):
    pass


class CreateElsewhere(Conflict):
    """A create id another node of the cluster has taken: the create is (or was) made there."""


class LimitExceeded(AenvError):
    pass


class QuotaExceeded(LimitExceeded):
    """A team's quota (aenv/teams/quotas.py); ``retry_after``: seconds until trying again may work."""

    def __init__(self, message: str, *, retry_after: int = 1, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.retry_after = max(1, int(retry_after))


class UpstreamError(AenvError):
    """A service the node talks to for the client (an image registry) failed or could not be reached."""


class ClusterUnavailable(AenvError):
    """The cluster store (etcd) did not answer within its deadline: no quorum, or out of reach.
    What needs a directory write fails fast with this; running sandboxes keep being served."""


class TemplateBuilding(AenvError):
    """A create from a built-in template that this node is building now (its first use started
    the build): ask again after ``retry_after`` seconds."""

    def __init__(self, message: str, *, retry_after: int = 30, **context: Any) -> None:
        super().__init__(message, **context)
        self.retry_after = retry_after


class SandboxError(AenvError):
    pass


class RuntimeFailure(SandboxError):
    pass


class CheckpointRefused(SandboxError):
    """The runtime cannot checkpoint this sandbox in its current state."""


CHECKPOINT_REFUSAL = (
    "cannot checkpoint this sandbox: a process in it keeps a TCP socket in an epoll set "
    "(an asyncio, Node or nginx style server), which this runtime cannot save"
)


class ImageIncompatible(SandboxError):
    """The memory image was checkpointed by another runsc version, which this node's cannot
    restore (an upgraded node, or a repository shared with nodes running another version)."""


class AgentUnavailable(SandboxError, ConnectionError):
    pass


class CommandFailed(AenvError):
    """A command the SDK was asked to check exited non-zero: the sandbox is fine, the command is
    not. ``exit_code``, and the end of its ``stdout`` and ``stderr`` (``TAIL`` characters each)."""

    TAIL = 4096

    def __init__(self, cmd: str, exit_code: int, stdout: str, stderr: str, *, sandbox_id: str | None = None) -> None:
        self.cmd = cmd
        self.exit_code = exit_code
        self.stdout = stdout[-self.TAIL :]
        shown = snippet(stderr.strip().splitlines()[-1], 200) if stderr.strip() else ""
        super().__init__(
            f"command {snippet(cmd, 120)!r} exited with {exit_code}{': ' + shown if shown else ''}",
            sandbox_id=sandbox_id,
            stderr=stderr[-self.TAIL :],
        )


class OperationTimeout(AenvError, TimeoutError):
    pass


class AgentTimeout(OperationTimeout):
    """The sandbox's agent did not answer in time (it is wedged, stopped or overloaded)."""


class StorageError(AenvError, OSError):
    pass


class RepositoryUnavailable(StorageError):
    """The snapshot repository could not be reached or refused an operation (may pass)."""


class ArtifactDamaged(StorageError):
    """A committed snapshot or template cannot be read back: a chunk is missing or corrupt."""


class InsufficientStorage(StorageError):
    """Out of disk: a sandbox's quota is full, or the node's data dir is nearly full (refused
    before it fills the host's disk)."""


# class -> (http status, code). The only place statuses are chosen.
ERROR_TABLE: dict[type[AenvError], tuple[int, str]] = {
    AenvError: (500, "internal"),
    InvalidRequest: (400, "invalid_request"),
    Unauthenticated: (401, "unauthenticated"),
    Forbidden: (403, "forbidden"),
    PayloadTooLarge: (413, "payload_too_large"),
    RequestTimeout: (408, "request_timeout"),
    NotFound: (404, "not_found"),
    SandboxNotFound: (404, "sandbox_not_found"),
    TemplateNotFound: (404, "template_not_found"),
    SnapshotNotFound: (404, "snapshot_not_found"),
    Conflict: (409, "conflict"),
    WrongState: (409, "wrong_state"),
    CreateElsewhere: (409, "create_elsewhere"),
    LimitExceeded: (429, "limit_exceeded"),
    QuotaExceeded: (429, "quota_exceeded"),
    UpstreamError: (502, "upstream_error"),
    ClusterUnavailable: (503, "cluster_unavailable"),
    TemplateBuilding: (503, "template_building"),
    SandboxError: (500, "sandbox_error"),
    RuntimeFailure: (500, "runtime_failure"),
    # Not 409: E2B's SDKs read 409 on pause as "already paused".
    CheckpointRefused: (422, "checkpoint_refused"),
    ImageIncompatible: (422, "image_incompatible"),
    AgentUnavailable: (500, "agent_unavailable"),
    OperationTimeout: (500, "operation_timeout"),
    AgentTimeout: (504, "agent_timeout"),
    StorageError: (500, "storage_error"),
    RepositoryUnavailable: (503, "repository_unavailable"),
    ArtifactDamaged: (500, "artifact_damaged"),
    InsufficientStorage: (507, "insufficient_storage"),
}

CODE_TO_CLASS: dict[str, type[AenvError]] = {code: cls for cls, (_, code) in ERROR_TABLE.items()}


def snippet(text: str, limit: int = 120) -> str:
    """What an error message may quote of text from outside (a registry, a sandbox's port): printable
    characters, and few of them."""
    clean = "".join(ch if ch.isprintable() else "?" for ch in text[: limit + 1])
    return clean if len(clean) <= limit else clean[:limit] + "..."


def parse_json(raw: str | bytes | bytearray) -> Any:
    """``json.loads`` for JSON from outside (a client, a sandbox, a registry): nesting deeper than
    Python's decoder recurses raises RecursionError, which no ``except ValueError`` caught (a body
    of 5000 ``[`` was a 500); here it is a ValueError like any other malformed JSON."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def lookup(cls: type[BaseException]) -> tuple[int, str]:
    for klass in cls.__mro__:
        if klass in ERROR_TABLE:
            return ERROR_TABLE[klass]
    return ERROR_TABLE[AenvError]


def http_status(cls: type[BaseException]) -> int:
    return lookup(cls)[0]


RETRY_AFTER_SECONDS = 1  # a full node (429) or an unavailable cluster (503): when to ask again


def error_headers(exc: AenvError) -> dict[str, str]:
    """Headers of an error's answer: E2B's ``Should-Retry`` (its SDKs' own retries stay off), and
    ``Retry-After`` where trying again later is the answer (a full node, a cluster out of reach)."""
    headers = {"Should-Retry": "false"} if exc.status in (429, 502, 503, 504) else {}
    if exc.status in (429, 503):
        headers["Retry-After"] = str(getattr(exc, "retry_after", RETRY_AFTER_SECONDS))
    return headers


def error_body(exc: AenvError) -> dict[str, Any]:
    status, code = lookup(type(exc))
    return {"code": exc.status or status, "message": exc.message, "error_code": code}


def from_body(status: int, body: Any) -> AenvError:
    """Rebuild an error from a response body (the SDK side of the table)."""
    if isinstance(body, dict):
        cls = CODE_TO_CLASS.get(str(body.get("error_code", "")))
        message = str(body.get("message", ""))
    else:
        cls, message = None, str(body)
    if cls is None:
        cls = next((c for c, (s, _) in ERROR_TABLE.items() if s == status and c.__mro__[1] is AenvError), AenvError)
    return cls(message or f"HTTP {status}", status=status)
