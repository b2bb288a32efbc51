"""`aenv gateway`: one gateway served by uvicorn, which exits (2) once its key is found not to be
the cluster's."""

from __future__ import annotations

import asyncio
import logging

from aenv.api import connections, listen
from aenv.cluster.gateway.app import Gateway
from aenv.cluster.gateway.settings import GatewaySettings
from aenv.cluster.mirror import Mirror
from aenv.cluster.store import ClusterStore

log = logging.getLogger("aenv.gateway")


def build_gateway(settings: GatewaySettings) -> Gateway:
    return Gateway(
        settings, Mirror(ClusterStore.from_url(settings.cluster, tls=settings.cluster_tls, user=settings.cluster_user))
    )


async def serve_gateway(settings: GatewaySettings, *, host: str, port: int, keepalive: int = 610) -> None:
    import uvicorn

    from aenv.config import Settings

    # Listening before anything else (the cluster's directory takes up to 20 s to read): a port in
    # use fails at once, as a node's does; connections wait in the backlog meanwhile.
    sockets = listen.bind(host, port)
    try:
        gateway = build_gateway(settings)
    except BaseException:
        listen.close(sockets)
        raise
    limits = connections.HttpLimits.of(Settings())  # AENV_HTTP_*, read as a node reads them
    connections.raise_open_files_limit()  # every connection is a file descriptor
    config = uvicorn.Config(
        connections.OwnHeaders(gateway),  # one date and server header per answer (the node's, relayed)
        ssl_certfile=settings.tls_cert,
        ssl_keyfile=settings.tls_key,
        ws_max_size=settings.ws_max_message_mb * 2**20,  # what a client may send a sandbox's port
        http=connections.protocol_with(limits),  # bounds on request heads; resets as the nodes do
        date_header=False,
        server_header=False,
        host=host,
        port=port,
        lifespan="on",
        log_level="info",
        access_log=False,
        timeout_keep_alive=keepalive,  # longer than clients' pools keep a connection (see AENV_HTTP_KEEPALIVE)
        timeout_graceful_shutdown=5,
    )
    scheme = "https" if settings.tls_cert else "http"
    log.info("aenv gateway on %s://%s:%d for %s", scheme, host, port, settings.cluster)
    if settings.domain:
        log.info("domain mode: api.%s is the control plane, <port>-<id>.%s a sandbox", settings.domain, settings.domain)
    server = uvicorn.Server(config)

    async def stop_on_wrong_key() -> None:
        await gateway.wrong_key.wait()
        server.should_exit = True

    watch = asyncio.ensure_future(stop_on_wrong_key())
    try:
        await server.serve(sockets=sockets)
    finally:
        watch.cancel()
        listen.close(sockets)
    if gateway.wrong_key.is_set():
        raise SystemExit(2)
