"""Processes inside the sandbox: start (pipes or PTY), stream output, stdin, signals, reconnect.

Messages follow E2B envd's process.Process shapes so the host can forward them verbatim:
``{"event": {"start"|"data"|"end"|"keepalive": ...}}``.
"""

from __future__ import annotations

import asyncio
import base64
import errno
import fcntl
import os
import pty
import signal
import struct
import sys
import termios
import time
from typing import Any

from aenv.channel import ChannelClosed, Stream
from aenv.guest.users import User

CHUNK = 32 * 1024
EXITED_KEEP_SECONDS = 30.0


def others_alive() -> bool:
    """Whether a process other than the agent (PID 1, the caller) has not exited yet: a zombie
    has, its files are closed; whatever else is there may still do something."""
    own = str(os.getpid())
    for name in os.listdir("/proc"):
        if not name.isdigit() or name == own:
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != b"Z":
            return True
    return False


# Go's syscall.Signal names, which upstream envd reports in "status" and "error".
SIGNAL_TEXT = {
    signal.SIGKILL: "killed",
    signal.SIGTERM: "terminated",
    signal.SIGINT: "interrupt",
    signal.SIGHUP: "hangup",
    signal.SIGPIPE: "broken pipe",
    signal.SIGSEGV: "segmentation fault",
    signal.SIGABRT: "aborted",
    signal.SIGQUIT: "quit",
    signal.SIGALRM: "alarm clock",
    signal.SIGUSR1: "user defined signal 1",
    signal.SIGUSR2: "user defined signal 2",
}

SIGNALS = {
    "SIGNAL_SIGKILL": signal.SIGKILL,
    "SIGNAL_SIGTERM": signal.SIGTERM,
    "SIGNAL_SIGINT": signal.SIGINT,
    "SIGNAL_SIGHUP": signal.SIGHUP,
    "SIGNAL_SIGQUIT": signal.SIGQUIT,
    "SIGNAL_SIGUSR1": signal.SIGUSR1,
    "SIGNAL_SIGUSR2": signal.SIGUSR2,
    "SIGNAL_SIGSTOP": signal.SIGSTOP,
    "SIGNAL_SIGCONT": signal.SIGCONT,
    9: signal.SIGKILL,
    15: signal.SIGTERM,
}


class ProcessError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def end_event(returncode: int) -> dict[str, Any]:
    if returncode >= 0:
        status = f"exit status {returncode}"
        end: dict[str, Any] = {"exitCode": returncode, "exited": True, "status": status}
        if returncode:
            end["error"] = status
        return end
    sig = -returncode
    try:
        text = SIGNAL_TEXT.get(signal.Signals(sig), f"signal {sig}")
    except ValueError:
        text = f"signal {sig}"
    status = f"signal: {text}"
    return {"exitCode": -1, "exited": False, "status": status, "error": status}


class Process:
    """One started process and the streams subscribed to its output."""

    def __init__(self, pid: int, config: dict[str, Any], tag: str | None) -> None:
        self.pid = pid
        self.config = config
        self.tag = tag
        self.subscribers: set[Stream] = set()
        self.end: dict[str, Any] | None = None
        self.exited_at = 0.0
        self.done = asyncio.Event()
        self.deadline_hit = False
        self.stdin: asyncio.StreamWriter | None = None
        self.master_fd: int | None = None
        self.exited: asyncio.Future[int] | None = None

    def info(self) -> dict[str, Any]:
        out: dict[str, Any] = {"config": self.config, "pid": self.pid}
        if self.tag is not None:
            out["tag"] = self.tag
        return out

    async def publish(self, event: dict[str, Any]) -> None:
        for sub in list(self.subscribers):
            try:
                await sub.send({"event": event})
            except ChannelClosed:
                self.subscribers.discard(sub)

    async def write_input(self, data: bytes) -> None:
        if self.master_fd is not None:
            await asyncio.get_running_loop().run_in_executor(None, os.write, self.master_fd, data)
        elif self.stdin is not None and not self.stdin.is_closing():
            self.stdin.write(data)
            await self.stdin.drain()
        else:
            raise ProcessError("failed_precondition", f"stdin of process {self.pid} is closed")

    def close_stdin(self) -> None:
        if self.master_fd is not None:
            raise ProcessError("failed_precondition", "cannot close stdin of a PTY process")
        if self.stdin is not None:
            self.stdin.close()
            self.stdin = None

    def resize(self, cols: int, rows: int) -> None:
        if self.master_fd is None:
            raise ProcessError("failed_precondition", f"process {self.pid} has no PTY")
        fcntl.ioctl(self.master_fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))


class _Spawner:
    """``aenv_spawn`` from the bundle's libaenv_spawn.so (see aenv/runtime/compat/aenv_spawn.c)."""

    SETSID, SETCTTY, SETUSER, CHDIR_FIRST = 1, 2, 4, 8
    # What failed before the command's exec, by aenv_spawn's STEP_* (0: the clone itself).
    STEPS = {0: "clone", 1: "set up stdio", 2: "start a session", 3: "set limits", 4: "switch user", 5: "chdir"}

    def __init__(self) -> None:
        self._fn: Any = None

    def _load(self) -> Any:
        import ctypes  # only here: the agent needs it for nothing else at start

        lib = ctypes.CDLL(os.path.join(os.path.dirname(sys.executable), "..", "compat", "libaenv_spawn.so"))
        fn = lib.aenv_spawn
        strings, ints = ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_int)
        fn.argtypes = [
            ctypes.c_char_p,
            strings,
            strings,
            ints,
            ctypes.c_uint32,
            ctypes.c_uint32,
            ctypes.POINTER(ctypes.c_uint32),
            ctypes.c_int,
            ctypes.c_long,
            ctypes.c_int,
            ctypes.c_char_p,
            ctypes.c_uint64,
            ctypes.POINTER(ctypes.c_int),
        ]
        fn.restype = ctypes.c_int
        self._ctypes = ctypes
        self._fn = fn
        return fn

    def __call__(
        self,
        argv: list[str],
        env: dict[str, str],
        fds: tuple[int, int, int],
        user: User,
        nproc: int,
        flags: int,
        cwd: str,
    ) -> int:
        fn = self._fn or self._load()
        ct = self._ctypes

        def strings(items: list[bytes]) -> Any:
            return (ct.c_char_p * (len(items) + 1))(*items, None)

        if user.uid != os.getuid() or user.gid != os.getgid():
            flags |= self.SETUSER
        groups = (ct.c_uint32 * max(1, len(user.groups)))(*user.groups)
        step = ct.c_int(0)
        pid = fn(
            os.fsencode(argv[0]),
            strings([os.fsencode(a) for a in argv]),
            strings([os.fsencode(f"{k}={v}") for k, v in env.items()]),
            (ct.c_int * 3)(*fds),
            user.uid,
            user.gid,
            groups,
            len(user.groups),
            nproc,
            flags,
            os.fsencode(cwd),
            _non_default_signals(),
            ct.byref(step),
        )
        if pid < 0:  # the command never ran: envd's exec fails a chdir the user cannot make the same way
            what = self.STEPS.get(step.value, "start")
            if what == "chdir":
                what = f"chdir '{cwd}'"
            raise OSError(-pid, f"{what}: {os.strerror(-pid)}")
        return int(pid)


spawn = _Spawner()

# As envd: a start that failed for want of resources may be retried (resource_exhausted); any other
# reason (a cwd the user cannot enter, ...) is the request's (invalid_argument).
_EXHAUSTED = {errno.EAGAIN, errno.ENOMEM, errno.EMFILE, errno.ENFILE, errno.ENOSPC}


def _start_error_code(err: int | None) -> str:
    return "resource_exhausted" if err in _EXHAUSTED else "invalid_argument"


def _non_default_signals() -> int:
    """A bit per signal the agent handles or ignores: what a child must set back to the default."""
    mask = 0
    for sig in signal.valid_signals():
        # None: a handler not installed from Python, e.g. by a C library; it goes too.
        if sig not in (signal.SIGKILL, signal.SIGSTOP) and signal.getsignal(sig) != signal.SIG_DFL:
            mask |= 1 << (sig - 1)
    return mask


def _which(cmd: str, path: str) -> str | None:
    """shutil.which, without importing shutil into the agent (see aenv/guest/__main__.py)."""
    for directory in path.split(os.pathsep) if path else []:
        candidate = os.path.join(directory or ".", cmd)
        if os.access(candidate, os.X_OK) and not os.path.isdir(candidate):
            return candidate
    return None


def _resolve(cmd: str, env: dict[str, str]) -> str:
    """Fail early, as upstream does, when the command cannot be run."""
    if "/" in cmd:
        path = cmd
    else:
        found = _which(cmd, env["PATH"] if "PATH" in env else os.environ.get("PATH", os.defpath))
        if found is None:
            raise ProcessError("invalid_argument", f"cannot start {cmd!r}: not found in PATH")
        path = found
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise ProcessError("invalid_argument", f"cannot start {cmd!r}: no such executable")
    return path


class ProcessTable:
    """Started processes. The agent is PID 1 of the sandbox, so it also reaps orphans."""

    def __init__(self) -> None:
        self.procs: dict[int, Process] = {}
        self._exits: dict[int, asyncio.Future[int]] = {}
        # RLIMIT_NPROC for started processes. Set per sandbox by the host: a restored agent keeps
        # the rlimits it had when its template was checkpointed, so the spec's cannot apply.
        self.nproc: int | None = None

    def reap(self) -> None:
        """On SIGCHLD: collect every exited child (ours and reparented orphans)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            fut = self._exits.pop(pid, None)
            if fut is not None and not fut.done():
                fut.set_result(os.waitstatus_to_exitcode(status))

    def _spawn(
        self, argv: list[str], env: dict[str, str], cwd: str, user: User, fds: tuple[int, int, int], flags: int
    ) -> tuple[int, asyncio.Future[int]]:
        """Start ``argv`` as ``user`` on ``fds`` (stdin, stdout, stderr)."""
        pid = spawn(argv, env, fds, user, self.nproc or 0, flags, cwd)
        exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._exits[pid] = exited
        self.reap()  # a child that already exited must not be missed
        return pid, exited

    def start_with_fds(
        self, argv: list[str], env: dict[str, str], cwd: str, user: User, fds: tuple[int, ...]
    ) -> tuple[int, asyncio.Future[int]]:
        """Start ``argv`` in a session of its own on descriptors that someone else owns (sudo's
        client's stdio), in ``cwd`` even where ``user`` could not enter it (as sudo's command
        inherits it); it is not a listed process. Returns its pid and a future of its exit."""
        stdin, stdout, stderr = fds
        return self._spawn(argv, env, cwd, user, (stdin, stdout, stderr), spawn.SETSID | spawn.CHDIR_FIRST)

    def find(self, selector: dict[str, Any]) -> Process:
        pid = selector.get("pid")
        tag = selector.get("tag")
        for proc in self.procs.values():
            if (pid is not None and proc.pid == int(pid)) or (tag is not None and proc.tag == tag):
                return proc
        what = f"pid {pid}" if pid is not None else f"tag '{tag}'"
        raise ProcessError("not_found", f"process with {what} not found")

    def running(self) -> list[Process]:
        return [p for p in self.procs.values() if p.end is None]

    def forget_subscribers(self) -> None:
        for proc in self.procs.values():
            proc.subscribers.clear()

    def reap_old(self) -> None:
        now = time.monotonic()
        for pid in [
            p.pid for p in self.procs.values() if p.end is not None and now - p.exited_at > EXITED_KEEP_SECONDS
        ]:
            del self.procs[pid]

    async def start(
        self,
        *,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        config: dict[str, Any],
        tag: str | None,
        want_stdin: bool,
        pty_size: tuple[int, int] | None,
        timeout_ms: int | None,
    ) -> Process:
        self.reap_old()
        # C strings: a NUL would cut an argument short, a '=' in a name would move it into the value.
        if any("\0" in a for a in argv) or any("\0" in k or "\0" in v for k, v in env.items()):
            raise ProcessError("invalid_argument", "arguments and environment variables cannot contain NUL bytes")
        for name in env:
            if not name or "=" in name:
                raise ProcessError("invalid_argument", f"invalid environment variable name {name!r}")
        if not os.path.isdir(cwd):
            raise ProcessError("invalid_argument", f"cwd '{cwd}' does not exist")
        argv = [_resolve(argv[0], env), *argv[1:]]
        loop = asyncio.get_running_loop()
        try:
            if pty_size is not None:
                proc = self._start_pty(argv, env, cwd, user, config, tag, pty_size)
            else:
                # O_NONBLOCK: sandbox root may have made /dev/null a FIFO, whose open would wait.
                child_in = os.open(os.devnull, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                os.set_blocking(child_in, True)  # the command gets an ordinary stdin
                stdin_w = None
                if want_stdin:
                    os.close(child_in)
                    child_in, stdin_w = os.pipe()
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                try:
                    pid, exited = self._spawn(argv, env, cwd, user, (child_in, out_w, err_w), spawn.SETSID)
                except BaseException:
                    for fd in (out_r, err_r, stdin_w):
                        if fd is not None:
                            os.close(fd)
                    raise
                finally:
                    for fd in (child_in, out_w, err_w):
                        os.close(fd)
                proc = Process(pid, config, tag)
                proc.exited = exited
                if stdin_w is not None:
                    transport, protocol = await loop.connect_write_pipe(
                        asyncio.streams.FlowControlMixin, os.fdopen(stdin_w, "wb", 0)
                    )
                    proc.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
                readers = [
                    self._pump(proc, await _reader(out_r), "stdout"),
                    self._pump(proc, await _reader(err_r), "stderr"),
                ]
                asyncio.ensure_future(self._wait(proc, readers))
        except OSError as exc:
            name = errno.errorcode.get(exc.errno or 0, "error")
            message = f"cannot start '{argv[0]}': {exc.strerror or exc} ({name})"
            raise ProcessError(_start_error_code(exc.errno), message) from exc
        self.procs[proc.pid] = proc
        if timeout_ms:
            loop.call_later(timeout_ms / 1000, self._deadline, proc)
        return proc

    def _start_pty(
        self,
        argv: list[str],
        env: dict[str, str],
        cwd: str,
        user: User,
        config: dict[str, Any],
        tag: str | None,
        size: tuple[int, int],
    ) -> Process:
        master, slave = pty.openpty()
        fcntl.ioctl(master, termios.TIOCSWINSZ, struct.pack("HHHH", size[1], size[0], 0, 0))
        os.set_inheritable(master, False)
        try:
            pid, exited = self._spawn(argv, env, cwd, user, (slave, slave, slave), spawn.SETSID | spawn.SETCTTY)
        finally:
            os.close(slave)
        os.set_blocking(master, False)
        proc = Process(pid, config, tag)
        proc.exited = exited
        proc.master_fd = master
        asyncio.ensure_future(self._wait(proc, [self._pump_pty(proc, master)]))
        return proc

    async def _pump(self, proc: Process, pipe: asyncio.StreamReader | None, name: str) -> None:
        assert pipe is not None
        while chunk := await pipe.read(CHUNK):
            await proc.publish({"data": {name: b64(chunk)}})

    async def _pump_pty(self, proc: Process, fd: int) -> None:
        loop = asyncio.get_running_loop()
        ready = asyncio.Event()
        loop.add_reader(fd, ready.set)
        try:
            while True:
                await ready.wait()
                ready.clear()
                try:
                    chunk = os.read(fd, 16 * 1024)
                except BlockingIOError:
                    continue
                except OSError:  # EIO: every slave end is closed
                    return
                if not chunk:
                    return
                await proc.publish({"data": {"pty": b64(chunk)}})
        finally:
            loop.remove_reader(fd)

    async def _wait(self, proc: Process, readers: list[Any]) -> None:
        pumps = asyncio.gather(*readers, return_exceptions=True)
        assert proc.exited is not None
        rc = await proc.exited
        if proc.master_fd is not None:
            # Children may keep the slave open; give the pump a moment, then stop reading.
            try:
                await asyncio.wait_for(asyncio.shield(pumps), 0.2)
            except TimeoutError:
                pumps.cancel()
            os.close(proc.master_fd)
            proc.master_fd = None
        else:
            await pumps
        proc.end = end_event(rc)
        proc.exited_at = time.monotonic()
        await proc.publish({"end": proc.end})
        proc.done.set()

    def _deadline(self, proc: Process) -> None:
        if proc.end is None:
            proc.deadline_hit = True
            signal_process(proc, signal.SIGKILL)


async def _reader(fd: int) -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=CHUNK, loop=loop)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0))
    return reader


def signal_process(proc: Process, sig: int) -> None:
    """Signal the process's whole session (``bash -c`` children die with it), else the process."""
    try:
        os.killpg(proc.pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(proc.pid, sig)
    except ProcessLookupError:
        pass
