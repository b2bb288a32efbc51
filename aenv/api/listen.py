"""The node's listening sockets, made before anything slow, and signals before it serves.

The `base` build takes a minute on a first start: a second server on the same port must not
build for a minute and only then find the port taken, so the port is bound and listened on
first and handed to uvicorn. Until uvicorn has its own signal handlers, SIGTERM and SIGINT
cancel what the node is doing (the build unmounts and removes what it made) instead of killing
the process on the spot.
"""

from __future__ import annotations

import asyncio
import errno
import signal
import socket
from collections.abc import Coroutine
from typing import Any, TypeVar

from aenv.errors import AenvError, Conflict, InvalidRequest

BACKLOG = 2048  # uvicorn's default
T = TypeVar("T")


def bind(host: str, port: int) -> list[socket.socket]:
    """Listening sockets for ``host`` (an IPv4 or IPv6 address, a name, or "" for every
    address) and ``port``, as asyncio's create_server would make them: one per address the
    host resolves to, IPv6 ones IPv6-only. A port in use is a Conflict naming it."""
    bare = host.strip("[]") or None
    where = f"[{bare}]:{port}" if bare and ":" in bare else f"{bare or '*'}:{port}"
    try:
        infos = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise InvalidRequest(f"cannot listen on {where}: {exc.strerror}") from None
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, address in dict.fromkeys(infos):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind(address)
                sock.listen(BACKLOG)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise Conflict(
                        f"cannot listen on {where}: the address is in use (another aenv server, or another "
                        f"program, listens there)"
                    ) from None
                raise InvalidRequest(f"cannot listen on {where}: {exc.strerror}") from None
            sock.set_inheritable(True)
    except BaseException:
        close(sockets)
        raise
    return sockets


def close(sockets: list[socket.socket]) -> None:
    for sock in sockets:
        sock.close()


class Stopped(AenvError):
    """A signal stopped the node before it served (serve() returns; never an API answer)."""


async def until_signalled(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro``; SIGTERM or SIGINT meanwhile cancels it (its cleanup runs to the end) and
    raises Stopped."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(coro)
    signalled: list[int] = []

    def stop(signum: int) -> None:
        signalled.append(signum)
        task.cancel()

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    for sig in previous:
        loop.add_signal_handler(sig, stop, sig)
    try:
        return await task
    except asyncio.CancelledError:
        if signalled and task.cancelled():
            raise Stopped(signal.Signals(signalled[0]).name) from None
        raise
    finally:
        for sig, handler in previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, handler)
