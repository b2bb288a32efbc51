"""A sandbox's credentials, derived (never stored) from a secret and its id.

One secret per node, or the cluster's one secret (docs/cluster.md) on every node of a cluster: a
sandbox then has the same tokens on whichever node serves it, and a gateway holding the secret
can tell which sandbox signed a URL.
"""

from __future__ import annotations

import hashlib
import hmac


def access_token(secret: bytes, sandbox_id: str) -> str:
    """envd's access token (the header, and what signs /files URLs)."""
    return hmac.new(secret, sandbox_id.encode(), hashlib.sha256).hexdigest()[:40]


def traffic_token(secret: bytes, sandbox_id: str) -> str:
    """E2B's traffic access token for the ports of a sandbox without public traffic. Derived as the
    envd token is (so pause, resume and restarts keep it, and each fork child has its own), under a
    prefix of its own: one token never opens what the other guards."""
    return hmac.new(secret, b"traffic\0" + sandbox_id.encode(), hashlib.sha256).hexdigest()[:40]
