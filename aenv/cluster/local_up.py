"""``./scripts/cluster up`` (aenv/cluster/local.py): start a local cluster, or bring back what of
one is down.

A fresh cluster: a new CA and certificates (aenv/cluster/pki.py), 3 etcd members serving TLS only
with client certificates (clients and peers), etcd's auth turned on (``aenv-node`` and
``aenv-gateway``, by their certificates' common names: aenv/cluster/auth.py), then the nodes (the
first alone until `base` is in the shared repository) and the gateways, each given its part's
certificate. Every process's command line is kept in cluster.json: a later ``up`` starts a process
that is gone with the same one (same ports, data dir, etcd member data), and nothing else.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from aenv.cluster import pki
from aenv.cluster.auth import GATEWAY_USER, NODE_USER, enable_auth
from aenv.cluster.local import (
    BASE_BUILD_TIMEOUT,
    DEFAULT_BASE_PORT,
    DEFAULT_GATEWAYS,
    DEFAULT_NODES,
    ETCD_MEMBERS,
    ETCD_START_TIMEOUT,
    GATEWAY_START_TIMEOUT,
    HOST,
    MAX_GATEWAYS,
    MAX_NODES,
    NODE_START_TIMEOUT,
    STATE_FORMAT,
    ClusterError,
    Layout,
    alive,
    api_key,
    down,
    etcd_healthy,
    etcd_marker,
    etcd_tls,
    gateway_marker,
    gateway_sees,
    get_json,
    node_marker,
    port_taken,
    private_dir,
    processes,
    read_state,
    secure_layout,
    spawn,
    stop_all,
    wait_until,
    write_state,
)
from aenv.cluster.store import EtcdTls
from aenv.errors import AenvError

Say = Callable[[str], None]


def up(
    root: Path, say: Say, *, nodes: int | None = None, gateways: int | None = None, base_port: int | None = None
) -> dict[str, Any]:
    """The cluster in ``root``: started, brought back, or found up (options left None: the
    defaults, or what the cluster there already is)."""
    for value, most, option in ((nodes, MAX_NODES, "--nodes"), (gateways, MAX_GATEWAYS, "--gateways")):
        if value is not None and not 1 <= value <= most:
            raise ClusterError(f"{option} must be 1-{most}")
    if shutil.which("etcd") is None:
        raise ClusterError("etcd is not installed (Debian: apt-get install etcd-server; or ./scripts/install)")
    secure_layout(Layout(root))
    previous = read_state(Layout(root))
    if previous is not None:
        return bring_back(root, previous, say, nodes=nodes, gateways=gateways, base_port=base_port)
    layout = Layout(root, base_port or DEFAULT_BASE_PORT)
    count, gateway_count = nodes or DEFAULT_NODES, gateways or DEFAULT_GATEWAYS
    check_ports(layout, count, gateway_count)
    key = api_key(layout)
    state: dict[str, Any] = {"format": STATE_FORMAT, "apiKey": key, "basePort": layout.base_port}
    state |= {"gateways": [], "gatewayProcesses": [], "nodes": [], "etcd": []}
    try:
        make_certificates(layout)
        start_etcd(layout, state, say)
        turn_auth_on(layout, say)
        start_nodes(layout, state, count, key, say)
        start_gateways(layout, state, gateway_count, key, say)
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
    refuse_taken(wanted)


def refuse_taken(wanted: list[tuple[str, int]]) -> None:
    taken = [f"{port} ({role})" for role, port in wanted if port_taken(port)]
    if taken:
        raise ClusterError(
            f"ports already taken on {HOST}: {', '.join(taken)}; stop what holds them or choose another --base-port"
        )


# -- bringing back ------------------------------------------------------------------------------------


def bring_back(
    root: Path, state: dict[str, Any], say: Say, *, nodes: int | None, gateways: int | None, base_port: int | None
) -> dict[str, Any]:
    """Start again, with their own command lines, the processes of ``state`` that are gone:
    etcd members first (they rejoin with their data), then nodes (their data dirs and ids kept),
    then gateways. What runs is left alone; nothing gone: nothing done."""
    layout = Layout(root, int(state.get("basePort") or _base_port_of(state)))
    have = (len(state["nodes"]), len(state["gateways"]), layout.base_port)
    asked = (nodes or have[0], gateways or have[1], base_port or have[2])
    gone = [p for p in processes(state) if not alive(p[1]["pid"], p[2])]
    if asked != have:
        shape = f"a cluster of {have[0]} nodes and {have[1]} gateways on base port {have[2]}"
        if not gone:
            raise ClusterError(f"{shape} is already up in {layout.dir}: ./scripts/cluster down first")
        raise ClusterError(
            f"{shape} is in {layout.dir}, {len(gone)} of its processes down: ./scripts/cluster up without "
            "--nodes, --gateways and --base-port brings it back as it was; ./scripts/cluster down first for another"
        )
    if not gone:
        say(f"already up ({layout.state})")
        return state
    if state.get("format") != STATE_FORMAT:
        raise ClusterError(
            f"{layout.state} was written by an older aenv (etcd without TLS) and {len(gone)} of its processes are "
            "down: ./scripts/cluster down, then up"
        )
    refuse_taken([(f"{role} {_name(entry)}", port) for role, entry, _ in gone for port in _ports(role, entry)])
    say(f"{len(gone)} processes are down: starting them again ({', '.join(_name(e) for _, e, _ in gone)})")
    key = str(state["apiKey"])
    started: list[tuple[str, dict[str, Any], str]] = []
    try:
        for role in ("etcd", "node", "gateway"):
            these = [(r, entry, marker) for r, entry, marker in gone if r == role]
            for r, entry, marker in these:
                entry["pid"] = spawn(entry["argv"], _log(layout, r, entry), _env(layout, r, key))
                write_state(layout, state)
                started.append((r, entry, marker))
            for r, entry, _ in these:
                _wait(layout, state, r, entry, key)
    except BaseException:
        say("starting failed: stopping what this run started (what ran before runs on)")
        stop_all(started, 30)
        raise
    say(f"back up: {', '.join(_name(e) for _, e, _ in gone)}")
    return state


def _base_port_of(state: dict[str, Any]) -> int:
    """A cluster.json of an older version names no base port: its first gateway's is it."""
    ports = [int(g["port"]) for g in state.get("gatewayProcesses", [])]
    return ports[0] if ports else DEFAULT_BASE_PORT


def _name(entry: dict[str, Any]) -> str:
    return str(entry.get("nodeID") or entry.get("name") or entry.get("url"))


def _ports(role: str, entry: dict[str, Any]) -> list[int]:
    port = int(entry["port"]) if role == "gateway" else urlsplit(entry["url"]).port or 0
    return [port, port + 1] if role == "etcd" else [port]  # a member's peer port follows its client port


def _log(layout: Layout, role: str, entry: dict[str, Any]) -> Path:
    if role == "etcd":
        return layout.logs / f"etcd-{entry['name']}.log"
    if role == "node":
        return layout.logs / f"node-{entry['nodeID']}.log"
    return layout.logs / f"gateway-g{int(entry['port']) - layout.base_port}.log"


def _env(layout: Layout, role: str, key: str) -> dict[str, str]:
    """A process's environment: this one's (other AENV_* settings reach every node), with its
    part's etcd certificate and the cluster's key; no etcd login of the caller's own."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_CLUSTER")}
    if role == "etcd":
        return env
    shared = {}
    if role == "node":  # one machine: its nodes share a volumes directory and a secrets key
        shared = {"AENV_VOLUMES_DIR": str(layout.dir / "volumes"), "AENV_SECRETS_KEY_FILE": str(_secrets_key(layout))}
    return env | layout.tls_env(role) | {"AENV_API_KEY": key} | shared | {k: v for k, v in env.items() if k in shared}


def _secrets_key(layout: Layout) -> Path:
    key = layout.dir / "secrets.key"
    try:
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        return key
    try:
        os.write(fd, os.urandom(32))
    finally:
        os.close(fd)
    return key


def _wait(layout: Layout, state: dict[str, Any], role: str, entry: dict[str, Any], key: str) -> None:
    if role == "etcd":
        ready = partial(etcd_healthy, entry["url"], etcd_tls(layout))
        marker, log = etcd_marker(entry["dataDir"]), _log(layout, role, entry)
        wait_until(f"etcd member {entry['name']}", ready, entry["pid"], marker, log, ETCD_START_TIMEOUT)
    elif role == "node":
        wait_node(layout, entry, key, BASE_BUILD_TIMEOUT if entry["nodeID"] == "n0" else NODE_START_TIMEOUT)
    else:
        ready = partial(gateway_sees, entry["url"], len(state["nodes"]))
        marker, log = gateway_marker(entry["port"]), _log(layout, role, entry)
        wait_until(f"gateway {entry['url']}", ready, entry["pid"], marker, log, GATEWAY_START_TIMEOUT)


# -- a fresh cluster ------------------------------------------------------------------------------------


def make_certificates(layout: Layout) -> None:
    """A new CA for a new cluster (etcd's data is new too): nothing signed for an earlier one
    is let in."""
    shutil.rmtree(layout.certs, ignore_errors=True)
    try:
        pki.make(layout.certs, [HOST, "localhost"])
    except AenvError as exc:
        raise ClusterError(exc.message) from None


def start_etcd(layout: Layout, state: dict[str, Any], say: Say) -> None:
    token = f"aenv-{uuid.uuid4().hex[:12]}"
    initial = ",".join(f"m{i}=https://{HOST}:{layout.etcd_ports(i)[1]}" for i in range(ETCD_MEMBERS))
    # A fresh cluster every time: what the directory said of the last one, the nodes say again.
    shutil.rmtree(layout.dir / "etcd", ignore_errors=True)
    private_dir(layout.dir / "etcd")
    tls = layout.certs / "member"
    for i in range(ETCD_MEMBERS):
        client, peer = layout.etcd_ports(i)
        data_dir = layout.dir / "etcd" / f"m{i}"
        argv = [
            "etcd",
            f"--name=m{i}",
            f"--data-dir={data_dir}",
            f"--listen-client-urls=https://{HOST}:{client}",
            f"--advertise-client-urls=https://{HOST}:{client}",
            f"--listen-peer-urls=https://{HOST}:{peer}",
            f"--initial-advertise-peer-urls=https://{HOST}:{peer}",
            f"--initial-cluster={initial}",
            f"--initial-cluster-token={token}",
            "--initial-cluster-state=new",
            # Clients and peers alike show a certificate of the cluster's CA: any local user
            # reaches these ports.
            "--client-cert-auth",
            f"--trusted-ca-file={tls / 'ca.crt'}",
            f"--cert-file={tls / 'member.crt'}",
            f"--key-file={tls / 'member.key'}",
            "--peer-client-cert-auth",
            f"--peer-trusted-ca-file={tls / 'ca.crt'}",
            f"--peer-cert-file={tls / 'member.crt'}",
            f"--peer-key-file={tls / 'member.key'}",
            "--logger=zap",
            "--log-level=warn",
        ]
        entry: dict[str, Any] = {"name": f"m{i}", "url": f"https://{HOST}:{client}", "dataDir": str(data_dir)}
        entry["argv"] = argv
        entry["pid"] = spawn(argv, layout.logs / f"etcd-m{i}.log", _env(layout, "etcd", ""))
        state["etcd"].append(entry)
        write_state(layout, state)
    for member in state["etcd"]:
        _wait(layout, state, "etcd", member, "")
    say(f"etcd: {len(state['etcd'])} members at {layout.etcd_url()} (TLS, client certificates)")


def turn_auth_on(layout: Layout, say: Say) -> None:
    """etcd's users and roles (the nodes' and gateways' by their certificates), then its auth."""
    root = layout.certs / "root"
    tls = EtcdTls(str(root / "ca.crt"), str(root / "client.crt"), str(root / "client.key"))
    password = (root / "password").read_text().strip()
    asyncio.run(enable_auth(layout.etcd_url(), password, {NODE_USER: None, GATEWAY_USER: None}, tls=tls))
    say(f"etcd: auth on ({NODE_USER}, {GATEWAY_USER} by certificate; root's password in {root / 'password'})")


def start_node(layout: Layout, state: dict[str, Any], i: int, key: str) -> dict[str, Any]:
    node_id = f"n{i}"
    port = layout.node_port(i)
    url = f"http://{HOST}:{port}"
    data_dir = layout.node_dir(node_id)
    private_dir(data_dir.parent)
    argv = [sys.executable, "-m", "aenv.cli.main", "server", "--host", HOST, "--port", str(port)]
    argv += ["--data-dir", str(data_dir), "--repo", str(layout.repo), "--cluster", layout.etcd_url()]
    argv += ["--advertise", url, "--node-id", node_id]
    node: dict[str, Any] = {"nodeID": node_id, "url": url, "dataDir": str(data_dir), "argv": argv}
    node["pid"] = spawn(argv, layout.logs / f"node-{node_id}.log", _env(layout, "node", key))
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


def start_nodes(layout: Layout, state: dict[str, Any], count: int, key: str, say: Say) -> None:
    # The first node builds `base` (or finds it) and commits it to the shared repository before
    # the others start: they fetch it from there instead of each building its own.
    if not layout.repo.is_symlink():
        private_dir(layout.repo)
    first = start_node(layout, state, 0, key)
    say(f"node n0: starting (the first start builds `base`, a few minutes); log {layout.logs / 'node-n0.log'}")
    wait_node(layout, first, key, BASE_BUILD_TIMEOUT)
    rest = [start_node(layout, state, i, key) for i in range(1, count)]
    for node in rest:
        wait_node(layout, node, key, NODE_START_TIMEOUT)
    say(f"nodes: {', '.join(n['url'] for n in state['nodes'])} (repository {layout.repo})")


def start_gateways(layout: Layout, state: dict[str, Any], count: int, key: str, say: Say) -> None:
    for i in range(count):
        port = layout.gateway_port(i)
        argv = [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", layout.etcd_url()]
        argv += ["--host", HOST, "--port", str(port)]
        entry: dict[str, Any] = {"url": f"http://{HOST}:{port}", "port": port, "argv": argv}
        entry["pid"] = spawn(argv, layout.logs / f"gateway-g{i}.log", _env(layout, "gateway", key))
        state["gateways"].append(entry["url"])
        state["gatewayProcesses"].append(entry)
        write_state(layout, state)
    for gw in state["gatewayProcesses"]:
        _wait(layout, state, "gateway", gw, key)
    say(f"gateways: {', '.join(state['gateways'])}")
