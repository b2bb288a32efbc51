"""A whole cluster on this machine's loopback: `./scripts/cluster up|down|status` (docs/cluster.md).

Three etcd members, N nodes (each its own data dir, all one shared snapshot repository, a
directory) and G gateways, every one a detached process with its log in the cluster dir
(``$AENV_CLUSTER_DIR``, default /var/tmp/aenv-cluster). ``cluster.json`` there says what runs:
``down`` reads it, stops everything and releases what a node killed in the middle of its work
would leave (runsc sandboxes, mounts, loop devices), so nothing of the cluster outlives it.

Ports, from ``--base-port`` P (default 8080): gateways P, P+1, ...; nodes P+100, P+101, ...;
etcd member i clients P+200+2i, peers P+201+2i.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from aenv.errors import AenvError

DEFAULT_DIR = Path("/var/tmp/aenv-cluster")
DEFAULT_BASE_PORT = 8080
ETCD_MEMBERS = 3
MAX_GATEWAYS = 100
MAX_NODES = 100
HOST = "127.0.0.1"
ETCD_START_TIMEOUT = 30.0
BASE_BUILD_TIMEOUT = 1800.0  # the first node builds `base` by debootstrap when the repository has none
NODE_START_TIMEOUT = 600.0  # later nodes fetch `base` from the repository
GATEWAY_START_TIMEOUT = 60.0
STOP_TIMEOUT = 150.0  # a stopping node pauses its running sandboxes (up to 60 s each, 4 at a time)


class ClusterError(AenvError):
    """A clear, one-paragraph reason the command could not do what was asked."""


@dataclass(frozen=True)
class Layout:
    """Where everything of one local cluster lives, and which ports it takes."""

    dir: Path
    base_port: int = DEFAULT_BASE_PORT

    @property
    def state(self) -> Path:
        return self.dir / "cluster.json"

    @property
    def repo(self) -> Path:
        return self.dir / "repo"

    @property
    def logs(self) -> Path:
        return self.dir / "logs"

    def gateway_port(self, i: int) -> int:
        return self.base_port + i

    def node_port(self, i: int) -> int:
        return self.base_port + 100 + i

    def etcd_ports(self, i: int) -> tuple[int, int]:
        return self.base_port + 200 + 2 * i, self.base_port + 201 + 2 * i

    def node_dir(self, node_id: str) -> Path:
        return self.dir / "nodes" / node_id

    def etcd_url(self) -> str:
        return "etcd://" + ",".join(f"{HOST}:{self.etcd_ports(i)[0]}" for i in range(ETCD_MEMBERS))


def cluster_dir() -> Path:
    return Path(os.environ.get("AENV_CLUSTER_DIR") or DEFAULT_DIR)


# -- processes ----------------------------------------------------------------------------------------


def alive(pid: int, marker: str) -> bool:
    """Whether ``pid`` is still the process we started: it runs and its command line holds ``marker``
    (a pid reused by something else after a reboot is not ours to signal)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return marker in cmdline and stat.rsplit(")", 1)[1].split()[0] != "Z"


def spawn(argv: list[str], log: Path, env: dict[str, str]) -> int:
    """Start a detached process (its own session, no terminal) writing to ``log``."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return proc.pid


def port_taken(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError:
            return True
    return False


def tail(log: Path, size: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-size:]
    except OSError:
        return "(no log)"


def wait_until(what: str, ready: Callable[[], bool], pid: int, marker: str, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if not alive(pid, marker):
            raise ClusterError(f"{what} exited while starting; the end of {log}:\n{tail(log)}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} did not become ready in {timeout:.0f}s; the end of {log}:\n{tail(log)}")
        time.sleep(0.3)


def etcd_healthy(url: str) -> bool:
    return bool((get_json(f"{url}/health") or {}).get("health") == "true")


def gateway_sees(url: str, nodes: int) -> bool:
    return bool((get_json(f"{url}/health") or {}).get("nodes") == nodes)


def get_json(url: str, api_key: str | None = None) -> Any:
    try:
        r = httpx.get(url, timeout=3, headers={"X-API-Key": api_key} if api_key else None)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


# -- state ---------------------------------------------------------------------------------------------


def read_state(layout: Layout) -> dict[str, Any] | None:
    try:
        return json.loads(layout.state.read_text())  # type: ignore[no-any-return]
    except FileNotFoundError:
        return None
    except ValueError as exc:
        raise ClusterError(f"{layout.state} is not valid JSON ({exc}); remove it after checking nothing runs") from exc


def write_state(layout: Layout, state: dict[str, Any]) -> None:
    tmp = layout.state.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # it holds the API key
    with os.fdopen(fd, "w") as f:
        json.dump(state, f, indent=2)
    os.replace(tmp, layout.state)


def processes(state: dict[str, Any]) -> list[tuple[str, dict[str, Any], str]]:
    """(role, entry, command-line marker) of every process the state lists."""
    out = [("gateway", g, gateway_marker(g["port"])) for g in state.get("gatewayProcesses", [])]
    out += [("node", n, node_marker(n["dataDir"])) for n in state.get("nodes", [])]
    out += [("etcd", e, etcd_marker(e["dataDir"])) for e in state.get("etcd", [])]
    return out


# What identifies each process on its command line (arguments end with a space there: n1 is not n10).
def gateway_marker(port: int) -> str:
    return f"--port {port} "


def node_marker(data_dir: str) -> str:
    return f"--data-dir {data_dir} "


def etcd_marker(data_dir: str) -> str:
    return f"--data-dir={data_dir} "


def env_lines(state: dict[str, Any]) -> list[str]:
    url, key = state["gateways"][0], state["apiKey"]
    return [
        f"export E2B_API_URL={url}",
        f"export E2B_SANDBOX_URL={url}",
        f"export E2B_API_KEY={key}",
        f"export AENV_URL={url}",
        f"export AENV_API_KEY={key}",
    ]


def api_key(layout: Layout) -> str:
    """$AENV_API_KEY, else one made at the first `up` and kept in the cluster dir."""
    if os.environ.get("AENV_API_KEY"):
        return os.environ["AENV_API_KEY"]
    path = layout.dir / "api-key"
    if path.exists():
        return path.read_text().strip()
    key = "e2b_" + secrets.token_hex(20)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


# -- up --------------------------------------------------------------------------------------------------


def up(layout: Layout, nodes: int, gateways: int, say: Callable[[str], None]) -> dict[str, Any]:
    if not 1 <= nodes <= MAX_NODES or not 1 <= gateways <= MAX_GATEWAYS:
        raise ClusterError(f"--nodes must be 1-{MAX_NODES} and --gateways 1-{MAX_GATEWAYS}")
    if shutil.which("etcd") is None:
        raise ClusterError("etcd is not installed (Debian: apt-get install etcd-server; ./scripts/cluster does it)")
    layout.dir.mkdir(parents=True, exist_ok=True)
    previous = read_state(layout)
    if previous is not None:
        running = [p for p in processes(previous) if alive(p[1]["pid"], p[2])]
        if len(running) == len(processes(previous)):
            if len(previous["nodes"]) != nodes or len(previous["gateways"]) != gateways:
                raise ClusterError(
                    f"a cluster of {len(previous['nodes'])} nodes and {len(previous['gateways'])} gateways is already "
                    f"up in {layout.dir}: ./scripts/cluster down first"
                )
            say(f"already up ({layout.state})")
            return previous
        say(f"a previous cluster in {layout.dir} is partly down ({len(running)} processes left): stopping it first")
        down(layout, say)
    check_ports(layout, nodes, gateways)
    key = api_key(layout)
    state: dict[str, Any] = {"apiKey": key, "gateways": [], "gatewayProcesses": [], "nodes": [], "etcd": []}
    try:
        start_etcd(layout, state, say)
        start_nodes(layout, state, nodes, key, say)
        start_gateways(layout, state, gateways, nodes, key, say)
    except BaseException:
        say("starting failed: stopping what was started")
        down(layout, say)
        raise
    return state


def check_ports(layout: Layout, nodes: int, gateways: int) -> None:
    wanted = [(f"gateway g{i}", layout.gateway_port(i)) for i in range(gateways)]
    wanted += [(f"node n{i}", layout.node_port(i)) for i in range(nodes)]
    for i in range(ETCD_MEMBERS):
        client, peer = layout.etcd_ports(i)
        wanted += [(f"etcd m{i} clients", client), (f"etcd m{i} peers", peer)]
    if max(port for _, port in wanted) > 65535:
        raise ClusterError(f"--base-port {layout.base_port} leaves no room for the cluster's ports (up to +205)")
    taken = [f"{port} ({role})" for role, port in wanted if port_taken(port)]
    if taken:
        raise ClusterError(
            f"ports already taken on {HOST}: {', '.join(taken)}; stop what holds them or choose another --base-port"
        )


def start_etcd(layout: Layout, state: dict[str, Any], say: Callable[[str], None]) -> None:
    token = f"aenv-{uuid.uuid4().hex[:12]}"
    initial = ",".join(f"m{i}=http://{HOST}:{layout.etcd_ports(i)[1]}" for i in range(ETCD_MEMBERS))
    # A fresh cluster every time: what the directory said of the last one, the nodes say again.
    shutil.rmtree(layout.dir / "etcd", ignore_errors=True)
    for i in range(ETCD_MEMBERS):
        client, peer = layout.etcd_ports(i)
        data_dir = layout.dir / "etcd" / f"m{i}"
        argv = [
            "etcd",
            f"--name=m{i}",
            f"--data-dir={data_dir}",
            f"--listen-client-urls=http://{HOST}:{client}",
            f"--advertise-client-urls=http://{HOST}:{client}",
            f"--listen-peer-urls=http://{HOST}:{peer}",
            f"--initial-advertise-peer-urls=http://{HOST}:{peer}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-token={token}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-level=warn",
        ]
        pid = spawn(argv, layout.logs / f"etcd-m{i}.log", dict(os.environ))
        state["etcd"].append({"url": f"http://{HOST}:{client}", "pid": pid, "dataDir": str(data_dir)})
        write_state(layout, state)
    for i, member in enumerate(state["etcd"]):
        wait_until(
            f"etcd member m{i}",
            partial(etcd_healthy, member["url"]),
            member["pid"],
            etcd_marker(member["dataDir"]),
            layout.logs / f"etcd-m{i}.log",
            ETCD_START_TIMEOUT,
        )
    say(f"etcd: {len(state['etcd'])} members at {layout.etcd_url()}")


def start_node(layout: Layout, state: dict[str, Any], i: int, key: str) -> dict[str, Any]:
    node_id = f"n{i}"
    port = layout.node_port(i)
    url = f"http://{HOST}:{port}"
    data_dir = layout.node_dir(node_id)
    data_dir.mkdir(parents=True, exist_ok=True)
    argv = [sys.executable, "-m", "aenv.cli.main", "server", "--host", HOST, "--port", str(port)]
    argv += ["--data-dir", str(data_dir), "--repo", str(layout.repo), "--cluster", layout.etcd_url()]
    argv += ["--advertise", url, "--node-id", node_id]
    pid = spawn(argv, layout.logs / f"node-{node_id}.log", {**os.environ, "AENV_API_KEY": key})
    node = {"nodeID": node_id, "url": url, "pid": pid, "dataDir": str(data_dir)}
    state["nodes"].append(node)
    write_state(layout, state)
    return node


def wait_node(layout: Layout, node: dict[str, Any], key: str, timeout: float) -> None:
    def ready() -> bool:
        health = get_json(f"{node['url']}/health") or {}
        if "base" not in health.get("templates", []):
            return False
        repository = get_json(f"{node['url']}/repository", key) or {}
        return repository.get("pending") == []  # `base` is in the shared repository for the others

    wait_until(
        f"node {node['nodeID']}",
        ready,
        node["pid"],
        node_marker(node["dataDir"]),
        layout.logs / f"node-{node['nodeID']}.log",
        timeout,
    )


def start_nodes(layout: Layout, state: dict[str, Any], count: int, key: str, say: Callable[[str], None]) -> None:
    # The first node builds `base` (or finds it) and commits it to the shared repository before
    # the others start: they fetch it from there instead of each building its own.
    layout.repo.mkdir(parents=True, exist_ok=True)
    first = start_node(layout, state, 0, key)
    say(f"node n0: starting (the first start builds `base`, a few minutes); log {layout.logs / 'node-n0.log'}")
    wait_node(layout, first, key, BASE_BUILD_TIMEOUT)
    rest = [start_node(layout, state, i, key) for i in range(1, count)]
    for node in rest:
        wait_node(layout, node, key, NODE_START_TIMEOUT)
    say(f"nodes: {', '.join(n['url'] for n in state['nodes'])} (repository {layout.repo})")


def start_gateways(
    layout: Layout, state: dict[str, Any], count: int, nodes: int, key: str, say: Callable[[str], None]
) -> None:
    for i in range(count):
        port = layout.gateway_port(i)
        argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", layout.etcd_url()]
        argv += ["--host", HOST, "--port", str(port)]
        pid = spawn(argv, layout.logs / f"gateway-g{i}.log", {**os.environ, "AENV_API_KEY": key})
        state["gateways"].append(f"http://{HOST}:{port}")
        state["gatewayProcesses"].append({"url": f"http://{HOST}:{port}", "port": port, "pid": pid})
        write_state(layout, state)
    for i, gw in enumerate(state["gatewayProcesses"]):
        wait_until(
            f"gateway g{i}",
            partial(gateway_sees, gw["url"], nodes),
            gw["pid"],
            gateway_marker(gw["port"]),
            layout.logs / f"gateway-g{i}.log",
            GATEWAY_START_TIMEOUT,
        )
    say(f"gateways: {', '.join(state['gateways'])}")


# -- down ------------------------------------------------------------------------------------------------


def stop_all(entries: list[tuple[str, dict[str, Any], str]], timeout: float) -> list[tuple[str, dict[str, Any]]]:
    """SIGTERM every process, wait for all of them together, SIGKILL what is left; returns the killed."""
    for _, entry, marker in entries:
        if alive(entry["pid"], marker):
            os.kill(entry["pid"], signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while any(alive(e["pid"], m) for _, e, m in entries) and time.monotonic() < deadline:
        time.sleep(0.2)
    killed = []
    for role, entry, marker in entries:
        if alive(entry["pid"], marker):
            os.kill(entry["pid"], signal.SIGKILL)
            killed.append((role, entry))
    while any(alive(e["pid"], m) for _, e, m in entries) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    return killed


def release_node(data_dir: Path) -> None:
    """What a node stopped by SIGKILL leaves: its runsc sandboxes, then every mount and loop device
    under its data dir (the node's own shutdown does the same when it is let to finish)."""
    runtime = data_dir / "runtime"
    if (runtime / "runsc").is_dir():
        from aenv.runtime.gvisor import GVisorDriver

        asyncio.run(GVisorDriver(state_dir=runtime).cleanup_orphans(set()))
    for mount in sorted(mounts_under(data_dir), key=len, reverse=True):
        subprocess.run(["umount", "-l", mount], check=False, capture_output=True)
    for device in loops_under(data_dir):
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)


def mounts_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        point = line.split()[4].encode().decode("unicode_escape")  # octal escapes (\040) of mountinfo
        if point.startswith(prefix):
            found.append(point)
    return found


def loops_under(root: Path) -> list[str]:
    prefix = str(root.resolve()) + "/"
    found = []
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if backing.read_text().strip().removesuffix(" (deleted)").startswith(prefix):
            found.append(f"/dev/{backing.parent.parent.name}")
    return found


def down(layout: Layout, say: Callable[[str], None], timeout: float = STOP_TIMEOUT) -> bool:
    """Stop the cluster; False when nothing was up."""
    state = read_state(layout)
    if state is None:
        return False
    every = processes(state)
    running = sum(1 for _, entry, marker in every if alive(entry["pid"], marker))
    # Gateways and nodes first (a stopping node pauses its sandboxes and writes that to etcd).
    killed = stop_all([p for p in every if p[0] != "etcd"], timeout)
    for role, entry in killed:
        say(f"{role} {entry.get('nodeID') or entry.get('url')} did not stop in {timeout:.0f}s: killed")
    for node in state.get("nodes", []):
        release_node(Path(node["dataDir"]))
    stop_all([p for p in every if p[0] == "etcd"], 20)
    layout.state.unlink()
    say(f"down: {running} processes stopped ({layout.dir})")
    return True


def status(layout: Layout) -> dict[str, Any] | None:
    state = read_state(layout)
    if state is None:
        return None
    for _, entry, marker in processes(state):
        entry["alive"] = alive(entry["pid"], marker)
    for gw in state.get("gatewayProcesses", []):
        gw["health"] = get_json(f"{gw['url']}/health")
    return state


# -- command line ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, help=f"cluster dir [default: $AENV_CLUSTER_DIR or {DEFAULT_DIR}]")
    sub = parser.add_subparsers(dest="command", required=True)
    p_up = sub.add_parser("up", help="start the cluster; prints export lines for eval")
    p_up.add_argument("--nodes", type=int, default=3)
    p_up.add_argument("--gateways", type=int, default=2)
    p_up.add_argument("--base-port", type=int, default=DEFAULT_BASE_PORT)
    p_down = sub.add_parser("down", help="stop everything the cluster started")
    p_down.add_argument("--timeout", type=float, default=STOP_TIMEOUT, help="seconds nodes get to stop")
    sub.add_parser("status", help="cluster.json with each process alive or not (exit 1 when any is not)")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    root = args.dir or cluster_dir()
    try:
        if args.command == "up":
            state = up(Layout(root, args.base_port), args.nodes, args.gateways, say)
            print("\n".join(env_lines(state)), flush=True)
        elif args.command == "down":
            if not down(Layout(root), say, args.timeout):
                say(f"not up ({root / 'cluster.json'} does not exist)")
        else:
            current = status(Layout(root))
            if current is None:
                say(f"not up ({root / 'cluster.json'} does not exist)")
                return 3
            current.pop("apiKey", None)
            print(json.dumps(current, indent=2))
            return 0 if all(e["alive"] for _, e, _ in processes(current)) else 1
    except ClusterError as exc:
        say(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
