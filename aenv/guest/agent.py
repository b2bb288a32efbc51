"""The in-sandbox agent: serves processes, files, watches and tunnels over the channel on stdio.

It runs as root inside the sandbox, from a read-only runtime bundle mounted at /.aenv, so the
image needs no Python of its own. Everything it does is on behalf of the host; it holds no policy.
"""

from __future__ import annotations

import asyncio
import base64
import itertools
import os
import resource
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from aenv.channel import DATA, END, EOF, Channel, ChannelClosed, Stream
from aenv.guest import files, metadata, processes, safeio
from aenv.guest.egress import PROXY_ENV, EgressProxy
from aenv.guest.processes import SIGNALS, ProcessError, ProcessTable
from aenv.guest.sentry import HeapRelease
from aenv.guest.sockets import checkpoint_blockers, on_own_thread, relay_in_thread
from aenv.guest.sudo import SudoServer
from aenv.guest.users import UnknownUser, User, lookup
from aenv.guest.watch import Watcher
from aenv.guest.xattrs import XattrServer

AGENT_VERSION = "0.6.4"  # the envd API level this agent implements
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
READ_CHUNK = 256 * 1024
SANDBOX_ID_FILE = "/run/e2b/.E2B_SANDBOX_ID"
# Linux's per-boot id. The driver mounts a small tmpfs here (gVisor's /proc has no such file): it
# lives in the sandbox's memory, so a checkpoint keeps it and only a fresh boot writes a new one.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
HALT_WAIT = 5.0  # how long a pause without memory waits for the killed processes to exit
# File operations run here, never on the event loop (a slow disk or a huge tree delays only them),
# in a pool of their own: the freeze's sync and the checkpoint check never queue behind them.
FILE_IO = ThreadPoolExecutor(max_workers=4, thread_name_prefix="files")

T = TypeVar("T")
Handler = Callable[["Agent", Stream], Awaitable[Any]]
HANDLERS: dict[str, Handler] = {}
STREAMING: set[str] = set()


def handler(name: str, *, streaming: bool = False) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        HANDLERS[name] = fn
        if streaming:
            STREAMING.add(name)
        return fn

    return register


class Agent:
    def __init__(self) -> None:
        # Even stream ids: the host numbers the streams it opens odd, these are the agent's own.
        self.channel = Channel(on_open=self._serve, on_ctrl=self._on_ctrl, first_stream_id=2)
        self.egress = EgressProxy(self.channel)
        self.sudo = SudoServer(self)
        self.procs = ProcessTable()
        self.env: dict[str, str] = {}
        self.default_user = "user"
        self.workdir: str | None = None
        self.watchers: dict[str, tuple[Watcher, list[dict[str, Any]]]] = {}
        self.stream_watchers: dict[int, Watcher] = {}
        self._watch_ids = itertools.count(1)
        self.last_request = time.monotonic()
        self.heap_release = HeapRelease(lambda: self.last_request)
        # A warm pool member (aenv/node/warmpool.py) keeps the heap its restore left in the sentry
        # until a create claims it: given back, the claimer's first command pays to grow it again.
        self.hold_heap = False

    # -- plumbing ---------------------------------------------------------------------------
    async def _serve(self, stream: Stream) -> None:
        fn = HANDLERS.get(stream.method)
        self.last_request = time.monotonic()
        try:
            if fn is None:
                await stream.end(error=("unimplemented", f"unknown method {stream.method!r}"))
                return
            result = await fn(self, stream)
            if stream.method not in STREAMING:
                await stream.end(result=result if result is not None else {})
        except (ProcessError, files.FileError) as exc:
            await stream.end(error=(exc.code, exc.message))
        except UnknownUser as exc:
            await stream.end(error=("unauthenticated", str(exc)))
        except RecursionError:  # a walk of a tree nested deeper than the stdlib's recursion allows
            await stream.end(error=("out_of_range", f"{stream.method}: the directory tree is nested too deeply"))
        except ChannelClosed:
            pass
        except Exception as exc:  # the agent must outlive any one request
            await stream.end(error=("internal", f"{type(exc).__name__}: {exc}"))

    async def _on_ctrl(self, msg: dict[str, Any]) -> None:
        op = msg.get("op")
        if op == "freeze":
            await self.heap_release.halt()
            if msg.get("halt"):
                # A pause that keeps no memory: the instance is stopped, not saved, so every process
                # ends before the sync and nothing writes the file system after it.
                from aenv.guest import runaway

                await asyncio.get_running_loop().run_in_executor(None, runaway.end_every_process, HALT_WAIT)
                self.procs.reap()
            # Write the sentry's cached file data through to the host first: the checkpoint's
            # upper (sealed into a layer on snapshot and fork) must hold what processes wrote,
            # and the metadata store, for an agent that boots on this file system again.
            await asyncio.get_running_loop().run_in_executor(None, _save_then_sync)
            await self.channel.ctrl({"op": "frozen"}, force=True)
            self.channel.hold()
        elif op == "thaw":
            if msg.get("fresh"):
                # A new instance restored from a checkpoint: the host that held the old streams is
                # not on this pipe. Processes keep running; their old subscribers are gone.
                self.procs.forget_subscribers()
                for watcher in self.stream_watchers.values():
                    watcher.close()
                self.stream_watchers.clear()
                self.channel.drop_streams()
                await self.channel.release(replay=False)
            else:
                await self.channel.release(replay=True)
            if "config" in msg:
                self.configure(msg["config"])
            metadata.forget_devices()
            FILE_IO.submit(metadata.STORE.rebind)  # a restore numbered the inodes anew
            await self.channel.ctrl({"op": "thawed", "pid": os.getpid()})
            if not self.hold_heap:
                self.heap_release.schedule()
        elif op == "ping":
            await self.channel.ctrl({"op": "pong", "t": msg.get("t")})

    def configure(self, config: dict[str, Any]) -> None:
        if "env" in config:
            self.env = {str(k): str(v) for k, v in config["env"].items()}
        self.default_user = config.get("user", self.default_user)
        if config.get("nproc"):
            # Raising a command's limit above the agent's own is refused (EPERM); an agent that was
            # checkpointed with a lower one (by an older node) gives its commands what it has.
            own = resource.getrlimit(resource.RLIMIT_NPROC)[1]
            wanted = int(config["nproc"])
            self.procs.nproc = wanted if own == resource.RLIM_INFINITY else min(wanted, own)
        self.workdir = config.get("workdir", self.workdir)
        held, self.hold_heap = self.hold_heap, bool(config.get("hold_heap"))
        if held and not self.hold_heap:  # claimed: give it back once the new sandbox is quiet
            self.heap_release.schedule()
        sandbox_id = self.env.get("E2B_SANDBOX_ID")
        if sandbox_id:
            try:
                _write_sandbox_id(sandbox_id)
            except OSError:
                pass

    def user_of(self, params: dict[str, Any]) -> User:
        """The user a request names, else the sandbox's default; refused in envd's words."""
        name = params.get("user")
        try:
            return lookup(name or self.default_user)
        except UnknownUser:
            refusal = f"invalid username: '{name}'" if name else f"invalid default user: '{self.default_user}'"
            raise UnknownUser(refusal) from None

    def process_env(self, user: User, extra: dict[str, str] | None) -> dict[str, str]:
        env = {"PATH": DEFAULT_PATH, "HOME": user.home, "USER": user.name, "LOGNAME": user.name, "SHELL": user.shell}
        env.update(PROXY_ENV)
        env.update(self.env)
        env.update(extra or {})
        return env

    async def run(self) -> None:
        # The channel owns fds 0 and 1; children never inherit them. Stderr is a file on the host
        # (runsc's log): held here, root in the sandbox could fill the host's disk through
        # /proc/1/fd/2, so from now on the agent's own errors travel in its answers only.
        rfd, wfd = os.dup(0), os.dup(1)
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        os.set_inheritable(rfd, False)
        os.set_inheritable(wfd, False)
        reader, writer = stdio_streams(rfd, wfd)
        self.channel.attach(reader, writer)  # type: ignore[arg-type]
        asyncio.get_running_loop().add_signal_handler(signal.SIGCHLD, self.procs.reap)
        self.egress.start(asyncio.get_running_loop())
        self.sudo.start(asyncio.get_running_loop())
        XattrServer().start()
        _write_boot_id()
        await off_loop(metadata.STORE.load)  # what an agent before this one kept, on this file system
        await self.channel.ctrl({"op": "ready", "version": AGENT_VERSION, "pid": os.getpid()})
        await self.channel.closed.wait()


def _save_then_sync() -> None:
    metadata.STORE.save()
    os.sync()


def _write_boot_id() -> None:
    """A new random boot id, read-only as Linux's (the tmpfs is the sandbox's memory: root there
    could change it, as it could its own kernel's, and it affects nothing outside)."""
    try:
        fd = os.open(BOOT_ID_FILE, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o444)
    except OSError:
        return  # an instance started without the mount (a driver that has none)
    try:
        os.write(fd, f"{_random_uuid()}\n".encode())
    finally:
        os.close(fd)


def _random_uuid() -> str:
    """A version 4 UUID in Linux's form, without importing uuid into every sandbox's memory."""
    raw = bytearray(os.urandom(16))
    raw[6] = raw[6] & 0x0F | 0x40
    raw[8] = raw[8] & 0x3F | 0x80
    h = raw.hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def _write_sandbox_id(sandbox_id: str) -> None:
    os.makedirs(os.path.dirname(SANDBOX_ID_FILE), exist_ok=True)
    safeio.replace_file(SANDBOX_ID_FILE, sandbox_id.encode(), 0o644)


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    return await asyncio.get_running_loop().run_in_executor(FILE_IO, fn, *args)


def stdio_streams(rfd: int, wfd: int) -> tuple[asyncio.StreamReader, BlockingWriter]:
    """Blocking reads (on a thread) and writes instead of epoll.

    The channel's pipes are host file descriptors that runsc re-attaches at restore. Blocking
    reads and writes on them keep working after a restore; readiness notifications (epoll) on them
    do not with the runsc these machines have, so the event loop never polls these fds.
    """
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20, loop=loop)

    def pump() -> None:
        while True:
            try:
                data = os.read(rfd, 256 * 1024)
            except OSError:
                data = b""
            if not data:
                loop.call_soon_threadsafe(reader.feed_eof)
                return
            loop.call_soon_threadsafe(reader.feed_data, data)

    threading.Thread(target=pump, name="channel-reader", daemon=True).start()
    return reader, BlockingWriter(wfd)


class BlockingWriter:
    """The slice of asyncio.StreamWriter that the channel uses, as plain blocking writes.

    Writing straight from the event loop saves a thread hand-off per frame (~1 ms under gVisor).
    The host reads its end continuously, so a write blocks only as long as the host takes to
    drain the pipe: that is the channel's backpressure."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._closing = False

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view) :]

    async def drain(self) -> None:
        return None

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True


# -- process.Process ----------------------------------------------------------------------------
def _selector(params: dict[str, Any]) -> dict[str, Any]:
    return params.get("process") or {}


@handler("process.start", streaming=True)
async def process_start(agent: Agent, stream: Stream) -> None:
    p = stream.params
    spec = p.get("process") or {}
    cmd = spec.get("cmd")
    if not cmd:
        raise ProcessError("invalid_argument", "process.cmd is required")
    user = agent.user_of(p)
    argv = [cmd, *spec.get("args", [])]
    env = agent.process_env(user, spec.get("envs"))
    cwd = files.resolve(spec.get("cwd") or "", user, agent.workdir if not spec.get("cwd") else None)
    pty_size = None
    if p.get("pty"):
        size = p["pty"].get("size") or {}
        pty_size = (int(size.get("cols", 80)), int(size.get("rows", 24)))
        env.setdefault("TERM", "xterm-256color")
    want_stdin = p.get("stdin", True) is not False if pty_size is None else True
    config = {"cmd": cmd, "args": spec.get("args", []), "envs": spec.get("envs") or {}}
    if spec.get("cwd"):
        config["cwd"] = spec["cwd"]
    proc = await agent.procs.start(
        argv=argv,
        env=env,
        cwd=cwd,
        user=user,
        config=config,
        tag=p.get("tag"),
        want_stdin=want_stdin,
        pty_size=pty_size,
        timeout_ms=p.get("timeoutMs"),
    )
    await _follow(proc, stream)


async def _follow(proc: processes.Process, stream: Stream) -> None:
    """Send start, then live events, until the process ends or the host cancels."""
    await stream.send({"event": {"start": {"pid": proc.pid}}})
    if proc.end is not None:
        await stream.send({"event": {"end": proc.end}})
        await stream.end(result={})
        return
    proc.subscribers.add(stream)
    cancel = asyncio.ensure_future(_until_cancelled(stream))
    done = asyncio.ensure_future(proc.done.wait())
    try:
        await asyncio.wait({cancel, done}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        proc.subscribers.discard(stream)
        cancel.cancel()
        done.cancel()
    if proc.done.is_set():
        if proc.deadline_hit:
            await stream.end(error=("deadline_exceeded", "the command exceeded its timeout and was killed"))
        else:
            await stream.end(result={})


async def _until_cancelled(stream: Stream) -> None:
    while (await stream.recv()).kind != END:
        pass


@handler("process.connect", streaming=True)
async def process_connect(agent: Agent, stream: Stream) -> None:
    await _follow(agent.procs.find(_selector(stream.params)), stream)


@handler("process.list")
async def process_list(agent: Agent, stream: Stream) -> Any:
    return {"processes": [p.info() for p in agent.procs.running()]}


@handler("process.input")
async def process_input(agent: Agent, stream: Stream) -> Any:
    proc = agent.procs.find(_selector(stream.params))
    data = stream.params.get("input") or {}
    raw = data.get("stdin") or data.get("pty") or ""
    await proc.write_input(base64.b64decode(raw))
    return {}


@handler("process.close_stdin")
async def process_close_stdin(agent: Agent, stream: Stream) -> Any:
    agent.procs.find(_selector(stream.params)).close_stdin()
    return {}


@handler("process.signal")
async def process_signal(agent: Agent, stream: Stream) -> Any:
    proc = agent.procs.find(_selector(stream.params))
    if proc.end is not None:
        raise ProcessError("not_found", f"process {proc.pid} has already exited")
    sig = SIGNALS.get(stream.params.get("signal", "SIGNAL_SIGKILL"))
    if sig is None:
        raise ProcessError("invalid_argument", f"unknown signal {stream.params.get('signal')!r}")
    processes.signal_process(proc, sig)
    return {}


@handler("process.update")
async def process_update(agent: Agent, stream: Stream) -> Any:
    proc = agent.procs.find(_selector(stream.params))
    size = (stream.params.get("pty") or {}).get("size")
    if size:
        proc.resize(int(size.get("cols", 80)), int(size.get("rows", 24)))
    return {}


# -- filesystem.Filesystem ------------------------------------------------------------------------
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
    cancel = asyncio.ensure_future(_until_cancelled(stream))
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


# -- tunnels and system --------------------------------------------------------------------------
@handler("tunnel.open", streaming=True)
async def tunnel_open(agent: Agent, stream: Stream) -> None:
    port = int(stream.params.get("port", 0))
    conn = await on_own_thread(_connect_loopback, port, name="tunnel-connect")
    if conn is None:
        await stream.end(error=("unavailable", f"port {port} is not open"))
        return
    conn.settimeout(None)
    await stream.send({"ok": True})
    await relay_in_thread(conn, stream)
    await stream.end(result={})


def _connect_loopback(port: int) -> socket.socket | None:
    """Off the event loop: a listener whose backlog is full lets a connect wait its whole timeout."""
    for host in ("127.0.0.1", "::1"):
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError:
            continue
    return None


@handler("sys.checkpointable")
async def sys_checkpointable(agent: Agent, stream: Stream) -> dict[str, Any]:
    blockers = await asyncio.get_running_loop().run_in_executor(None, checkpoint_blockers)
    return {"ok": not blockers, "blockers": blockers}


@handler("sys.contain")
async def sys_contain(agent: Agent, stream: Stream) -> dict[str, Any]:
    """The host sees this sandbox near its host task limit: stop the users that hold theirs."""
    if not agent.procs.nproc:
        return {"killed": {}}
    from aenv.guest import runaway  # only ever needed under a fork bomb

    killed = await asyncio.get_running_loop().run_in_executor(None, runaway.contain, agent.procs.nproc)
    return {"killed": killed}


@handler("sys.configure")
async def sys_configure(agent: Agent, stream: Stream) -> Any:
    agent.configure(stream.params)
    return {}


@handler("sys.health")
async def sys_health(agent: Agent, stream: Stream) -> Any:
    return {"version": AGENT_VERSION, "processes": len(agent.procs.running())}


@handler("sys.alone")
async def sys_alone(agent: Agent, stream: Stream) -> Any:
    """Whether the agent is the only process left: the host may then doze the sandbox (stop it
    whole while idle) without anyone in it noticing."""
    return {"alone": not await off_loop(processes.others_alive)}


@handler("sys.envs")
async def sys_envs(agent: Agent, stream: Stream) -> Any:
    return dict(agent.env)


@handler("sys.metrics")
async def sys_metrics(agent: Agent, stream: Stream) -> Any:
    mem: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                mem[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    fs = os.statvfs("/")
    total, free = mem.get("MemTotal", 0), mem.get("MemAvailable", mem.get("MemFree", 0))
    return {
        "ts": int(time.time()),
        "cpu_count": os.cpu_count() or 1,
        "cpu_used_pct": _cpu_pct(),
        "mem_total": total,
        "mem_used": max(total - free, 0),
        "mem_cache": mem.get("Cached", 0),
        "disk_used": (fs.f_blocks - fs.f_bfree) * fs.f_frsize,
        "disk_total": fs.f_blocks * fs.f_frsize,
    }


def _cpu_pct() -> float:
    try:
        load = os.getloadavg()[0]
        return round(min(100.0, 100.0 * load / (os.cpu_count() or 1)), 2)
    except OSError:
        return 0.0


def main() -> None:
    os.environ.pop("PYTHONHOME", None)  # children get a clean environment built by the agent
    asyncio.run(Agent().run())


if __name__ == "__main__":
    sys.exit(main())
