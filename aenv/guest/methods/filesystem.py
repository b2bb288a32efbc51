"""filesystem.Filesystem: stat, list, make, move, remove, read and write files, and watch directories.

Paths are resolved for the request's user (:func:`aenv.guest.files.resolve`); the file work itself
runs on the agent's file pool (:func:`~aenv.guest.methods.off_loop`), never on the event loop.
Stdlib only.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aenv.channel import DATA, END, EOF, Stream
from aenv.guest import files, metadata
from aenv.guest.methods import handler, off_loop, until_cancelled
from aenv.guest.users import User
from aenv.guest.watch import Watcher

if TYPE_CHECKING:
    from aenv.guest.agent import Agent

READ_CHUNK = 256 * 1024


def _path(agent: Agent, params: dict[str, Any], key: str = "path") -> tuple[str, User]:
    user = agent.user_of(params)
    return files.resolve(str(params.get(key) or ""), user, agent.workdir), user


@handler("fs.stat")
async def fs_stat(agent: Agent, stream: Stream) -> Any:
    return await off_loop(files.stat_path, _path(agent, stream.params)[0])


@handler("fs.list")
async def fs_list(agent: Agent, stream: Stream) -> Any:
    return await off_loop(files.list_dir, _path(agent, stream.params)[0], int(stream.params.get("depth") or 1))


@handler("fs.mkdir")
async def fs_mkdir(agent: Agent, stream: Stream) -> Any:
    return await off_loop(files.make_dir, *_path(agent, stream.params))


@handler("fs.move")
async def fs_move(agent: Agent, stream: Stream) -> Any:
    src, user = _path(agent, stream.params, "source")
    dst, _ = _path(agent, stream.params, "destination")
    return await off_loop(files.move, src, dst, user)


@handler("fs.remove")
async def fs_remove(agent: Agent, stream: Stream) -> Any:
    return await off_loop(files.remove, _path(agent, stream.params)[0])


@handler("fs.read", streaming=True)
async def fs_read(agent: Agent, stream: Stream) -> None:
    """The entry (its size is exactly what follows), then the file's bytes."""
    path, _ = _path(agent, stream.params)
    fd, entry = await off_loop(files.open_for_read, path)
    try:
        if entry["size"] == 0:
            data = await off_loop(files.read_unsized, fd, path)
            entry["size"] = len(data)
            await stream.send({"entry": entry})
            await stream.send_data(data)
        else:
            # The first read comes before the answer starts, so a file that cannot be read is a
            # clean error; a later failure ends the stream with the same translated reason.
            left = entry["size"]  # a file that grows meanwhile is sent as it was when opened
            chunk = await off_loop(_read, fd, path, left)
            await stream.send({"entry": entry})
            while chunk:
                left -= len(chunk)
                await stream.send_data(chunk)
                chunk = await off_loop(_read, fd, path, left) if left > 0 else b""
    finally:
        os.close(fd)
    await stream.end(result={})


def _read(fd: int, path: str, left: int) -> bytes:
    try:
        return os.read(fd, min(READ_CHUNK, left))
    except OSError as exc:
        raise files.translate(exc, path) from exc


@handler("fs.write")
async def fs_write(agent: Agent, stream: Stream) -> Any:
    path, user = _path(agent, stream.params)
    wanted = _metadata(stream.params)
    await off_loop(files.check_metadata_room, path, wanted)
    fd = await off_loop(files.open_for_write, path, user)
    written = 0
    try:
        while True:
            item = await stream.recv()
            if item.kind == DATA:
                await off_loop(files.write_all, fd, item.data)
                written += len(item.data)
            elif item.kind == EOF:
                break
            elif item.kind == END:  # the host gave up on the upload: leave no truncated file
                _discard_partial(fd, path)
                return None
        kept = await off_loop(files.set_metadata, fd, path, wanted)
    except OSError as exc:  # a full disk above all: the space goes back, the reason to the host
        _discard_partial(fd, path)
        error = files.translate(exc, path)
        raise files.FileError(error.code, f"{error.message}; the partial file was removed") from exc
    finally:
        os.close(fd)
    answer = {"path": path, "name": os.path.basename(path), "type": "file", "size": written}
    return {**answer, "metadata": kept} if kept else answer


def _metadata(params: dict[str, Any]) -> dict[str, str]:
    """The metadata an upload sets (the host checked it; so is it here, cheaply)."""
    given = params.get("metadata") or {}
    if not isinstance(given, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in given.items()):
        raise files.FileError("invalid_argument", "invalid metadata: not a map of strings")
    try:
        metadata.validate(given)
    except metadata.Invalid as exc:
        raise files.FileError("invalid_argument", f"invalid metadata: {exc}") from exc
    return given


def _discard_partial(fd: int, path: str) -> None:
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.unlink(path)
    except OSError:
        pass


def _watcher(path: str, params: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> Watcher:
    if not os.path.isdir(path):
        files.stat_path(path)
        raise files.FileError("invalid_argument", f"path '{path}' is not a directory")
    return Watcher(path, bool(params.get("recursive")), emit, bool(params.get("includeEntry")))


async def _start_watcher(agent: Agent, stream: Stream, emit: Callable[[dict[str, Any]], None]) -> Watcher:
    watcher = await off_loop(_watcher, _path(agent, stream.params)[0], stream.params, emit)
    watcher.start()
    return watcher


@handler("fs.watch_create")
async def fs_watch_create(agent: Agent, stream: Stream) -> Any:
    events: list[dict[str, Any]] = []
    watcher = await _start_watcher(agent, stream, events.append)
    wid = f"w{next(agent._watch_ids)}"
    agent.watchers[wid] = (watcher, events)
    return {"watcherId": wid}


@handler("fs.watch_events")
async def fs_watch_events(agent: Agent, stream: Stream) -> Any:
    wid = str(stream.params.get("watcherId"))
    if wid not in agent.watchers:
        raise files.FileError("not_found", f"watcher '{wid}' not found")
    _, events = agent.watchers[wid]
    out = list(events)
    events.clear()
    return {"events": out}


@handler("fs.watch_remove")
async def fs_watch_remove(agent: Agent, stream: Stream) -> Any:
    entry = agent.watchers.pop(str(stream.params.get("watcherId")), None)
    if entry is None:
        raise files.FileError("not_found", f"watcher '{stream.params.get('watcherId')}' not found")
    entry[0].close()
    return {}


@handler("fs.watch", streaming=True)
async def fs_watch(agent: Agent, stream: Stream) -> None:
    queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    watcher = await _start_watcher(agent, stream, queue.put_nowait)
    agent.stream_watchers[stream.id] = watcher
    await stream.send({"start": {}})
    cancel = asyncio.ensure_future(until_cancelled(stream))
    try:
        while not cancel.done():
            get = asyncio.ensure_future(queue.get())
            await asyncio.wait({get, cancel}, return_when=asyncio.FIRST_COMPLETED)
            if get.done():
                await stream.send({"filesystem": get.result()})
            else:
                get.cancel()
    finally:
        if agent.stream_watchers.pop(stream.id, None) is not None:
            watcher.close()
