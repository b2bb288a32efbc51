"""etcd over TLS (``etcds://``): a 3-member etcd that serves clients over TLS only and asks for a
client certificate; a store, a node and a gateway join with the CA and a certificate
(AENV_CLUSTER_CA, AENV_CLUSTER_CERT, AENV_CLUSTER_KEY); a client without the CA, without a
certificate, or speaking plaintext is refused."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.cluster.entries import SandboxEntry
from aenv.cluster.store import ClusterStore, EtcdTls
from aenv.errors import ClusterUnavailable, InvalidRequest
from tests.cluster.cluster import joins_and_serves
from tests.cluster.conftest import require_etcd
from tests.cluster.domain import Certificates, make_certificates
from tests.cluster.etcd import EtcdCluster
from tests.conftest import API_KEY, Server


@pytest.fixture()
def certificates(tmp_path: Path) -> Certificates:
    return make_certificates(tmp_path, "localhost", client=True)


@pytest.fixture()
def tls_etcd(certificates: Certificates) -> Iterator[EtcdCluster]:
    require_etcd()
    cluster = EtcdCluster(3, tls=certificates)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def files(c: Certificates) -> EtcdTls:
    return EtcdTls(str(c.ca), str(c.cert), str(c.key))


def env_of(c: Certificates) -> dict[str, str]:
    return {"AENV_CLUSTER_CA": str(c.ca), "AENV_CLUSTER_CERT": str(c.cert), "AENV_CLUSTER_KEY": str(c.key)}


async def test_a_store_speaks_tls_with_the_ca_and_is_refused_without(
    tls_etcd: EtcdCluster, certificates: Certificates
) -> None:
    store = ClusterStore.from_url(tls_etcd.url, tls=files(certificates), timeout=3)
    try:
        entry = SandboxEntry(sandbox_id="tls1", node_id="n1", state="running")
        assert (await store.create_sandbox(entry)).ok
        got = await store.get_sandbox("tls1")
        assert got is not None and got.entry == entry
    finally:
        await store.close()
    plaintext = tls_etcd.url.replace("etcds://", "etcd://")
    refused = [
        ClusterStore.from_url(tls_etcd.url, tls=EtcdTls(), timeout=1),  # the system's roots: not our CA
        ClusterStore.from_url(tls_etcd.url, tls=EtcdTls(ca=str(certificates.ca)), timeout=1),  # no certificate
        ClusterStore.from_url(plaintext, timeout=1),  # plaintext to a TLS port
    ]
    for other in refused:
        try:
            with pytest.raises(ClusterUnavailable):
                await other.get_sandbox("tls1")
        finally:
            await other.close()


def test_tls_files_are_checked_before_any_connection(certificates: Certificates, tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="etcds://"):  # files for a plaintext URL: not silently unused
        ClusterStore.from_url("etcd://127.0.0.1:2379", tls=files(certificates))
    with pytest.raises(InvalidRequest, match="cannot read"):
        ClusterStore.from_url("etcds://127.0.0.1:2379", tls=EtcdTls(ca=str(tmp_path / "missing.pem")))
    with pytest.raises(InvalidRequest, match="its key"):
        ClusterStore.from_url("etcds://127.0.0.1:2379", tls=EtcdTls(cert=str(certificates.cert)))
    (tmp_path / "junk.pem").write_bytes(b"not a certificate")
    with pytest.raises(InvalidRequest, match="PEM"):
        ClusterStore.from_url("etcds://127.0.0.1:2379", tls=EtcdTls(ca=str(tmp_path / "junk.pem")))


@pytest.mark.sandbox
def test_a_node_and_a_gateway_join_over_tls(
    server: Server, tls_etcd: EtcdCluster, certificates: Certificates, monkeypatch: pytest.MonkeyPatch
) -> None:
    joins_and_serves(tls_etcd.url, "node-tls", env_of(certificates), env_of(certificates), monkeypatch)


@pytest.mark.parametrize(
    ("url", "env", "says"),
    [
        ("etcd://127.0.0.1:1", {"AENV_CLUSTER_CA": "{ca}"}, "need an etcds:// cluster URL"),
        ("etcds://127.0.0.1:1", {"AENV_CLUSTER_CA": "{missing}"}, "cannot read"),
        ("etcds://127.0.0.1:1", {"AENV_CLUSTER_KEY": "{key}"}, "needs its key"),
    ],
)
def test_the_gateway_refuses_bad_etcd_tls_settings_at_start(
    url: str, env: dict[str, str], says: str, certificates: Certificates, tmp_path: Path
) -> None:
    names = {"ca": certificates.ca, "key": certificates.key, "missing": tmp_path / "nope.pem"}
    done = subprocess.run(
        [sys.executable, "-m", "aenv.cli.main", "gateway", "--cluster", url],
        env={**os.environ, "AENV_API_KEY": API_KEY, **{k: v.format(**names) for k, v in env.items()}},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and says in " ".join(done.stderr.split()), done.stderr[-2000:]


@pytest.mark.parametrize(
    ("args", "env", "says"),
    [
        (["--cluster", "etcd://127.0.0.1:1"], {"AENV_CLUSTER_CA": "{ca}"}, "need an etcds:// cluster URL"),
        (["--cluster", "etcds://127.0.0.1:1"], {"AENV_CLUSTER_CA": "{missing}"}, "cannot read"),
        (["--cluster", "etcds://127.0.0.1:1"], {"AENV_CLUSTER_CERT": "{cert}"}, "needs its key"),
        ([], {"AENV_CLUSTER_CA": "{ca}"}, "--cluster etcds://... is missing"),
        (["--cluster", "etcd://"], {}, "cluster URL must"),
        (["--cluster", "etcd://127.0.0.1:1", "--host", "0.0.0.0"], {}, "--advertise http://ADDRESS:PORT is needed"),
        (["--cluster", "etcd://127.0.0.1:1", "--advertise", "ftp://x"], {}, "--advertise must be"),
        ([], {"AENV_TLS_CERT": "{cert}"}, "needs its key"),
        ([], {"AENV_CLUSTER_LEASE_TTL": "1"}, "AENV_CLUSTER_LEASE_TTL"),
    ],
)
def test_a_node_refuses_bad_cluster_and_tls_settings_at_start(
    args: list[str], env: dict[str, str], says: str, certificates: Certificates, tmp_path: Path
) -> None:
    """Exit 2 with the reason before the node starts anything (its data dir is never made), as the
    gateway does; a node used to build `base` first and fail on its etcd settings only then."""
    names = {"ca": certificates.ca, "cert": certificates.cert, "missing": tmp_path / "nope.pem"}
    data_dir = tmp_path / "never-made"
    done = subprocess.run(
        [sys.executable, "-m", "aenv.cli.main", "server", "--data-dir", str(data_dir), *args],
        env={**os.environ, "AENV_API_KEY": API_KEY, **{k: v.format(**names) for k, v in env.items()}},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and says in " ".join(done.stderr.split()), done.stderr[-2000:]
    assert not data_dir.exists()
