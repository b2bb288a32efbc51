"""The host's end of one sandbox's channel: control handshakes (ready, freeze, thaw) and calls."""

from __future__ import annotations

import asyncio
from typing import Any

from aenv.channel import MAX_GUEST_STREAMS, Channel, ChannelClosed, OpenHandler, Stream, Unsendable
from aenv.errors import AgentUnavailable, InvalidRequest, OperationTimeout
from aenv.runtime.base import Instance

READY_TIMEOUT = 30.0
FREEZE_TIMEOUT = 10.0


class AgentLink:
    def __init__(self, sandbox_id: str, serve: OpenHandler | None = None) -> None:
        self.sandbox_id = sandbox_id
        # ``serve`` answers streams the agent opens (egress); the host's own streams are odd-numbered.
        self.channel = Channel(on_ctrl=self._on_ctrl, on_open=serve, max_peer_streams=MAX_GUEST_STREAMS)
        self._waiters: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.agent_version = ""
        self.watcher: asyncio.Future[None] | None = None

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
        try:
            done, _ = await asyncio.wait({fut, closed}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
        if fut in done:
            return fut.result()
        if not done:
            raise OperationTimeout(
                f"the sandbox's agent did not answer {what} within {timeout:.0f}s", sandbox_id=self.sandbox_id
            )
        raise AgentUnavailable(f"the sandbox's agent went away during {what}", sandbox_id=self.sandbox_id)

    def attach(self, instance: Instance) -> None:
        self.channel.attach(instance.reader, instance.writer)

    async def booted(self, instance: Instance) -> None:
        """Attach to a freshly booted instance and wait for the agent's hello."""
        fut = self._expect("ready")
        self.attach(instance)
        msg = await self._await(fut, "its first hello", READY_TIMEOUT)
        self.agent_version = str(msg.get("version", ""))[:64]

    async def restored(self, instance: Instance, *, fresh: bool, config: dict[str, Any] | None) -> None:
        """Attach to a restored instance and let its agent go on.

        ``fresh`` means the host holds none of this agent's streams (a new sandbox from a
        template, snapshot or fork, or a resume); otherwise the held streams continue.
        """
        if fresh:
            self.channel.drop_streams()
        fut = self._expect("thawed")
        self.attach(instance)
        msg: dict[str, Any] = {"op": "thaw", "fresh": fresh}
        if config is not None:
            msg["config"] = config
        try:
            await self.channel.release(replay=not fresh)
            await self.channel.ctrl(msg, force=True)
        except ChannelClosed as exc:
            raise AgentUnavailable(f"the restored agent is gone: {exc}", sandbox_id=self.sandbox_id) from exc
        except Unsendable as exc:
            raise InvalidRequest(f"the sandbox's settings: {exc.message}", sandbox_id=self.sandbox_id) from exc
        await self._await(fut, "thaw", READY_TIMEOUT)

    async def freeze(self) -> None:
        """Bring both pipe directions to a frame boundary before a checkpoint."""
        fut = self._expect("frozen")
        try:
            await self.channel.ctrl({"op": "freeze"})
        except ChannelClosed as exc:
            raise AgentUnavailable(f"cannot freeze the sandbox's agent: {exc}", sandbox_id=self.sandbox_id) from exc
        self.channel.hold()
        try:
            await self._await(fut, "freeze", FREEZE_TIMEOUT)
        except BaseException:
            # Never leave the sandbox half-frozen: release our writes and tell the agent to go on.
            self._waiters.pop("frozen", None)
            await self.channel.release(replay=True)
            try:
                await self.channel.ctrl({"op": "thaw", "fresh": False})
            except ChannelClosed:
                pass
            raise
        # The agent now writes nothing until thaw. Stop reading, so the pipe closing under a
        # checkpoint is not mistaken for the sandbox dying and does not fail our streams.
        self.channel.suspend_reading()

    async def unfreeze(self) -> None:
        """Undo :meth:`freeze` on the same pipe (the checkpoint failed or left the sandbox running)."""
        fut = self._expect("thawed")
        self.channel.resume_reading()
        try:
            await self.channel.release(replay=True)
            await self.channel.ctrl({"op": "thaw", "fresh": False}, force=True)
        except ChannelClosed as exc:
            raise AgentUnavailable(f"the sandbox's agent is gone: {exc}", sandbox_id=self.sandbox_id) from exc
        await self._await(fut, "thaw", READY_TIMEOUT)

    async def call(self, method: str, params: dict[str, Any] | None = None) -> Any:
        try:
            return await self.channel.call(method, params or {})
        except ChannelClosed as exc:
            raise AgentUnavailable(str(exc), sandbox_id=self.sandbox_id) from exc

    async def open(self, method: str, params: dict[str, Any] | None = None) -> Stream:
        try:
            return await self.channel.open(method, params or {})
        except ChannelClosed as exc:
            raise AgentUnavailable(str(exc), sandbox_id=self.sandbox_id) from exc

    def close(self, reason: str) -> None:
        if self.watcher is not None:
            self.watcher.cancel()
        self.channel.close(reason)
