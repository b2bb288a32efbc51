"""Signed ``/files`` URLs (E2B's v1 signatures), checked with work that does not grow with what a
stranger sends.

The SDKs sign download and upload URLs themselves, with the sandbox's envd access token: ``v1_``
and the unpadded base64 of sha256("<path>:<operation>:<username>:<token>[:<expiration>]"). A URL
routed to its sandbox (``E2b-Sandbox-Id``, a ``<port>-<id>.<domain>`` host) costs one hash. One
made while ``E2B_SANDBOX_URL`` is a single proxy names no sandbox: only its signature says which,
and a hash cannot be undone, so each secure sandbox's token is tried (``Signers``). That search
is kept cheap and out of the way:

- the path and username are bounded before anything is hashed (414), and a signature that does
  not have the SDKs' shape is tried against nothing;
- the part of the hash that covers path, operation and username is taken once: each sandbox adds
  only its token (one SHA-256 block), whatever the path's length;
- tokens are derived once per sandbox and kept, and so is a signature found: the same URL again
  costs one hash;
- one search runs at a time and gives the event loop back every few hundred sandboxes: health
  checks and every other request go on while strangers' URLs are looked up.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
from collections.abc import Callable, Sequence

from starlette.requests import Request
from starlette.responses import JSONResponse

from aenv.api.connect import PATH_MAX
from aenv.node.service import access_token

MAX_USERNAME = 256  # bytes; Linux's user names are at most 32
SIGNATURE_PREFIX = "v1_"
SIGNATURE_CHARS = 43  # a SHA-256 digest in base64, unpadded
CHUNK = 256  # sandboxes tried between two turns of the event loop
MAX_FOUND = 4096  # signatures remembered with their sandbox


def operation_of(request: Request) -> str:
    return "write" if request.method == "POST" else "read"


def expiration_of(request: Request) -> int | None:
    raw = request.query_params.get("signature_expiration")
    return int(raw) if raw and raw.isascii() and raw.isdigit() and len(raw) <= 20 else None


def signature(path: str, operation: str, username: str | None, token: str, expiration: int | None) -> str:
    raw = f"{path}:{operation}:{username or ''}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    return SIGNATURE_PREFIX + base64.b64encode(hashlib.sha256(raw.encode()).digest()).decode().rstrip("=")


def too_long(request: Request) -> JSONResponse | None:
    """A 414 for a ``/files`` URL whose path or username no file or user could have (what a
    signature covers is bounded before it is hashed)."""
    path = request.query_params.get("path", "")
    if len(path.encode()) > PATH_MAX:
        return _uri_too_long(f"path is longer than {PATH_MAX} bytes")
    if len((request.query_params.get("username") or "").encode()) > MAX_USERNAME:
        return _uri_too_long(f"username is longer than {MAX_USERNAME} bytes")
    return None


def _uri_too_long(message: str) -> JSONResponse:
    return JSONResponse({"code": 414, "message": message}, status_code=414)


def _digest(given: str) -> bytes | None:
    """The digest a signature of the SDKs' shape carries, or None (it matches no token)."""
    if len(given) != len(SIGNATURE_PREFIX) + SIGNATURE_CHARS or not given.isascii():
        return None
    if not given.startswith(SIGNATURE_PREFIX):
        return None
    encoded = given[len(SIGNATURE_PREFIX) :]
    try:
        digest = base64.b64decode(encoded + "=", validate=True)
    except (binascii.Error, ValueError):
        return None
    # only the one spelling the SDKs make (base64 leaves 2 bits of the last character free)
    return digest if base64.b64encode(digest).decode().rstrip("=") == encoded else None


class Signed:
    """What a ``/files`` URL's signature covers but the token, hashed once."""

    def __init__(self, request: Request) -> None:
        self.given = request.query_params.get("signature", "")
        self.digest = _digest(self.given)
        self.head = hashlib.sha256()
        if self.digest is not None:  # else nothing is hashed: no token made it
            path, username = request.query_params.get("path", ""), request.query_params.get("username") or ""
            self.head.update(f"{path}:{operation_of(request)}:{username}:".encode())
        expiration = expiration_of(request)
        self.tail = b"" if expiration is None else f":{expiration}".encode()

    def by(self, token: bytes) -> bool:
        """Whether ``token`` made this signature (expired or not)."""
        if self.digest is None:
            return False
        h = self.head.copy()
        h.update(token + self.tail)
        return hmac.compare_digest(h.digest(), self.digest)


def signed_by(request: Request, token: str) -> bool:
    """One check, for a URL routed to its sandbox: its signature was made with ``token``."""
    if too_long(request) is not None:
        return False
    return Signed(request).by(token.encode())


class Signers:
    """The sandbox whose envd access token signed a ``/files`` URL that names none, among the
    secure sandboxes a node or gateway knows (see the module's docstring). One per node or
    gateway: it keeps the tokens it derived and the signatures it found."""

    def __init__(self) -> None:
        self._secret = b""
        self._tokens: dict[str, bytes] = {}
        self._found: dict[str, str] = {}  # signature -> sandbox id, the latest MAX_FOUND
        self._lock = asyncio.Lock()
        self.tried = 0  # tokens tried so far (what searches cost)

    async def find(
        self, request: Request, secret: bytes, known: Callable[[str], bool], every: Callable[[], Sequence[str]]
    ) -> str | None:
        """The sandbox that signed ``request``'s URL, or None. ``known``: whether a sandbox is
        still one that may have signed; ``every``: all of those (asked only for a search).
        Call ``too_long`` first: this hashes the path."""
        signed = Signed(request)
        if signed.digest is None:
            return None
        if secret != self._secret:  # a node that joined a cluster took its secret: tokens changed
            self._secret, self._tokens, self._found = secret, {}, {}
        hit = self._remembered(signed, known)
        if hit is not None:
            return hit
        async with self._lock:
            hit = self._remembered(signed, known)  # found by the search this one waited for
            if hit is not None:
                return hit
            ids = every()
            if len(self._tokens) > 2 * len(ids) + 1024:  # sandboxes come and go: drop the gone ones'
                self._tokens = {}
            kept, head, tail, digest = self._tokens, signed.head, signed.tail, signed.digest
            for start in range(0, len(ids), CHUNK):
                chunk = ids[start : start + CHUNK]
                for n, sandbox_id in enumerate(chunk):  # Signed.by, inlined: about 1 us a sandbox
                    h = head.copy()
                    h.update((kept.get(sandbox_id) or self._token(sandbox_id)) + tail)
                    if hmac.compare_digest(h.digest(), digest):
                        self.tried += n + 1
                        self._remember(signed.given, sandbox_id)
                        return sandbox_id
                self.tried += len(chunk)
                await asyncio.sleep(0)
        return None

    def _tried(self, signed: Signed, sandbox_id: str) -> bool:
        self.tried += 1
        return signed.by(self._token(sandbox_id))

    def _token(self, sandbox_id: str) -> bytes:
        token = self._tokens.get(sandbox_id)
        if token is None:
            token = self._tokens[sandbox_id] = access_token(self._secret, sandbox_id).encode()
        return token

    def _remembered(self, signed: Signed, known: Callable[[str], bool]) -> str | None:
        sandbox_id = self._found.get(signed.given)
        if sandbox_id is None or not known(sandbox_id) or not self._tried(signed, sandbox_id):
            return None  # its sandbox is gone, or the signature is the same and the rest is not
        return sandbox_id

    def _remember(self, given: str, sandbox_id: str) -> None:
        if len(self._found) >= MAX_FOUND:
            del self._found[next(iter(self._found))]
        self._found[given] = sandbox_id
