"""The node's ASGI app in a cluster: requests the agent must refuse answered before they reach the
node (503 ``cluster_unavailable`` while etcd is silent or the node drains), and the agent stopped
once the app has shut down.

Apart from the agent because it is about the app's requests, not the cluster's state.
"""

from __future__ import annotations

import logging
import re
from typing import TYPE_CHECKING

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from aenv.api.app import sandbox_target
from aenv.errors import ClusterUnavailable, error_body

if TYPE_CHECKING:
    from aenv.cluster.agent.membership import NodeAgent

log = logging.getLogger("aenv.cluster.agent")
# A request that would pause or resume a sandbox (E2B's routes; a connect resumes a paused one).
OWNERSHIP_PATH = re.compile(r"(?:/v2)?/sandboxes/(?P<id>[^/]+)/(?P<op>pause|resume|connect)")


def subject(method: str, path: str, headers: dict[str, str]) -> tuple[re.Match[str] | None, str | None]:
    """(the pause, resume or connect a request is, if it is one; the sandbox it is about): sandbox
    traffic (by its headers or host) is about its own sandbox, whatever its path says."""
    target = sandbox_target(headers)
    if isinstance(target, tuple):
        return None, target[0]
    op = OWNERSHIP_PATH.fullmatch(path) if method == "POST" and target is None else None
    return op, op["id"] if op is not None else None


def refusing_without_quorum(app: ASGIApp, agent: NodeAgent) -> ASGIApp:
    """``app``, with the pauses and resumes ``NodeAgent.refusal`` names answered 503
    ``cluster_unavailable`` (a WebSocket: closed with 1013, try again later) while etcd is silent.
    Only a request that arrives then is looked at: otherwise this costs one clock read."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and (agent.draining or agent.silent() is not None):
            headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
            reason = agent.refusal(scope.get("method", "GET"), scope["path"], headers)
            if reason is not None:
                log.warning("%s", reason)
                if scope["type"] == "websocket":
                    await receive()  # websocket.connect
                    await send({"type": "websocket.close", "code": 1013, "reason": "cluster unavailable"})
                    return
                await JSONResponse(error_body(ClusterUnavailable(reason)), status_code=503)(scope, receive, send)
                return
        await app(scope, receive, send)

    return wrapped


def leaving_with(app: ASGIApp, agent: NodeAgent) -> ASGIApp:
    """``app``, with the agent stopped once the app's own shutdown is done (the node has paused
    its sandboxes then; uvicorn re-raises a stopping signal right after, so it cannot wait)."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def on_send(message: Message) -> None:
            if message["type"] in ("lifespan.shutdown.complete", "lifespan.shutdown.failed"):
                await agent.stop()
            await send(message)

        await app(scope, receive, on_send)

    return wrapped
