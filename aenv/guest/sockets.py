"""Blocking-socket plumbing between TCP connections inside the sandbox and channel streams.

This runsc cannot checkpoint a TCP socket that sits in an epoll set ("endpoint still has waiters
upon save"), while a thread blocked in accept(), connect() or recv() checkpoints fine. So the
agent keeps its in-sandbox TCP sockets out of asyncio: threads do the socket I/O and hand the
channel work to the event loop. A sandbox can then pause in the middle of a proxied request.
"""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from aenv.channel import DATA, END, EOF, SPLICE_CHUNK, ChannelClosed, Stream

T = TypeVar("T")
RELAY_LINGER = 2.0  # after the peer ends a stream, how long its last data has to reach the socket


def on_loop(loop: asyncio.AbstractEventLoop, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
    """Run ``coro`` on the agent's event loop from a worker thread and wait for it (TimeoutError
    after ``timeout`` seconds, with ``coro`` cancelled)."""
    future = asyncio.run_coroutine_threadsafe(coro, loop)
    try:
        return future.result(timeout)
    except TimeoutError:
        future.cancel()
        raise


def relay(loop: asyncio.AbstractEventLoop, conn: socket.socket, stream: Stream) -> None:
    """Copy bytes both ways between ``conn`` and ``stream`` until both directions are done."""

    def inbound() -> None:  # stream -> socket
        try:
            while True:
                item = on_loop(loop, stream.recv())
                if item.kind == DATA:
                    conn.sendall(item.data)
                elif item.kind == EOF:
                    conn.shutdown(socket.SHUT_WR)
                elif item.kind == END:
                    return
        except OSError:
            return
        finally:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # wakes the recv() of the other direction
            except OSError:
                pass

    # Once the peer ends the stream, a direction blocked on a socket that neither reads nor writes
    # (sendall to a port that never reads, recv from one that never sends) is woken by a shutdown.
    # The lock keeps that shutdown off a socket this relay is already done with (and its fd).
    lock, finished = threading.Lock(), threading.Event()

    def wake() -> None:
        with lock:
            if not finished.is_set():
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    watcher = asyncio.run_coroutine_threadsafe(_after_peer_end(stream, wake), loop)
    down = threading.Thread(target=inbound, name="relay-in", daemon=True)
    down.start()
    try:
        while chunk := conn.recv(SPLICE_CHUNK):
            on_loop(loop, stream.send_data(chunk))
        on_loop(loop, stream.send_eof())
    except (OSError, ChannelClosed):
        pass
    down.join()
    with lock:
        finished.set()
    watcher.cancel()


async def _after_peer_end(stream: Stream, then: Callable[[], None]) -> None:
    await stream.peer_end.wait()
    await asyncio.sleep(RELAY_LINGER)
    then()


async def on_own_thread(fn: Callable[..., T], *args: Any, name: str = "worker") -> T:
    """``fn(*args)`` on a thread of its own, which ends with it: not the default executor, which a
    few long calls would fill up and whose workers stay after them."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[T] = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(result)

    def work() -> None:
        try:
            result = fn(*args)
        except BaseException as exc:  # handed to the awaiting coroutine
            loop.call_soon_threadsafe(settle, None, exc)
        else:
            loop.call_soon_threadsafe(settle, result, None)

    threading.Thread(target=work, name=name, daemon=True).start()
    return await done


async def relay_in_thread(conn: socket.socket, stream: Stream) -> None:
    """:func:`relay` on a thread of its own; returns when the exchange is over and ``conn`` is closed."""
    loop = asyncio.get_running_loop()

    def work() -> None:
        try:
            relay(loop, conn, stream)
        finally:
            conn.close()

    await on_own_thread(work, name="relay")


def listen_abstract(name: bytes, kind: socket.SocketKind) -> socket.socket | None:
    """A listening Unix socket at abstract ``name`` (programs of the sandbox connect to it), or
    None when the name is taken."""
    listener = socket.socket(socket.AF_UNIX, kind)
    try:
        listener.bind(name)
        listener.listen(64)
    except OSError:
        listener.close()
        return None
    return listener


def accepted(listener: socket.socket) -> Iterator[socket.socket]:
    """Connections to ``listener``, for good; a failed accept is waited out, not spun on."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            time.sleep(0.1)  # e.g. out of descriptors: not a busy loop
            continue
        yield conn


def _tcp_inodes() -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                next(f, None)
                for line in f:
                    fields = line.split()
                    if len(fields) > 9:
                        inodes.add(fields[9])
        except OSError:
            continue
    return inodes


def checkpoint_blockers() -> list[dict[str, object]]:
    """Processes that hold both an epoll instance and a TCP socket.

    runsc cannot save a TCP socket that an epoll set watches, and a failed save takes the whole
    sandbox down with it; so the host asks first and refuses the pause. Holding both is how
    asyncio, Node or nginx servers look; it may also refuse a process that never put its TCP
    socket in the epoll set, which is the safe way to be wrong.
    """
    tcp = _tcp_inodes()
    if not tcp:
        return []
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue  # the agent's own TCP sockets never enter its epoll set (see above)
        try:
            targets = [os.readlink(f"/proc/{entry}/fd/{fd}") for fd in os.listdir(f"/proc/{entry}/fd")]
        except OSError:
            continue  # gone, or not ours to read
        if "anon_inode:[eventpoll]" not in targets:
            continue
        if any(t.startswith("socket:[") and t[8:-1] in tcp for t in targets):
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                cmd = "?"
            found.append({"pid": int(entry), "cmd": cmd[:200]})
    return found
