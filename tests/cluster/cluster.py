"""A real cluster for tests: 3 etcd members, nodes in cluster mode, gateways (real processes)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import signal
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import httpx
import pytest

from aenv.cluster.entries import ClusterConfig, SandboxEntry
from aenv.cluster.store import ClusterStore
from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.cluster.nodes import start_node
from tests.conftest import API_KEY, DATA_DIR, Server, free_port

LEASE_TTL = 3


@dataclass
class Gateway:
    url: str
    proc: subprocess.Popen[bytes]
    verify: ssl.SSLContext | bool = True  # trust for a gateway serving HTTPS with a test certificate

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def start_gateway(
    etcd_url: str,
    *,
    api_key: str = API_KEY,
    args: tuple[str, ...] = (),
    host: str = "127.0.0.1",
    port: int | None = None,
    verify: ssl.SSLContext | bool = True,
) -> Gateway:
    port = port or free_port()
    log = DATA_DIR.parent / f"{DATA_DIR.name}-gateway-{port}.log"
    command = ["gateway", "--cluster", etcd_url, "--host", host, "--port", str(port), *args]
    proc = subprocess.Popen(
        [sys.executable, "-m", "aenv.cli.main", *command],
        stdout=open(log, "ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "AENV_API_KEY": api_key},
    )
    url = f"{'https' if '--tls-cert' in args else 'http'}://{host}:{port}"
    deadline = time.monotonic() + 90  # a loaded CI machine starts Python slowly
    try:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"gateway exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2, verify=verify).status_code == 200:
                    return Gateway(url, proc, verify)
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"gateway did not become ready:\n{log.read_text()[-3000:]}")
    except BaseException:  # not handed to anyone (a test's timeout lands here too): it must not outlive it
        proc.kill()
        proc.wait()
        raise


@dataclass
class Cluster:
    etcd: EtcdCluster
    nodes: dict[str, Server]
    gateways: list[Gateway]

    @property
    def gateway(self) -> Gateway:
        return self.gateways[0]

    def api(self, gateway: int = 0) -> httpx.Client:
        return httpx.Client(base_url=self.gateways[gateway].url, headers={"X-API-Key": API_KEY}, timeout=120)


@contextmanager
def running_cluster(
    node_names: tuple[str, ...] = ("node-a", "node-b"),
    gateways: int = 2,
    node_env: dict[str, dict[str, str]] | None = None,
    node_member: dict[str, int] | None = None,
    etcd_args: tuple[str, ...] = (),
) -> Iterator[Cluster]:
    """etcd x3 (with more flags ``etcd_args``), the nodes (sharing the session server's
    repository: request `server` first; each with its settings in ``node_env``, e.g. an S3
    repository; one named in ``node_member`` knows only that etcd member), and the gateways;
    everything stopped after."""
    require_etcd()
    etcd = EtcdCluster(3, args=etcd_args)
    nodes: dict[str, Server] = {}
    started: list[Gateway] = []
    try:
        etcd.start()

        def node(name: str) -> Server:
            member = (node_member or {}).get(name)
            url = etcd.url if member is None else f"etcd://127.0.0.1:{etcd.members[member].client_port}"
            return start_node(url, name, lease_ttl=LEASE_TTL, extra_env=(node_env or {}).get(name))

        # All at once (the nodes join the cluster concurrently, as a fleet starting does)
        nodes.update(zip(node_names, all_started([lambda n=n: node(n) for n in node_names]), strict=True))
        started += all_started([lambda: start_gateway(etcd.url)] * gateways)
        for gateway in started:
            wait_for_nodes(gateway, set(nodes))
        yield Cluster(etcd, nodes, started)
    finally:
        for gateway in started:
            gateway.stop()
        for node in nodes.values():
            node.stop()
        etcd.stop()


class Stoppable(Protocol):
    def stop(self) -> None: ...


S = TypeVar("S", bound=Stoppable)


def all_started(starts: list[Callable[[], S]]) -> list[S]:
    """Every ``start`` run at once. If one fails (or the test gives up meanwhile), those that
    started are stopped once every start has ended, and it raises."""
    if not starts:
        return []
    pool = ThreadPoolExecutor(len(starts))
    futures = [pool.submit(start) for start in starts]
    done = False
    try:
        concurrent.futures.wait(futures)
        for future in futures:
            if future.exception() is not None:
                raise future.exception()  # type: ignore[misc]
        done = True
        return [future.result() for future in futures]
    finally:
        pool.shutdown(wait=True)
        if not done:
            for future in futures:
                if future.exception() is None:
                    future.result().stop()


def wait_cut_off(node: Server, timeout: float = 15) -> None:
    """Until ``node`` counts etcd out of reach: its admission refuses creates for it. The probe
    names no template there is, so one the node still admits makes nothing (a 404)."""
    deadline = time.monotonic() + timeout
    with node.client() as direct:
        while True:
            r = direct.post("/sandboxes", json={"templateID": "no-such-template-probe"})
            if r.status_code == 503 and "has not reached the cluster store" in r.text:
                return
            assert r.status_code == 404, r.text
            assert time.monotonic() < deadline, "the node did not notice it lost etcd"
            time.sleep(0.2)


def wait_for_nodes(gateway: Gateway, names: set[str], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while True:
        listed = httpx.get(f"{gateway.url}/nodes", headers={"X-API-Key": API_KEY}, verify=gateway.verify).json()
        if {n["nodeID"] for n in listed} == names:
            return
        assert time.monotonic() < deadline, f"the gateway lists {listed}, not {names}"
        time.sleep(0.2)


def cluster_config(cluster: Cluster) -> ClusterConfig:
    async def read() -> ClusterConfig:
        store = ClusterStore.from_url(cluster.etcd.url)
        try:
            config = await store.get_config()
        finally:
            await store.close()
        assert config is not None
        return config

    return asyncio.run(read())


def directory_entry(cluster: Cluster, sandbox_id: str) -> SandboxEntry | None:
    async def read() -> SandboxEntry | None:
        store = ClusterStore.from_url(cluster.etcd.url)
        try:
            got = await store.get_sandbox(sandbox_id)
        finally:
            await store.close()
        return got.entry if got is not None else None

    return asyncio.run(read())


def use_gateway(cluster: Cluster, index: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("E2B_API_KEY", API_KEY)
    monkeypatch.setenv("E2B_API_URL", cluster.gateways[index].url)
    monkeypatch.setenv("E2B_SANDBOX_URL", cluster.gateways[index].url)
    monkeypatch.delenv("E2B_DEBUG", raising=False)


def joins_and_serves(
    etcd_url: str, node_id: str, node_env: dict[str, str], gateway_env: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node (``node_env``) and a gateway (``gateway_env``) join ``etcd_url``; a sandbox is
    created through the gateway on that node, found there, and killed."""
    node = start_node(etcd_url, node_id, extra_env=node_env)
    try:
        for key, value in gateway_env.items():  # the gateway's environment is this one's
            monkeypatch.setenv(key, value)
        gateway = start_gateway(etcd_url)
        try:
            wait_for_nodes(gateway, {node_id})
            with httpx.Client(base_url=gateway.url, headers={"X-API-Key": API_KEY}, timeout=120) as api:
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 60})
                assert r.status_code == 201, r.text
                sandbox_id = r.json()["sandboxID"]
                assert api.get(f"/sandboxes/{sandbox_id}").json()["nodeID"] == node_id
                assert api.delete(f"/sandboxes/{sandbox_id}").status_code == 204
        finally:
            gateway.stop()
    finally:
        node.stop()
