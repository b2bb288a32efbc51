"""The host's end of one sandbox's channel: control handshakes (ready, freeze, thaw) and calls."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from aenv.channel import (
    END,
    MAX_GUEST_STREAMS,
    Channel,
    ChannelClosed,
    OpenHandler,
    Stream,
    StreamError,
    Unsendable,
    end_error,
)
from aenv.errors import AgentTimeout, AgentUnavailable, InvalidRequest
from aenv.runtime.base import Instance

READY_TIMEOUT = 30.0
FREEZE_TIMEOUT = 10.0
CALL_TIMEOUT = 30.0
# What taking one sandbox's frames in may use of the node's event loop: a sandbox whose root floods
# frames that are dear to check (JSON) or many (credits) slows itself, not the node.
CPU_SHARE = 0.2

T = TypeVar("T")


class AgentLink:
    """Every wait on the agent has a deadline: whatever runs in the sandbox (its root can stop the
    agent), a call fails with AgentTimeout instead of hanging its caller."""

    def __init__(
        self,
        sandbox_id: str,
        serve: OpenHandler | None = None,
        *,
        call_timeout: float = CALL_TIMEOUT,
        wake: Callable[[Instance], None] | None = None,
        ready_timeout: float | None = None,
    ) -> None:
        self.sandbox_id = sandbox_id
        self._ready_timeout = ready_timeout  # the driver's boot_timeout; None: READY_TIMEOUT
        # ``serve`` answers streams the agent opens (egress); the host's own streams are odd-numbered.
        self.channel = Channel(
            on_ctrl=self._on_ctrl, on_open=serve, max_peer_streams=MAX_GUEST_STREAMS, cpu_share=CPU_SHARE
        )
        self.call_timeout = call_timeout
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._ping: asyncio.Future[None] | None = None
        self.agent_version = ""
        self.watcher: asyncio.Future[None] | None = None
        self._wake = wake  # the driver's: a dozing instance is thawed before anything is written to it

    @property
    def ready_timeout(self) -> float:
        return self._ready_timeout or READY_TIMEOUT

    async def _on_ctrl(self, msg: dict[str, Any]) -> None:
        fut = self._waiters.pop(str(msg.get("op")), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    def _expect(self, op: str) -> asyncio.Future[dict[str, Any]]:
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiters[op] = fut
        return fut

    async def _await(self, fut: asyncio.Future[dict[str, Any]], what: str, timeout: float) -> dict[str, Any]:
        closed = asyncio.ensure_future(self.channel.closed.wait())
        waiting: set[asyncio.Future[Any]] = {fut, closed}
        try:
            done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if fut in done:
            return fut.result()
        if not done:
            raise self._timeout(what, timeout)
        raise AgentUnavailable(f"the sandbox's agent went away during {what}", sandbox_id=self.sandbox_id)

    def attach(self, instance: Instance) -> None:
        self.channel.on_write = functools.partial(self._wake, instance) if self._wake is not None else None
        self.channel.attach(instance.reader, instance.writer)

    @property
    def idle(self) -> bool:
        """Nothing in flight: no stream open either way, no control exchange awaiting an answer."""
        return self.channel.open_streams == 0 and not self._waiters and (self._ping is None or self._ping.done())

    def _timeout(self, what: str, timeout: float) -> AgentTimeout:
        return AgentTimeout(
            f"the sandbox's agent did not answer {what} within {timeout:g}s", sandbox_id=self.sandbox_id
        )

    async def within(self, step: Awaitable[T], what: str, timeout: float | None = None) -> T:
        """One step of an exchange with the agent (a write, which waits while the pipe is full; an
        answer; a message; credit for data), within ``timeout`` (default: ``call_timeout``)."""
        limit = self.call_timeout if timeout is None else timeout
        deadline = asyncio.timeout(limit)
        try:
            async with deadline:
                return await step
        except TimeoutError:
            if not deadline.expired():
                raise
            raise self._timeout(what, limit) from None

    async def booted(self, instance: Instance) -> None:
        """Attach to a freshly booted instance and wait for the agent's hello."""
        fut = self._expect("ready")
        self.attach(instance)
        msg = await self._await(fut, "its first hello", self.ready_timeout)
        self.agent_version = str(msg.get("version", ""))[:64]

    async def restored(self, instance: Instance, *, fresh: bool, config: dict[str, Any] | None) -> None:
        """Attach to a restored instance and let its agent go on.

        ``fresh`` means the host holds none of this agent's streams (a new sandbox from a
        template, snapshot or fork, or a resume); otherwise the held streams continue.
        """
        if fresh:
            self.channel.drop_streams()
        self.attach(instance)
        msg: dict[str, Any] = {"op": "thaw", "fresh": fresh}
        if config is not None:
            msg["config"] = config
        await self._thaw(msg, replay=not fresh)

    async def _thaw(self, msg: dict[str, Any], *, replay: bool) -> None:
        fut = self._expect("thawed")
        try:
            await self.within(self.channel.release(replay=replay), "thaw", self.ready_timeout)
            await self.within(self.channel.ctrl(msg, force=True), "thaw", self.ready_timeout)
        except ChannelClosed as exc:
            raise AgentUnavailable(f"the sandbox's agent is gone: {exc}", sandbox_id=self.sandbox_id) from exc
        except Unsendable as exc:
            raise InvalidRequest(f"the sandbox's settings: {exc.message}", sandbox_id=self.sandbox_id) from exc
        await self._await(fut, "thaw", self.ready_timeout)

    @property
    def freeze_timeout(self) -> float:
        """A freeze is a call: it has at most the agent's deadline (AENV_AGENT_TIMEOUT)."""
        return min(FREEZE_TIMEOUT, self.call_timeout)

    async def freeze(self, *, halt: bool = False) -> None:
        """Bring both pipe directions to a frame boundary before a checkpoint. With ``halt`` the
        agent first ends every other process (the instance will be stopped, not saved)."""
        fut = self._expect("frozen")
        try:
            await self.within(self.channel.ctrl({"op": "freeze", "halt": halt}), "freeze", self.freeze_timeout)
        except ChannelClosed as exc:
            raise AgentUnavailable(f"cannot freeze the sandbox's agent: {exc}", sandbox_id=self.sandbox_id) from exc
        self.channel.hold()
        try:
            await self._await(fut, "freeze", self.freeze_timeout)
        except BaseException:
            # Never leave the sandbox half-frozen: release our writes and tell the agent to go on
            # (as far as a wedged agent lets us: these writes have a deadline too).
            self._waiters.pop("frozen", None)
            try:
                await self.within(self.channel.release(replay=True), "thaw", self.freeze_timeout)
                await self.within(self.channel.ctrl({"op": "thaw", "fresh": False}), "thaw", self.freeze_timeout)
            except (ChannelClosed, AgentTimeout):
                pass
            raise
        # The agent now writes nothing until thaw. Stop reading, so the pipe closing under a
        # checkpoint is not mistaken for the sandbox dying and does not fail our streams.
        self.channel.suspend_reading()

    async def unfreeze(self) -> None:
        """Undo :meth:`freeze` on the same pipe (the checkpoint failed or left the sandbox running)."""
        self.channel.resume_reading()
        await self._thaw({"op": "thaw", "fresh": False}, replay=True)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        """A unary call: its result, StreamError for the agent's refusal, AgentTimeout if no answer."""
        stream = await self.open(method, params)
        try:
            return await self.within(stream.result(), method)
        except StreamError as exc:
            if exc.code == "unavailable":  # the channel failed the stream: the sandbox went away
                raise AgentUnavailable(exc.message, sandbox_id=self.sandbox_id) from exc
            raise
        finally:
            if not stream.remote_ended:
                stream.cancel()  # the agent may stop working on it

    async def start_detached(self, argv: list[str], env: dict[str, str], cwd: str, user: str) -> str:
        """Start a process that runs on by itself (a template's start command, tagged "start");
        why it did not start, or "" once it runs."""
        process = {"cmd": argv[0], "args": argv[1:], "envs": env, "cwd": cwd}
        stream = await self.open("process.start", {"process": process, "user": user, "tag": "start"})
        first = await self.within(stream.recv(), "process.start")
        if first.kind == END:
            error = end_error(first.msg)
            return error.message if error else "it did not start"
        stream.cancel()  # the process runs on; nobody follows its output
        return ""

    async def ping(self) -> None:
        """Return once the agent shows it is alive; AgentTimeout if it does not within the deadline.
        Concurrent callers share one ping."""
        if self._ping is None or self._ping.done():
            self._ping = asyncio.ensure_future(self._ping_once())
        await asyncio.shield(self._ping)

    async def _ping_once(self) -> None:
        fut = self._expect("pong")
        try:
            await self.within(self.channel.ctrl({"op": "ping"}), "a ping")
        except ChannelClosed as exc:
            raise AgentUnavailable(str(exc), sandbox_id=self.sandbox_id) from exc
        await self._await(fut, "a ping", self.call_timeout)

    async def open(self, method: str, params: dict[str, Any] | None = None) -> Stream:
        try:
            return await self.within(self.channel.open(method, params or {}), method)
        except ChannelClosed as exc:
            raise AgentUnavailable(str(exc), sandbox_id=self.sandbox_id) from exc

    def close(self, reason: str) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        self.channel.close(reason)
