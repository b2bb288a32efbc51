"""Upload bodies as streams of bytes, never held whole and never spooled to the host's disk.

``multipart_parts`` parses multipart/form-data as it arrives (python-multipart's push parser) and
yields each part's headers and then its bytes; ``decoded`` undoes a gzip or deflate
Content-Encoding piece by piece, so a small compressed body cannot inflate into a large buffer.
"""

from __future__ import annotations

import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from aenv.errors import InvalidRequest

INFLATE_PIECE = 1 << 20  # the most one decompression step may produce


@dataclass
class PartStart:
    """A part's headers are complete: the form field name, and the filename if it is a file."""

    name: str
    filename: str | None


@dataclass
class PartEnd:
    pass


PartEvent = PartStart | bytes | PartEnd


def _text(raw: bytes) -> str:
    try:
        return raw.decode()
    except UnicodeDecodeError:
        return raw.decode("latin-1")


class _Collector:
    """python-multipart's callbacks, turned into a list of events taken after each write."""

    def __init__(self) -> None:
        self.events: list[PartEvent] = []
        self._headers: dict[bytes, bytes] = {}
        self._field = b""
        self._value = b""

    def callbacks(self) -> dict[str, object]:
        return {
            "on_part_begin": self._begin,
            "on_header_field": lambda data, start, end: self._grow("_field", data[start:end]),
            "on_header_value": lambda data, start, end: self._grow("_value", data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": lambda data, start, end: self.events.append(bytes(data[start:end])),
            "on_part_end": lambda: self.events.append(PartEnd()),
        }

    def _grow(self, attr: str, data: bytes) -> None:
        setattr(self, attr, getattr(self, attr) + data)

    def _begin(self) -> None:
        self._headers = {}

    def _header_end(self) -> None:
        self._headers[self._field.lower()] = self._value
        self._field, self._value = b"", b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition"))
        name = _text(options.get(b"name", b""))
        filename = _text(options[b"filename"]) if b"filename" in options else None
        self.events.append(PartStart(name, filename))


async def multipart_parts(request: Request) -> AsyncIterator[PartEvent]:
    """The parts of a multipart/form-data body, in order, as they arrive: a PartStart, the part's
    bytes in pieces no larger than what the client sent at once, then a PartEnd."""
    _, params = parse_options_header(request.headers.get("content-type"))
    boundary = params.get(b"boundary")
    if not boundary:
        raise InvalidRequest("the multipart upload has no boundary")
    collector = _Collector()
    try:
        parser = MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
        async for chunk in request.stream():
            parser.write(chunk)
            events, collector.events = collector.events, []
            for event in events:
                yield event
        parser.finalize()
    except FormParserError as exc:
        raise InvalidRequest(f"the multipart upload is malformed: {exc}") from exc
    for event in collector.events:
        yield event


async def decoded(request: Request) -> AsyncIterator[bytes]:
    """The request body with its gzip or deflate Content-Encoding undone, in bounded pieces."""
    encoding = request.headers.get("content-encoding", "").lower()
    if encoding not in ("gzip", "deflate"):
        async for chunk in request.stream():
            yield chunk
        return
    inflater = zlib.decompressobj(zlib.MAX_WBITS | 16 if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        async for chunk in request.stream():
            data = chunk
            while data:
                yield inflater.decompress(data, INFLATE_PIECE)
                data = inflater.unconsumed_tail
        yield inflater.flush()
    except zlib.error as exc:
        raise InvalidRequest(f"cannot decode the {encoding} upload: {exc}") from exc
    if not inflater.eof:
        raise InvalidRequest(f"the {encoding} upload ends before its compressed stream does")
