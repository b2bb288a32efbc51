"""process.Process: start, follow, list, feed, signal and resize the sandbox's commands.

The handlers turn envd's requests into calls on the agent's :class:`~aenv.guest.processes.ProcessTable`
and stream a command's events back until it ends or the host cancels. Stdlib only.
"""

from __future__ import annotations

import asyncio
import base64
from typing import TYPE_CHECKING, Any

from aenv.channel import Stream
from aenv.guest import files, processes
from aenv.guest.methods import handler, until_cancelled
from aenv.guest.processes import SIGNALS, ProcessError

if TYPE_CHECKING:
    from aenv.guest.agent import Agent


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
    cancel = asyncio.ensure_future(until_cancelled(stream))
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
