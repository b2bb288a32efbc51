"""Create ids: a create sent again with the same id gets the first one's sandbox, never a second.

A gateway names each client's create with an id (``x-aenv-create-id``; a client may choose its
own, or send E2B's ``Idempotency-Key``, which becomes the id) and may send it again, to this node
or another, when the first attempt's connection broke or took too long. The node answers every
attempt with one sandbox: a second attempt joins the first while it runs and gets its result
after. A failed create forgets its id (trying again is a new create). In a cluster a ``Claims``
(the node agent) takes the id in etcd first, so another node refuses it (409 ``create_elsewhere``),
and checks the id is still this node's before the create answers (a node cut off from etcd longer
than its lease may have lost it to another).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol

from aenv.cluster.entries import ID_PATTERN  # in a cluster the id is an etcd key's last segment
from aenv.errors import InvalidRequest, LimitExceeded

CREATE_ID_HEADER = "x-aenv-create-id"
# E2B's: the SDKs send it with a create (``idempotency_key=``; retries reuse it): 1-255 characters.
IDEMPOTENCY_HEADER = "idempotency-key"
MAX_IDEMPOTENCY_KEY = 255
KEEP_SECONDS = 600.0  # how long a create id is remembered after its create
MAX_KEPT = 10_000


class Claims(Protocol):
    async def claim(self, create_id: str) -> None:
        """Take the id (raises CreateElsewhere when another node has it)."""

    async def confirm(self, create_id: str) -> None:
        """Raises CreateElsewhere when the id is no longer this node's."""

    async def release(self, create_id: str) -> None:
        """Give the id up (a failed create)."""


class CreateIds:
    def __init__(self, kill: Callable[[str], Awaitable[None]]) -> None:
        self.kill = kill
        self.claims: Claims | None = None  # set by the cluster agent
        self._creates: dict[str, tuple[asyncio.Future[str], float]] = {}

    async def once(self, create_id: str, create: Callable[[], Awaitable[str]]) -> str:
        """The id of the sandbox made for ``create_id``: by ``create`` the first time, the same after."""
        _check(create_id)
        self._forget_old()
        known = self._creates.get(create_id)
        if known is None:
            if len(self._creates) >= MAX_KEPT:
                raise LimitExceeded(f"more than {MAX_KEPT} create ids in the last {KEEP_SECONDS:.0f} s")
            # Its own task: a client (or gateway) that goes away does not cancel what others join.
            known = (asyncio.ensure_future(self._create(create_id, create)), time.monotonic())
            self._creates[create_id] = known
        return await asyncio.shield(known[0])

    async def _create(self, create_id: str, create: Callable[[], Awaitable[str]]) -> str:
        claimed = False
        try:
            if self.claims is not None:
                await self.claims.claim(create_id)
                claimed = True
            sandbox_id = await create()
            if self.claims is not None:
                try:
                    await self.claims.confirm(create_id)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await self.kill(sandbox_id)  # made elsewhere meanwhile: this copy is one too many
                    claimed = False
                    raise
            return sandbox_id
        except BaseException:
            self._creates.pop(create_id, None)
            if claimed and self.claims is not None:
                await self.claims.release(create_id)
            raise

    def _forget_old(self) -> None:
        now = time.monotonic()
        for create_id, (task, at) in list(self._creates.items()):
            if task.done() and now - at > KEEP_SECONDS:
                del self._creates[create_id]


def create_id_of(headers: Mapping[str, str]) -> str | None:
    """The create id a request names: ``x-aenv-create-id``, else E2B's ``Idempotency-Key`` (a key
    that is not a create id as it is, longer or with other characters, is named by its digest)."""
    own = headers.get(CREATE_ID_HEADER)
    if own is not None:
        return own
    key = headers.get(IDEMPOTENCY_HEADER)
    if key is None:
        return None
    if not 1 <= len(key) <= MAX_IDEMPOTENCY_KEY or not key.isascii() or not key.isprintable():
        raise InvalidRequest(f"Idempotency-Key must be 1-{MAX_IDEMPOTENCY_KEY} printable ASCII characters")
    if ID_PATTERN.fullmatch(key):
        return key
    return "idempotency-" + hashlib.sha256(key.encode()).hexdigest()[:48]


def _check(create_id: str) -> None:
    if not ID_PATTERN.fullmatch(create_id):
        raise InvalidRequest(f"{CREATE_ID_HEADER} must be 1-63 characters of A-Z a-z 0-9 . _ -")
