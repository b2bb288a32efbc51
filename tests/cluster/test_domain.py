"""Domain mode: the E2B SDKs given only E2B_DOMAIN (and the key) reach `https://api.<domain>` and
`https://<port>-<id>.<domain>`, served by a gateway with its own TLS certificate. How the names
resolve and the certificate is trusted without changing the machine: tests/cluster/domain.py."""

from __future__ import annotations

import json
import shutil
import ssl
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.cluster.cluster import LEASE_TTL, Gateway, start_gateway, wait_for_nodes
from tests.cluster.conftest import require_etcd
from tests.cluster.domain import (
    Certificates,
    WildcardDNS,
    client_env,
    loopback_address,
    make_certificates,
    run_resolving,
)
from tests.cluster.etcd import EtcdCluster
from tests.cluster.nodes import node_data_dir, start_node
from tests.conftest import API_KEY, REPO_DIR, Server, start_server

pytestmark = pytest.mark.sandbox

DOMAIN = "aenv-domain.test"  # .test is reserved for testing (RFC 6761): never a real name
JS = Path(__file__).parent.parent / "compat" / "js"


@dataclass
class DomainCluster:
    gateway: Gateway
    dns: WildcardDNS
    certs: Certificates
    resolv_conf: Path


@pytest.fixture(scope="module")
def domain_cluster(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DomainCluster]:
    """One node (whose own AENV_DOMAIN is not the gateway's) behind a gateway in domain mode that
    serves HTTPS on port 443 of a loopback address the test's DNS gives every name of DOMAIN."""
    require_etcd()
    directory = tmp_path_factory.mktemp("domain")
    certs = make_certificates(directory, DOMAIN)
    address = loopback_address()
    dns = WildcardDNS(address, DOMAIN, address)
    etcd = EtcdCluster(3)
    node: Server | None = None
    gateway: Gateway | None = None
    try:
        etcd.start()
        node = start_node(etcd.url, "node-a", lease_ttl=LEASE_TTL, extra_env={"AENV_DOMAIN": "node-a.internal"})
        tls = ("--domain", DOMAIN, "--tls-cert", str(certs.cert), "--tls-key", str(certs.key))
        gateway = start_gateway(etcd.url, host=address, port=443, args=tls, verify=_by_address(certs))
        wait_for_nodes(gateway, {"node-a"})
        yield DomainCluster(gateway, dns, certs, dns.resolv_conf(directory))
    finally:
        if gateway is not None:
            gateway.stop()
        if node is not None:
            node.stop()
        etcd.stop()
        dns.close()


def test_the_python_sdk_with_only_e2b_domain(domain_cluster: DomainCluster) -> None:
    env = client_env({"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": API_KEY, "SSL_CERT_FILE": str(domain_cluster.certs.ca)})
    done = run_resolving([sys.executable, "-m", "tests.cluster.domain_client"], domain_cluster.resolv_conf, env)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    sid = seen["sandboxId"]
    assert (seen["stdout"], seen["stderr"], seen["fileRoundTrip"]) == ("hello\n", "oops\n", True)
    # the port by its own name, over the gateway's TLS; the port sees the Host it was asked for
    assert seen["host"] == f"8000-{sid}.{DOMAIN}"
    assert seen["port"] == [200, {"path": "/hello?q=1", "host": f"8000-{sid}.{DOMAIN}"}]
    assert seen["infoDomain"] == DOMAIN  # the gateway's domain, not the node's own
    assert seen["listed"] == [sid] and seen["connected"] == "again\n"
    assert (seen["killed"], seen["runningAfterKill"]) == (True, False)
    # every request went by name: the control plane at api.D, envd and the port at <port>-<id>.D
    asked = set(domain_cluster.dns.asked)
    assert {f"api.{DOMAIN}", f"49983-{sid}.{DOMAIN}", f"8000-{sid}.{DOMAIN}"} <= asked, asked


def test_the_js_sdk_with_only_e2b_domain(domain_cluster: DomainCluster) -> None:
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "e2b").is_dir():
        pytest.skip("needs node >= 20.18 and `npm install` in tests/compat/js (scripts/install does both)")
    extra = {"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": API_KEY, "NODE_EXTRA_CA_CERTS": str(domain_cluster.certs.ca)}
    done = run_resolving([node, str(JS / "smoke.mjs")], domain_cluster.resolv_conf, client_env(extra))
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["stdout"] == "yes user\n" and seen["fileRoundTrip"] is True and seen["note"] == "from node"
    assert (seen["paused"], seen["stateAfterPause"], seen["stateAfterConnect"]) == (True, "paused", "running")
    assert seen["listedIds"] == [seen["sandboxId"]]
    assert (seen["killed"], seen["killedAgain"], seen["connectAfterKill"]) == (True, False, "NotFoundError")
    assert f"49983-{seen['sandboxId']}.{DOMAIN}" in domain_cluster.dns.asked


def test_a_single_node_in_domain_mode_with_its_own_tls(server: Server, tmp_path: Path) -> None:
    """No cluster: one node given the domain and a certificate serves the SDK alone, the same way."""
    certs = make_certificates(tmp_path, DOMAIN)
    address = loopback_address()
    dns = WildcardDNS(address, DOMAIN, address)
    tls = {"AENV_DOMAIN": DOMAIN, "AENV_TLS_CERT": str(certs.cert), "AENV_TLS_KEY": str(certs.key)}
    env = {"AENV_HOST": address, "AENV_REPO": str(REPO_DIR), "AENV_REPO_GC_INTERVAL": "0", **tls}
    node = start_server(node_data_dir("node-b"), port=443, extra_env=env, verify=_by_address(certs))
    try:
        extra = {"E2B_DOMAIN": DOMAIN, "E2B_API_KEY": API_KEY, "SSL_CERT_FILE": str(certs.ca)}
        done = run_resolving(
            [sys.executable, "-m", "tests.cluster.domain_client"], dns.resolv_conf(tmp_path), client_env(extra)
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.strip().splitlines()[-1])
        sid = seen["sandboxId"]
        assert (seen["stdout"], seen["fileRoundTrip"], seen["infoDomain"]) == ("hello\n", True, DOMAIN)
        assert seen["port"] == [200, {"path": "/hello?q=1", "host": f"8000-{sid}.{DOMAIN}"}]
        assert (seen["killed"], seen["runningAfterKill"]) == (True, False)
        assert {f"api.{DOMAIN}", f"49983-{sid}.{DOMAIN}", f"8000-{sid}.{DOMAIN}"} <= set(dns.asked)
    finally:
        node.stop()
        dns.close()


def _by_address(certs: Certificates) -> ssl.SSLContext:
    """Trust for a server asked at its address (not a name of the certificate): the CA only."""
    context = ssl.create_default_context(cafile=certs.ca)
    context.check_hostname = False
    return context


@pytest.mark.parametrize(
    ("options", "says"),
    [
        (("--domain", "not a domain!"), "is not a DNS name"),
        (("--domain", "-x.test"), "is not a DNS name"),
        (("--tls-cert", "{cert}"), "both or neither"),
        (("--tls-key", "{key}"), "both or neither"),
        (("--tls-cert", "{cert}", "--tls-key", "{other_key}"), "cannot serve TLS"),
        (("--tls-cert", "{missing}", "--tls-key", "{key}"), "cannot serve TLS"),
    ],
)
def test_the_gateway_refuses_a_bad_domain_or_certificate(options: tuple[str, ...], says: str, tmp_path: Path) -> None:
    certs = make_certificates(tmp_path, DOMAIN)
    (tmp_path / "other").mkdir()
    other = make_certificates(tmp_path / "other", DOMAIN)
    names = {"cert": certs.cert, "key": certs.key, "other_key": other.key, "missing": tmp_path / "nope.pem"}
    args = [o.format(**names) for o in options]
    done = subprocess.run(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", "etcd://127.0.0.1:1", *args],
        env={**client_env({}), "AENV_API_KEY": API_KEY},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and says in " ".join(done.stderr.split()), done.stderr[-2000:]
