"""E2B's list parameters: keyset pagination (``nextToken``), time bounds and metadata filters.

A page token is E2B's: base64url of ``<RFC 3339 time>__<id>`` (``__asc`` appended for ascending
lists), the position of the last item served. The next page starts after that position, so items
created or removed between two pages shift nothing: none is served twice or skipped. A token is
the client's input like any other: bounded, decoded strictly, and anything that is not one this
node could have made is a 400, never a path or a lookup.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from aenv.errors import InvalidRequest

T = TypeVar("T")
EPOCH = dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
MICROSECOND = dt.timedelta(microseconds=1)
MAX_TOKEN = 256  # tokens this node makes are under 100 characters
MAX_ID = 128
ITEM_ID = re.compile(r"[a-z0-9]+(_[a-z0-9]+)*", re.ASCII)  # sandbox ids, snapshot ids (snap_...)
INVALID_TOKEN = "Invalid next token"


def micros(ts: float) -> int:
    """A record's time on the microsecond grid it is shown with (``startedAt``, ``createdAt``)."""
    return (dt.datetime.fromtimestamp(ts, dt.UTC) - EPOCH) // MICROSECOND


def parse_time(value: str, name: str) -> int:
    """An RFC 3339 time with its offset, in microseconds since the epoch (finer digits truncated,
    as E2B truncates)."""
    try:
        when = dt.datetime.fromisoformat(value)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid format for parameter {name}: '{value[:64]}' is not an RFC 3339 time") from exc
    if when.tzinfo is None:
        raise InvalidRequest(f"Invalid format for parameter {name}: '{value[:64]}' has no time zone offset")
    return (when - EPOCH) // MICROSECOND


def _format(at: int) -> str:
    return (EPOCH + at * MICROSECOND).isoformat().replace("+00:00", "Z")


@dataclass(frozen=True)
class Position:
    at: int  # microseconds since the epoch
    id: str


@dataclass(frozen=True)
class Order:
    """A list's order: by time, ties broken by id (E2B's sandbox lists break ties the other way
    round from its snapshot list)."""

    newest_first: bool
    ids_descending: bool
    suffix: str = ""  # what E2B's tokens for this order end with

    def sort(self, items: list[T], position: Callable[[T], Position]) -> list[T]:
        by_id = sorted(items, key=lambda item: position(item).id, reverse=self.ids_descending)
        return sorted(by_id, key=lambda item: position(item).at, reverse=self.newest_first)

    def follows(self, pos: Position, cursor: Position) -> bool:
        if pos.at != cursor.at:
            return pos.at < cursor.at if self.newest_first else pos.at > cursor.at
        return pos.id < cursor.id if self.ids_descending else pos.id > cursor.id

    def token(self, pos: Position) -> str:
        return base64.urlsafe_b64encode(f"{_format(pos.at)}__{pos.id}{self.suffix}".encode()).decode()

    def cursor(self, token: str) -> Position:
        """The position a token names; 400 for anything else, or for a token of another order."""
        if len(token) > MAX_TOKEN:
            raise InvalidRequest(INVALID_TOKEN)
        try:
            text = base64.b64decode(token.encode("ascii"), altchars=b"-_", validate=True).decode("utf-8")
        except (UnicodeError, binascii.Error, ValueError) as exc:
            raise InvalidRequest(INVALID_TOKEN) from exc
        if self.suffix:
            if not text.endswith(self.suffix):
                raise InvalidRequest(INVALID_TOKEN)
            text = text[: -len(self.suffix)]
        when, sep, item_id = text.partition("__")
        if not sep or not ITEM_ID.fullmatch(item_id):
            raise InvalidRequest(INVALID_TOKEN)
        try:
            at = (dt.datetime.fromisoformat(when) - EPOCH) // MICROSECOND
        except (ValueError, TypeError) as exc:  # TypeError: a time without an offset
            raise InvalidRequest(INVALID_TOKEN) from exc
        return Position(at, item_id)

    def page(
        self, items: list[T], position: Callable[[T], Position], limit: int, token: str | None
    ) -> tuple[list[T], str | None]:
        """The page of ``items`` after ``token`` (from the start without one) and the next page's
        token, if more follow."""
        ordered = self.sort(items, position)
        if token:
            cursor = self.cursor(token)
            ordered = [item for item in ordered if self.follows(position(item), cursor)]
        if len(ordered) <= limit:
            return ordered, None
        return ordered[:limit], self.token(position(ordered[limit - 1]))


SANDBOXES_NEWEST_FIRST = Order(newest_first=True, ids_descending=False)
SANDBOXES_OLDEST_FIRST = Order(newest_first=False, ids_descending=True, suffix="__asc")
SNAPSHOTS = Order(newest_first=True, ids_descending=True)


def short_sandbox_id(value: str) -> str:
    """A sandbox id as E2B's API takes it (``<id>`` or ``<id>-<client id>``); 400 otherwise."""
    parts = value.split("-")
    if len(parts) > 2 or not parts[0] or len(parts[0]) > MAX_ID or not (parts[0].isascii() and parts[0].isalnum()):
        raise InvalidRequest("Invalid sandbox ID")
    if parts[0] != parts[0].lower():
        raise InvalidRequest("Invalid sandbox ID")
    return parts[0]
