"""Draining a node: it takes no new work, and each running sandbox is paused durably (committed
to the snapshot repository) and, when asked to move them, resumed on another node.

A drain is one task per node (a second request joins it; asking to move upgrades one that only
pauses). Its progress is a ``DrainProgress``: ``POST /cluster/drain`` on the node streams it as
NDJSON, one line per change and a last one with ``done`` (a gateway relays it as
``POST /nodes/{id}/drain``). A drain ends when nothing runs on the node any more and every pause
it made is durable (or known not to be: no repository, a commit that failed). It is not undone: a
drained node takes work again after a restart. A node stopped with SIGTERM in a cluster with a
repository drains itself (moving its sandboxes) within ``AENV_DRAIN_TIMEOUT`` before it stops.

A move is a resume through the target node's own API (``connect``): the target fetches the pause
from the repository and claims the directory entry with the epoch compare-and-swap, as it takes
over a lost node's sandbox; the draining node then lets its paused copy go (the repository
entry is the target's to remove). The sandbox keeps its id, metadata, env, network rules and
what was left of its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import TYPE_CHECKING, Any

import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from aenv.cluster.nodes import node_json
from aenv.cluster.placement import Placement
from aenv.errors import AenvError, InvalidRequest, Unauthenticated, error_body, error_headers, parse_json
from aenv.node.service import LiveSandbox, SandboxState

if TYPE_CHECKING:
    from aenv.cluster.agent import NodeAgent

log = logging.getLogger("aenv.cluster.drain")

DRAIN_PATH = "/cluster/drain"
UNDRAIN_PATH = "/cluster/undrain"
UNDRAIN_WAIT = 30.0  # seconds an undrain waits for the pauses in flight (new ones are not begun)
DRAIN_NOTICE = 0.5  # seconds between a drain's entry in etcd and its first pause (gateways see it first)
AT_ONCE = 2  # sandboxes paused (and moved) at a time: each pause writes a checkpoint, each move fetches it
MOVE_TARGETS = 3  # nodes a move tries
MOVE_TIMEOUT = 120.0  # seconds a target has to fetch and resume one sandbox
MAX_ERRORS = 20  # errors a progress report keeps (the newest)
BUSY = (SandboxState.RUNNING,)


@dataclass
class DrainProgress:
    node: str
    move: bool
    total: int = 0  # running sandboxes the drain took on
    paused: int = 0  # of which paused here
    durable: int = 0  # of which the pause is in the repository
    moved: int = 0  # of which resumed on another node
    failed: int = 0  # not paused, or the pause not durable, or not moved
    running: int = 0  # sandboxes still running on the node
    done: bool = False
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def line(self) -> bytes:
        return json.dumps(asdict(self)).encode() + b"\n"


class Drain:
    """One node's drain, run once; readers follow its progress."""

    def __init__(self, agent: NodeAgent, *, move: bool, api_key: str) -> None:
        self.agent = agent
        self.node = agent.node
        self.api_key = api_key
        self.progress = DrainProgress(agent.node_id, move)
        self._tick = asyncio.Event()  # set (and replaced) at each change of the progress
        self._seen: set[str] = set()  # sandboxes the drain took on (one resumed here meanwhile is taken again)
        self._unpaused: set[str] = set()  # sandboxes whose pause failed: not tried again (they run on)
        self._busy: set[str] = set()  # sandboxes being paused, committed or moved right now
        self.started = time.monotonic()
        self.stopped = False  # an undrain: no sandbox is taken on from then on
        self.task: asyncio.Task[None] = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        """Take on no more sandboxes and end once the pauses in flight are done (those paused stay
        durably paused here: a connect resumes them). The node takes work again after it."""
        self.stopped = True
        await asyncio.wait([self.task], timeout=UNDRAIN_WAIT)

    async def _run(self) -> None:
        try:
            await self.agent.set_draining()
            # Gateways learn of the drain through their watch of etcd, a few ms on: until then they
            # relay a streamed request (an E2B command) without keeping its body, and one that met a
            # move's pause here could not be sent again. The first pause waits for them.
            await asyncio.sleep(DRAIN_NOTICE)
            gate = asyncio.Semaphore(AT_ONCE)
            while not self.stopped:
                running = [
                    sb for sb in list(self.node.sandboxes.values()) if sb.state in BUSY and sb.id not in self._unpaused
                ]
                if not running:
                    if not self._in_transition():
                        break
                    await asyncio.sleep(0.2)  # a create or resume finishing: it is drained next
                    continue
                self._seen.update(sb.id for sb in running)
                self.progress.total = len(self._seen)
                await self._report()
                await asyncio.gather(*(self._one(sb, gate) for sb in running))
        except Exception as exc:  # the drain's own failure (etcd out of reach): said, not hidden
            log.exception("draining node %s failed", self.agent.node_id)
            self._error(f"the drain stopped: {exc!r}"[:300])
        finally:
            self.progress.done = True
            await self._report()

    def _in_transition(self) -> bool:
        quiet = (SandboxState.RUNNING, SandboxState.PAUSED, SandboxState.KILLED)
        return any(sb.state not in quiet for sb in list(self.node.sandboxes.values()))

    def moving(self, sandbox_id: str) -> bool:
        """Whether this drain moves ``sandbox_id`` and is not done with it: its pause is a move's,
        which its clients should see as a pause only (NodeAgent holds their traffic back)."""
        return self.progress.move and sandbox_id in self._busy

    async def _one(self, sb: LiveSandbox, gate: asyncio.Semaphore) -> None:
        self._busy.add(sb.id)  # from now: its traffic waits for the gate too (it is paused next)
        try:
            async with gate:
                await self._drain_one(sb)
        except AenvError as exc:  # etcd or the node failing on one sandbox: said, the drain goes on
            if sb.state != SandboxState.KILLED:  # killed meanwhile: nothing to drain
                self._error(f"sandbox {sb.id}: {exc.message}")
        finally:
            self._busy.discard(sb.id)
            await self._report()

    async def _drain_one(self, sb: LiveSandbox) -> None:
        if self.stopped:
            return
        left = max(1, int(sb.rec.end_at - time.time()))  # what is left of its timeout goes with it
        try:
            await self.node.pause(sb.id, settle_streams=self.progress.move)  # a move: clients see a pause only
        except AenvError:
            if sb.state == SandboxState.RUNNING:
                self._unpaused.add(sb.id)
            raise
        finally:
            await self._report()
        self.progress.paused += 1
        if not await self.node.wait_durable(sb.id):
            if sb.state != SandboxState.PAUSED:
                return  # resumed (drained again at the next pass) or killed meanwhile
            reason = self.node.durable_reason(sb.rec) or "its commit to the repository failed (retried)"
            self._error(f"sandbox {sb.id}: paused on this node only: {reason}")
            return
        self.progress.durable += 1
        await self._report()
        # Others resume it (a move, a connect through a gateway) only once its entry says durable.
        written = await self.agent.durable_written(sb.id)
        if self.progress.move and not self.stopped:
            if not written:
                self._error(f"sandbox {sb.id}: stays durably paused here: its directory entry was not written")
                return
            await self._move(sb, left)

    async def _move(self, sb: LiveSandbox, timeout: int) -> None:
        """Resume ``sb`` on the best other node (it takes the pause over from the repository)."""
        others = [n for n in await self.agent.store.nodes() if n.node_id != self.agent.node_id]
        runtime = self.agent.entry().runtime  # its memory image restores under this node's runtime only
        targets = Placement().rank(others, sb.rec.template_id or None, runtime)[:MOVE_TARGETS]
        timeout = min(timeout, self.node.settings.max_timeout)
        failures = []
        async with httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=MOVE_TIMEOUT)) as client:
            for target in targets:
                try:
                    r = await client.post(
                        f"{target.address}/sandboxes/{sb.id}/connect",
                        json={"timeout": timeout},
                        headers={"X-API-Key": self.api_key, "X-Team-ID": "*"},  # whichever team's it is
                    )
                except httpx.HTTPError as exc:
                    failures.append(f"{target.node_id}: {exc!r}"[:200])
                    continue
                if r.status_code in (200, 201):
                    await self.agent.moved_away(sb.id)
                    self.progress.moved += 1
                    log.info("drain: sandbox %s moved to node %s", sb.id, target.node_id)
                    return
                failures.append(f"{target.node_id}: {r.status_code} {r.text[:200]}")
        current = await self.agent.store.get_sandbox(sb.id)
        if current is not None and current.entry.node_id != self.agent.node_id:
            await self.agent.moved_away(sb.id)  # a connect through a gateway took it over first
            self.progress.moved += 1
            return
        self._error(f"sandbox {sb.id}: stays durably paused here: " + ("; ".join(failures) or "no node has room"))

    def _error(self, message: str) -> None:
        log.warning("drain of node %s: %s", self.agent.node_id, message)
        self.progress.failed += 1
        self.progress.errors = [*self.progress.errors, message][-MAX_ERRORS:]

    async def _report(self) -> None:
        self.progress.running = sum(1 for sb in list(self.node.sandboxes.values()) if sb.state in BUSY)
        self.progress.seconds = round(time.monotonic() - self.started, 2)
        tick, self._tick = self._tick, asyncio.Event()
        tick.set()

    async def follow(self) -> AsyncIterator[bytes]:
        """The progress as NDJSON lines: now, at each change (a line at least every 5 s, which
        keeps proxies from closing a quiet stream), and the last one (``done``)."""
        while True:
            tick = self._tick
            yield self.progress.line()
            if self.progress.done:
                return
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(tick.wait(), 5.0)


def serving_drain(app: ASGIApp, agent: NodeAgent, api_key: str) -> ASGIApp:
    """``app``, with ``POST /cluster/drain`` (body ``{"move": bool}``, the API key required)
    starting or joining the node's drain and streaming its progress, and ``POST /cluster/undrain``
    (no body) making it take new work again, answered with the node as it is then."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in (DRAIN_PATH, UNDRAIN_PATH):
            await app(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            if request.method != "POST":
                raise InvalidRequest(f"{scope['path']} takes POST")
            if not hmac.compare_digest(request.headers.get("x-api-key", "").encode(), api_key.encode()):
                raise Unauthenticated("invalid or missing API key (X-API-Key header)")
            if scope["path"] == UNDRAIN_PATH:
                await _no_body(request)
                await agent.undrain()
                await JSONResponse(node_json(agent.entry()))(scope, receive, send)
                return
            drain = agent.drain(move=await _move_of(request))
        except AenvError as exc:
            refusal = JSONResponse(error_body(exc), status_code=exc.status, headers=error_headers(exc))
            await refusal(scope, receive, send)
            return
        await StreamingResponse(drain.follow(), media_type="application/x-ndjson")(scope, receive, send)

    return wrapped


async def _no_body(request: Request) -> None:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > 1024:
            break
    if body.strip() not in (b"", b"{}"):
        raise InvalidRequest("an undrain takes no body")


async def _move_of(request: Request) -> bool:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > 1024:
            raise InvalidRequest('a drain\'s body is {"move": true|false}')
    try:
        parsed = parse_json(body) if body.strip() else {}
    except ValueError:
        raise InvalidRequest('a drain\'s body is JSON: {"move": true|false}') from None
    if not isinstance(parsed, dict) or set(parsed) - {"move"} or not isinstance(parsed.get("move", False), bool):
        raise InvalidRequest('a drain\'s body is {"move": true|false}')
    return bool(parsed.get("move", False))


class DrainFirst(uvicorn.Server):
    """A node's server that, on the first SIGTERM, drains the node (moving its sandboxes) for at
    most ``timeout`` seconds before it stops as before (pausing what is left here). It serves on
    meanwhile: clients reach their sandboxes until each is paused and moved. Another signal
    stops it at once."""

    def __init__(self, config: uvicorn.Config, agent: NodeAgent, timeout: float) -> None:
        super().__init__(config)
        self.agent = agent
        self.timeout = timeout
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_asked = False  # a second signal stops at once
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self._drain_asked and self._loop is not None and not self.should_exit:
            self._drain_asked = True
            self._loop.call_soon_threadsafe(self._start_drain, sig, frame)
            return
        super().handle_exit(sig, frame)

    def _start_drain(self, sig: int, frame: FrameType | None) -> None:
        self._drain_task = asyncio.ensure_future(self._drain_then_exit(sig, frame))  # held: not collected

    async def _drain_then_exit(self, sig: int, frame: FrameType | None) -> None:
        log.info("SIGTERM: draining node %s (at most %.0f s) before it stops", self.agent.node_id, self.timeout)
        drain = self.agent.drain(move=True)
        done, _ = await asyncio.wait([drain.task], timeout=self.timeout)
        if not done:
            drain.task.cancel()
            log.warning("the drain did not finish in %.0f s: the node pauses the rest here", self.timeout)
        p = drain.progress
        log.info("drained: %d moved, %d paused durably, %d failed", p.moved, p.durable, p.failed)
        super().handle_exit(sig, frame)
