"""Tunnels and the sandbox itself: a TCP tunnel to a port inside, health, metrics, configuration,
whether it may be checkpointed, containing a fork bomb. Stdlib only.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from typing import TYPE_CHECKING, Any

from aenv.channel import Stream
from aenv.guest import processes
from aenv.guest.methods import handler, off_loop
from aenv.guest.sockets import checkpoint_blockers, on_own_thread, relay_in_thread

if TYPE_CHECKING:
    from aenv.guest.agent import Agent

AGENT_VERSION = "0.6.4"  # the envd API level this agent implements


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
