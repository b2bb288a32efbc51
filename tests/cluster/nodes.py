"""Node processes in cluster mode for tests: each with its own data dir, all sharing one snapshot
repository (the session server's, where `base` is built once), registered in one etcd cluster."""

from __future__ import annotations

import os
from pathlib import Path

from tests import disk
from tests.conftest import DATA_DIR, REPO_DIR, Server, free_port, start_server

KEPT = ("node-a", "node-b")  # the nodes of most cluster tests: their data dirs last the session


def node_data_dir(name: str) -> Path:
    # Next to the session's data dir: kept between local runs (the fetched `base` layers stay).
    return DATA_DIR.parent / f"{DATA_DIR.name}-{name}"


def shared_by_nodes(root: Path) -> dict[str, str]:
    """What an operator gives every node of a cluster alike: one directory of volumes (their
    shared file system) and one secrets key file, both below ``root``."""
    volumes, key = root / "volumes", root / "secrets.key"
    volumes.mkdir(parents=True, exist_ok=True)
    if not key.exists():
        key.write_bytes(os.urandom(32))
        key.chmod(0o600)
    return {"AENV_VOLUMES_DIR": str(volumes), "AENV_SECRETS_KEY_FILE": str(key)}


def start_node(etcd_url: str, name: str, *, lease_ttl: int = 3, extra_env: dict[str, str] | None = None) -> Server:
    if name not in KEPT:
        disk.dispose_after_module(node_data_dir(name))  # ~1 GB each once it has fetched `base`
    port = free_port()
    env = {
        "AENV_CLUSTER": etcd_url,
        "AENV_NODE_ID": name,
        "AENV_ADVERTISE": f"http://127.0.0.1:{port}",
        "AENV_CLUSTER_LEASE_TTL": str(lease_ttl),
        "AENV_REPO": str(REPO_DIR),
        "AENV_SPARE_UPPERS": "1",  # two cores shared by every node of the test
        "AENV_REPO_GC_INTERVAL": "0",  # the repository is the session server's too
        **shared_by_nodes(DATA_DIR.parent / f"{DATA_DIR.name}-cluster-shared"),
        **(extra_env or {}),
    }
    return start_server(node_data_dir(name), port=port, extra_env=env)
