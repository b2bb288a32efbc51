"""A whole cluster on this machine's loopback: `./scripts/cluster up|down|status` (docs/cluster.md).

Three etcd members, N nodes (each its own data dir, all one shared snapshot repository, a
directory) and G gateways, every one a detached process with its log in the cluster dir
(``$AENV_CLUSTER_DIR``, default /var/tmp/aenv-cluster). ``cluster.json`` there says what runs:
``down`` reads it, stops everything and releases what a node killed in the middle of its work
would leave (runsc sandboxes, mounts, loop devices), so nothing of the cluster outlives it.

Any local user can reach loopback ports, so etcd (which holds the cluster's token secret and says
where gateways send clients' keys) speaks TLS only, to clients and peers alike, and asks each for
a certificate of the cluster's own CA (aenv/cluster/pki.py); with etcd's auth on, a node logs in
as ``aenv-node`` and a gateway as ``aenv-gateway`` by their certificates' common names. The
cluster dir and everything the script writes there is owner-only (0700 directories, 0600 files).

``up`` on a cluster.json whose processes are partly gone starts only those again, with the same
command lines, ports and data; with all of them running it changes nothing.

Ports, from ``--base-port`` P (default 8080): gateways P, P+1, ...; nodes P+100, P+101, ...;
etcd member i clients P+200+2i, peers P+201+2i.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from aenv.cluster.store import EtcdTls
from aenv.errors import AenvError
from aenv.storage import datadir

DEFAULT_DIR = Path("/var/tmp/aenv-cluster")
DEFAULT_BASE_PORT = 8080
DEFAULT_NODES = 3
DEFAULT_GATEWAYS = 2
STATE_FORMAT = 2  # 2: etcd over TLS with auth, each process's command line kept (to start it again)
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

    @property
    def certs(self) -> Path:
        return self.dir / "certs"

    def client_tls(self, part: str) -> EtcdTls:
        """A store's TLS files as ``part`` (node, gateway, root): its certificate is its etcd user."""
        d = self.certs / part
        return EtcdTls(str(d / "ca.crt"), str(d / "client.crt"), str(d / "client.key"))

    def tls_env(self, part: str) -> dict[str, str]:
        """What a node (``node``) or gateway (``gateway``) needs to log in to etcd."""
        d = self.certs / part
        return {"AENV_CLUSTER_CA": str(d / "ca.crt"), "AENV_CLUSTER_CERT": str(d / "client.crt")} | {
            "AENV_CLUSTER_KEY": str(d / "client.key")
        }

    def gateway_port(self, i: int) -> int:
        return self.base_port + i

    def node_port(self, i: int) -> int:
        return self.base_port + 100 + i

    def etcd_ports(self, i: int) -> tuple[int, int]:
        return self.base_port + 200 + 2 * i, self.base_port + 201 + 2 * i

    def node_dir(self, node_id: str) -> Path:
        return self.dir / "nodes" / node_id

    def etcd_url(self) -> str:
        return "etcds://" + ",".join(f"{HOST}:{self.etcd_ports(i)[0]}" for i in range(ETCD_MEMBERS))


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
    """Start a detached process (its own session, no terminal) writing to ``log`` (owner-only:
    a log may say anything its process saw)."""
    private_dir(log.parent)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.fchmod(fd, 0o600)
    with os.fdopen(fd, "ab") as out:
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


def etcd_healthy(url: str, tls: ssl.SSLContext) -> bool:
    try:
        r = httpx.get(f"{url}/health", timeout=3, verify=tls)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json().get("health") == "true"


def etcd_tls(layout: Layout) -> ssl.SSLContext:
    """A client of the cluster's etcd as its root (the CA and root's certificate)."""
    context = ssl.create_default_context(cafile=str(layout.certs / "ca.crt"))
    context.load_cert_chain(layout.certs / "root" / "client.crt", layout.certs / "root" / "client.key")
    return context


def private_dir(path: Path) -> None:
    """A directory of the cluster's: 0700, and refused if another user owns it or one of its
    parents (one made in /var/tmp before the first `up` would stay its maker's)."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    try:
        datadir.check_owned(path)
    except datadir.UnsafeDirectory as exc:
        raise ClusterError(str(exc)) from None
    os.chmod(path, 0o700)


def secure_layout(layout: Layout) -> None:
    """The cluster dir and what the script keeps in it, owner-only (a previous version left its
    logs 0644). The nodes' data dirs are the nodes' to keep (they tighten them at start)."""
    private_dir(layout.dir)
    for sub in (layout.logs, layout.dir / "nodes", layout.dir / "etcd"):
        if sub.exists():
            private_dir(sub)
    files = [layout.state, layout.dir / "api-key"]
    files += list(layout.logs.glob("*")) if layout.logs.is_dir() else []
    for path in files:
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o600)


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
    p_up = sub.add_parser(
        "up", help="start the cluster, or what of it is down; prints export lines for eval (the same each time)"
    )
    p_up.add_argument("--nodes", type=int, help=f"[default: {DEFAULT_NODES}, or the cluster's]")
    p_up.add_argument("--gateways", type=int, help=f"[default: {DEFAULT_GATEWAYS}, or the cluster's]")
    p_up.add_argument("--base-port", type=int, help=f"[default: {DEFAULT_BASE_PORT}, or the cluster's]")
    p_down = sub.add_parser("down", help="stop everything the cluster started")
    p_down.add_argument("--timeout", type=float, default=STOP_TIMEOUT, help="seconds nodes get to stop")
    sub.add_parser("status", help="cluster.json with each process alive or not (exit 1 when any is not)")
    args = parser.parse_args(argv)

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    root = args.dir or cluster_dir()
    os.umask(0o077)  # what the cluster's processes write, and its logs: owner-only
    try:
        if args.command == "up":
            from aenv.cluster.local_up import up

            state = up(root, say, nodes=args.nodes, gateways=args.gateways, base_port=args.base_port)
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
    except AenvError as exc:
        say(f"error: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
