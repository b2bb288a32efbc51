"""The template helpers of the client: a build's context packed and streamed up, a build's or
pull's progress read back."""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import tarfile
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, BinaryIO

import httpx

from aenv.errors import AenvError
from aenv.sdk._wire import raise_for as _raise_for


class BuildError(AenvError):
    """A template build failed: ``step`` is the Dockerfile line, ``output`` what it printed."""

    def __init__(self, body: dict[str, Any]) -> None:
        super().__init__(str(body.get("message", "build failed")), status=int(body.get("code", 400)))
        self.step = body.get("step")
        self.output = str(body.get("output") or "")


ProgressFn = Callable[[int, int], None]  # (bytes sent, bytes in all)
UPLOAD_CHUNK = 1 << 20


async def _chunks_of(source: BinaryIO, total: int, on_progress: ProgressFn | None) -> AsyncIterator[bytes]:
    """``source``'s bytes in chunks, read off the event loop, telling ``on_progress`` as they go."""
    sent = 0
    while chunk := await asyncio.to_thread(source.read, UPLOAD_CHUNK):
        sent += len(chunk)
        yield chunk
        if on_progress is not None:
            on_progress(sent, total)


async def _template_stream(
    r: httpx.Response, on_log: Callable[[str], None] | None, on_progress: Callable[[int, int, int, int], None] | None
) -> dict[str, Any]:
    """A build's or pull's NDJSON lines: logs and progress handed on, then its template or error."""
    if r.status_code not in (200, 201):
        await r.aread()
        _raise_for(r)
    async for line in r.aiter_lines():
        if not line.strip():
            continue
        item = json.loads(line)
        if "log" in item and on_log is not None:
            on_log(item["log"])
        elif "progress" in item and on_progress is not None:
            p = item["progress"]
            on_progress(p["layer"], p["layers"], p["done"], p["total"])
        elif "template" in item:
            result: dict[str, Any] = item["template"]
            return result
        elif "error" in item:
            raise BuildError(item["error"])
    raise AenvError("the template's stream ended without a result")


def _pack_context(into: BinaryIO, context: Path, outside: Path | None, dockerfile: str) -> None:
    with tarfile.open(fileobj=into, mode="w:gz") as tar:
        tar.add(str(context), arcname=".")
        if outside is not None:
            tar.add(str(outside), arcname=dockerfile)


def _recipe_in(context: Path, dockerfile: str) -> tuple[str, Path | None]:
    """The Dockerfile's name in the build context, and the file to add to the context when it is
    outside it (an absolute path elsewhere)."""
    if not os.path.isabs(dockerfile):
        return dockerfile, None
    recipe, root = Path(dockerfile).resolve(), context.resolve()
    if recipe.is_relative_to(root):
        return recipe.relative_to(root).as_posix(), None
    return f".aenv-dockerfile-{secrets.token_hex(6)}", recipe
