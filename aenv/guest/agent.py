"""The in-sandbox agent: serves processes, files, watches and tunnels over the channel on stdio.

It runs as root inside the sandbox, from a read-only runtime bundle mounted at /.aenv, so the
image needs no Python of its own. Everything it does is on behalf of the host; it holds no policy.
This module is the plumbing (the pipe, freeze and thaw, configuration); the methods it serves are
in :mod:`aenv.guest.methods`.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import resource
import signal
import threading
import time
from typing import Any

from aenv.channel import Channel, ChannelClosed, Stream
from aenv.guest import files, metadata, safeio
from aenv.guest.egress import PROXY_ENV, EgressProxy
from aenv.guest.methods import FILE_IO, HANDLERS, STREAMING, filesystem, off_loop, process, system
from aenv.guest.methods.system import AGENT_VERSION
from aenv.guest.processes import ProcessError, ProcessTable
from aenv.guest.sentry import HeapRelease
from aenv.guest.sudo import SudoServer
from aenv.guest.users import UnknownUser, User, lookup
from aenv.guest.watch import Watcher
from aenv.guest.xattrs import XattrServer

__all__ = ["AGENT_VERSION", "Agent", "main"]

METHOD_GROUPS = (process, filesystem, system)  # importing them registered their handlers in HANDLERS

DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SANDBOX_ID_FILE = "/run/e2b/.E2B_SANDBOX_ID"
# network.rules: the node answers HTTPS for a rule's host with its egress CA's certificates, which
# commands trust through this bundle (the system's roots and that CA).
CA_BUNDLE_FILE = "/run/aenv/ca-bundle.pem"
SYSTEM_BUNDLES = ("/etc/ssl/certs/ca-certificates.crt", "/etc/pki/tls/certs/ca-bundle.crt", "/etc/ssl/cert.pem")
MAX_SYSTEM_BUNDLE = 4 * 1024 * 1024
# replace the default roots: set only when the bundle holds the system's roots as well
BUNDLE_ENV = ("SSL_CERT_FILE", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", "GIT_SSL_CAINFO")
# Linux's per-boot id. The driver mounts a small tmpfs here (gVisor's /proc has no such file): it
# lives in the sandbox's memory, so a checkpoint keeps it and only a fresh boot writes a new one.
BOOT_ID_FILE = "/proc/sys/kernel/random/boot_id"
HALT_WAIT = 5.0  # how long a pause without memory waits for the killed processes to exit


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
        self.trust_env: dict[str, str] = {}  # where commands find the egress CA (network.rules)

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
        if "env" in config:  # a whole configuration: a sandbox without rules trusts no egress CA
            self.trust_env = _trust_egress_ca(config.get("egress_ca"))
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
        env.update(self.trust_env)
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


def _trust_egress_ca(pem: Any) -> dict[str, str]:
    """Write the bundle commands trust (the system's roots, then the node's egress CA); the
    variables that point tools at it. Without a system bundle only NODE_EXTRA_CA_CERTS (which adds
    to Node's roots) is set: pointing Python or curl at the CA alone would break every other host."""
    if not isinstance(pem, str) or "BEGIN CERTIFICATE" not in pem:
        return {}
    system = b""
    for path in SYSTEM_BUNDLES:
        try:
            if os.path.isfile(path) and os.path.getsize(path) <= MAX_SYSTEM_BUNDLE:
                with open(path, "rb") as f:
                    system = f.read(MAX_SYSTEM_BUNDLE)
                break
        except OSError:
            continue
    try:
        os.makedirs(os.path.dirname(CA_BUNDLE_FILE), exist_ok=True)
        safeio.replace_file(CA_BUNDLE_FILE, system.rstrip(b"\n") + b"\n" + pem.encode(), 0o644)
    except OSError:
        return {}
    env = {"NODE_EXTRA_CA_CERTS": CA_BUNDLE_FILE}
    if system:
        env.update({name: CA_BUNDLE_FILE for name in BUNDLE_ENV})
    return env


def _write_sandbox_id(sandbox_id: str) -> None:
    os.makedirs(os.path.dirname(SANDBOX_ID_FILE), exist_ok=True)
    safeio.replace_file(SANDBOX_ID_FILE, sandbox_id.encode(), 0o644)


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


def main() -> None:
    os.environ.pop("PYTHONHOME", None)  # children get a clean environment built by the agent
    asyncio.run(Agent().run())


if __name__ == "__main__":
    main()
