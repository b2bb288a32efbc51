"""The gateway's settings, and the bounds and deadlines of its forwarding (each one's reason beside it)."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from aenv.cluster.store import EtcdTls, EtcdUser
from aenv.config import DEFAULT_MAX_FORK
from aenv.errors import InvalidRequest

MAX_INFO_BODY = 1024 * 1024  # a create's answer (the sandbox)
MAX_FORK_BODY = 16 * 1024 * 1024  # an answer the gateway reads whole (a fork's: every child's info)
MAX_CREATE_BODY = 1024 * 1024  # a create's JSON (the nodes refuse more than AENV_MAX_BODY_KB anyway)
MAX_CANDIDATES = 3  # nodes a create tries before giving up
# After an attempt that got no answer, how long a create keeps trying (longer than a node's lease:
# a dead node's claim on the create id goes with it) and how often.
CREATE_RETRY_SECONDS = 30.0
CREATE_RETRY_PAUSE = 0.5
# A node that answers 503 cluster_unavailable while etcd answers the gateway missed a few
# heartbeats (a leader election, a loaded host): its create, pause or resume is tried again while
# its lease holds (it is in the mirror), for this long at most. A node cut off for good leaves
# the mirror when its lease runs out (10 s by default), and the 503 goes out then; a slow election
# on a loaded host, the node's member rejoining it and the node's reconnect took over 10 s in CI.
# When etcd does not answer the gateway either (no quorum), the 503 goes out at once.
STORE_BLIP_SECONDS = 30.0
QUORUM_CHECK_KEEP = 0.5  # seconds one check that etcd answers serves every request that asks
# A read that failed while most members take connections is an election under way (the leader
# went): read again for this long, every ELECTION_RETRY, before counting etcd out of quorum.
ELECTION_SECONDS = 6.0
ELECTION_RETRY = 0.3
MEMBER_CONNECT_TIMEOUT = 0.5
# Sandboxes this gateway created, known from the create's answer until the node's entry arrives.
MAX_HINTS = 100_000
HINT_SECONDS = 60.0
CATALOGUE_LAG = 8.0  # a node reads an unknown id's entry at once, and all entries at most every 3 s
SNAPSHOT_HINT_SECONDS = 600.0  # a snapshot's commit to the repository may take minutes
STARTUP_WAIT = 10.0
CLOSE_SECONDS = 5.0  # how long a stopping gateway waits for its directory's watch to end
STARTUP_DEADLINE = 20.0  # the whole start: the directory, the teams, the cluster's configuration
SETTLE_SECONDS = 5.0  # how long a list waits for a change made through this gateway, at most
LIST_SETTLE = 2.0  # seconds one list waits for the directory to show such changes
PRESENT, GONE = "present", "gone"
TOMBSTONE_SECONDS = 30 * 86400  # how long a lost node has to come back and learn its sandbox was killed
MAX_REPLAYED_BODY = 64 * 1024  # sandbox traffic's body kept to send again (an envd call's; not a stream)
MAX_FOLLOWS = 2  # times a request about a sandbox follows it to the node it moved to
KEEP_STREAM_SECONDS = 2.0  # how long a streamed body to a draining node's sandbox may take to be kept whole
LOST_WAIT = 30.0  # how long a kill waits for a node that does not answer to be counted lost
SILENT_SECONDS = 30.0  # a node that did not answer is placed on last for this long, unless it answers
WAKE_SECONDS = 60.0  # how long traffic waits for its sandbox to be resumed on another node
LIST_TIMEOUT = 30.0  # seconds the gateway waits for its first read of the directory


DOMAIN_LABEL = r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?"
DOMAIN = re.compile(rf"(?:{DOMAIN_LABEL}\.)*{DOMAIN_LABEL}")


def check_domain(domain: str) -> str:
    """A domain for domain mode: DNS labels (lower case), up to 200 characters (a sandbox's host
    puts ``<port>-<id>.`` before it)."""
    domain = domain.strip().lower().rstrip(".")
    if len(domain) > 200 or not DOMAIN.fullmatch(domain):
        raise InvalidRequest(f"--domain {domain[:80]!r} is not a DNS name (labels of a-z 0-9 -, dot-separated)")
    return domain


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    cluster: str
    api_key: str | None = None
    connect_timeout: float = 5.0  # to a node
    create_timeout: float = 120.0  # a create's answer; past it the create is tried again (same create id)
    ws_max_message_mb: int = 16  # the largest WebSocket message relayed either way (larger: 1009)
    # Nodes are the cluster's own services and keep their own deadlines (agent calls, operations,
    # quiet streams pinged); a request's answer may stream for as long as its command runs.
    read_timeout: float | None = None
    # Domain mode: clients reach the control plane at api.<domain> and a sandbox's port at
    # <port>-<id>.<domain>; sandboxes' answers name this domain (the SDKs build those hosts from it).
    domain: str | None = None
    tls_cert: str | None = None  # PEM files: the gateway serves HTTPS itself (else HTTP, e.g. behind a proxy)
    tls_key: str | None = None
    cluster_tls: EtcdTls | None = None  # the files for an etcds:// cluster (AENV_CLUSTER_CA, _CERT, _KEY)
    cluster_user: EtcdUser | None = None  # etcd's auth: AENV_CLUSTER_USER, AENV_CLUSTER_PASSWORD_FILE
    # The most children of one fork the gateway makes on other nodes (AENV_MAX_FORK, as the nodes'):
    # a fork asking for more is the source node's to answer (a 400), never spread.
    max_fork: int = field(default_factory=lambda: _max_fork(os.environ))


def _max_fork(env: Mapping[str, str]) -> int:
    raw = env.get("AENV_MAX_FORK", "")
    if not raw:
        return DEFAULT_MAX_FORK
    if not (raw.isascii() and raw.isdecimal() and int(raw) >= 1):
        raise ValueError(f"AENV_MAX_FORK must be a positive integer, not {raw[:40]!r}")
    return int(raw)
