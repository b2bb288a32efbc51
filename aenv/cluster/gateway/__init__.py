"""The gateway: one URL in front of many nodes. Stateless; run any number.

It mirrors the cluster directory in memory (``Mirror``) and forwards each request to a node,
streaming both ways:

- a request that names a sandbox (the path ``/sandboxes/{id}...`` or ``/v2/sandboxes/{id}...``,
  E2B's ``E2b-Sandbox-Id``/``E2b-Sandbox-Port`` headers, or a ``<port>-<id>.<domain>`` host) goes to
  the node that owns the sandbox; one whose node is gone (its lease expired) answers 404 naming
  that node;
- ``POST /sandboxes`` (a create) goes to the least loaded ready node; a node that refuses (429) or
  cannot be reached is skipped for the next one;
- anything else (templates, snapshots, the node-wide API) goes to the least loaded ready node.

Its own routes: ``GET /health`` and ``GET /metrics`` (open), ``GET /nodes`` and ``GET /nodes/{id}``.
Control-plane requests need the cluster's API key at the gateway already (the nodes check it
again); sandbox traffic carries its own credentials (envd access tokens), which the owning node
checks. A signed ``/files`` URL names no sandbox: the gateway finds the sandbox whose token signed
it with the cluster's secret (every node derives tokens from it), as a node does among its own.
Every answer about one sandbox carries ``x-aenv-node-id``, errors included.

Its parts, each given what it needs by ``app.Gateway`` (none reaches into another's state):
``routes`` (the control plane's route table), ``traffic`` (sandbox traffic, WebSockets, wakes),
``sandboxes`` and ``takeover`` (one sandbox's requests; resumes taken over elsewhere), ``creates``
and ``forking`` (placement; a fork's children elsewhere), ``listings`` (lists and metrics over
every node), ``admin`` (the nodes), ``artifacts`` (templates, snapshots), ``owners`` (which node
serves a sandbox), ``upstream`` and ``relay`` (requests to the nodes, their answers back),
``directory`` (what this gateway knows of the cluster: the one state they share), ``helpers``
(pure), ``settings`` and ``serve``.
"""

from aenv.cluster.gateway.app import Gateway
from aenv.cluster.gateway.artifacts import ARTIFACT_PATH
from aenv.cluster.gateway.helpers import SANDBOX_INFO, NodePage, Traffic
from aenv.cluster.gateway.relay import (
    HOP_HEADERS,
    NODE_SCOPE,
    ROUTE_SCOPE,
    TAKEOVER_SCOPE,
    NodeSilent,
    Relay,
    error_response,
    log,
    traffic_gone,
)
from aenv.cluster.gateway.serve import build_gateway, serve_gateway
from aenv.cluster.gateway.settings import (
    CATALOGUE_LAG,
    CREATE_RETRY_PAUSE,
    CREATE_RETRY_SECONDS,
    DOMAIN,
    DOMAIN_LABEL,
    GONE,
    HINT_SECONDS,
    KEEP_STREAM_SECONDS,
    LIST_SETTLE,
    LIST_TIMEOUT,
    LOST_WAIT,
    MAX_CANDIDATES,
    MAX_CREATE_BODY,
    MAX_FOLLOWS,
    MAX_FORK_BODY,
    MAX_HINTS,
    MAX_INFO_BODY,
    MAX_REPLAYED_BODY,
    PRESENT,
    QUORUM_CHECK_KEEP,
    SETTLE_SECONDS,
    SILENT_SECONDS,
    SNAPSHOT_HINT_SECONDS,
    STARTUP_WAIT,
    STORE_BLIP_SECONDS,
    TOMBSTONE_SECONDS,
    WAKE_SECONDS,
    GatewaySettings,
    check_domain,
)

__all__ = [
    "ARTIFACT_PATH",
    "CATALOGUE_LAG",
    "CREATE_RETRY_PAUSE",
    "CREATE_RETRY_SECONDS",
    "DOMAIN",
    "DOMAIN_LABEL",
    "GONE",
    "HINT_SECONDS",
    "HOP_HEADERS",
    "KEEP_STREAM_SECONDS",
    "LIST_SETTLE",
    "LIST_TIMEOUT",
    "LOST_WAIT",
    "MAX_CANDIDATES",
    "MAX_CREATE_BODY",
    "MAX_FOLLOWS",
    "MAX_FORK_BODY",
    "MAX_HINTS",
    "MAX_INFO_BODY",
    "MAX_REPLAYED_BODY",
    "NODE_SCOPE",
    "PRESENT",
    "QUORUM_CHECK_KEEP",
    "ROUTE_SCOPE",
    "SANDBOX_INFO",
    "SETTLE_SECONDS",
    "SILENT_SECONDS",
    "SNAPSHOT_HINT_SECONDS",
    "STARTUP_WAIT",
    "STORE_BLIP_SECONDS",
    "TAKEOVER_SCOPE",
    "TOMBSTONE_SECONDS",
    "WAKE_SECONDS",
    "Gateway",
    "GatewaySettings",
    "NodePage",
    "NodeSilent",
    "Relay",
    "Traffic",
    "build_gateway",
    "check_domain",
    "error_response",
    "log",
    "serve_gateway",
    "traffic_gone",
]
