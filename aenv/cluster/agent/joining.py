"""How a node joins a cluster: its id (kept in its data dir), the address gateways reach it at, its
cluster store from its settings, and the cluster's one token secret and API key.

Apart from the membership (:mod:`aenv.cluster.agent.membership`) because the server and the teams' store need these
without an agent.
"""

from __future__ import annotations

import logging
import time
from typing import Any
from urllib.parse import urlsplit

from aenv.cluster.entries import ClusterConfig, api_key_digest, key_matches
from aenv.cluster.entries import node_id_of as node_id_of  # its home now: a node alone has an id too
from aenv.cluster.store import ClusterStore
from aenv.cluster.store import cluster_store as cluster_store  # its home now: the teams read it too
from aenv.config import Settings
from aenv.errors import InvalidRequest

log = logging.getLogger("aenv.cluster.agent")


def advertise_of(settings: Settings) -> str:
    """The URL gateways reach this node at: AENV_ADVERTISE, else the listening address (refused
    when that is a wildcard, which names no host)."""
    if settings.advertise:
        try:
            parts = urlsplit(settings.advertise)
            hostname = parts.hostname
        except ValueError:  # a malformed bracketed host
            hostname = None
        if hostname is None or parts.scheme not in ("http", "https") or parts.path not in ("", "/"):
            raise InvalidRequest(f"--advertise must be http(s)://HOST:PORT, not {settings.advertise[:200]!r}")
        return settings.advertise.rstrip("/")
    if settings.host in ("0.0.0.0", "::", ""):
        raise InvalidRequest("--advertise http://ADDRESS:PORT is needed when listening on every address")
    host = f"[{settings.host}]" if ":" in settings.host else settings.host
    return f"http://{host}:{settings.port}"


async def join_cluster(store: ClusterStore, node: Any, api_key: str) -> ClusterConfig:
    """Take the cluster's one token secret, or give it this node's when it is the first to join
    (so a node's sandboxes keep their tokens when it becomes a cluster's first node). A node
    started with another API key than the cluster's is refused: half the requests would be 401."""
    proposed = ClusterConfig(node.token_secret, api_key_digest(node.token_secret, api_key), round(time.time(), 3))
    config = await store.ensure_config(proposed)
    if not key_matches(config, api_key):
        raise InvalidRequest("this node's API key (AENV_API_KEY) is not the one the cluster was started with")
    if config.secret != node.token_secret:
        held = len(node.sandboxes)
        if held:
            log.warning(
                "this node's %d sandboxes get new envd and traffic tokens: the cluster has its own secret",
                held,
            )
        await node.use_token_secret(config.secret)
    return config
