"""Running a node: API key, the `base` template, then the HTTP server until a signal."""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from aenv.api.app import build
from aenv.config import Settings
from aenv.node.orchestrator import Node
from aenv.storage import datadir

log = logging.getLogger("aenv.server")
HEAD_TIMEOUT = 30.0  # seconds a client has to send a request's head, from its connection or its first byte


class HeadDeadline(HttpToolsProtocol):
    """uvicorn's HTTP protocol with a deadline on each request head, which uvicorn has not: a client
    that sent half a head, or a byte now and then, kept its connection and a file descriptor for as
    long as it liked, without an API key (enough of them leave the node without descriptors).

    The deadline runs from a connection's start (a client connects to send a request) and from the
    first byte of each later head; an idle kept-alive connection between requests is bounded by
    uvicorn's keep-alive timeout instead, which clients' pools rely on."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._head_timer is None:
            self._await_head()

    def on_headers_complete(self) -> None:
        self._head_in()  # what follows (the body) is the route's to bound
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_in()
        super().connection_lost(exc)

    def _await_head(self) -> None:
        self._head_in()
        self._head_timer = self.loop.call_later(HEAD_TIMEOUT, self.transport.close)

    def _head_in(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None


def resolve_api_key(settings: Settings) -> str:
    """AENV_API_KEY if set; else a key generated once and kept in the data dir."""
    if settings.api_key:
        return settings.api_key
    path = settings.data_dir / "api-key"
    if path.exists():
        return path.read_text().strip()
    datadir.secure(settings.data_dir)
    key = "e2b_" + secrets.token_hex(20)  # E2B-shaped, so SDKs that validate key format accept it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


async def serve(
    settings: Settings, *, on_log: Callable[[str], None] | None = None, ready_file: Path | None = None
) -> None:
    from aenv.templates.builder import ensure_base

    say = on_log or (lambda line: log.info("%s", line))
    os.umask(datadir.PRIVATE_UMASK)  # the node's files, its tools' (runsc's images) and logs: owner-only
    api_key = resolve_api_key(settings)
    node = Node(settings)
    await node.start()
    try:
        if settings.build_base:
            try:
                node.find_template("base")
            except LookupError:
                say("building the `base` template (first start only; takes about a minute)")
            await ensure_base(node, on_log=say)
        config = uvicorn.Config(
            build(node, api_key, start_node=False),
            host=settings.host,
            port=settings.port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=5,
            http=HeadDeadline,
            ws_max_size=settings.port_ws_max_message_mb * 2**20,  # what a client may send a sandbox's port
        )
        server = uvicorn.Server(config)
        say(f"aenv listening on http://{settings.host}:{settings.port} (API key in {settings.data_dir / 'api-key'})")
        if ready_file is not None:
            ready_file.write_text(f"http://{settings.host}:{settings.port}\n")
    except BaseException:
        await node.stop()
        raise
    await server.serve()  # the app's shutdown stops the node
