"""Running a node: API key, the `base` template, then the HTTP server until a signal."""

from __future__ import annotations

import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path

import uvicorn

from aenv.api import connections, envd_streams, listen
from aenv.api.app import build
from aenv.cluster.entries import EntryError, node_id_of
from aenv.config import Settings
from aenv.errors import InvalidRequest
from aenv.images.mirrors import parse_mirrors
from aenv.node.egress import Rules, static_hosts
from aenv.node.orchestrator import Node
from aenv.storage import datadir

log = logging.getLogger("aenv.server")


def resolve_api_key(settings: Settings) -> str:
    """AENV_API_KEY if set; else a key generated once and kept in the data dir."""
    if settings.api_key:
        return settings.api_key
    datadir.secure(settings.data_dir)  # before reading a key from it: nobody else's key
    path = settings.data_dir / "api-key"
    if path.exists():
        return path.read_text().strip()
    key = "e2b_" + secrets.token_hex(20)  # E2B-shaped, so SDKs that validate key format accept it
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return key


def check_settings(settings: Settings) -> None:
    """Refuse, before anything starts, settings the node would fail on only later (InvalidRequest):
    its TLS files, registry mirrors and builds' allowOut, and for a cluster its etcd URL, etcd TLS
    files and advertised URL. Without a
    cluster, etcd TLS files are a mistake, not something to ignore."""
    connections.check_tls(settings.tls_cert, settings.tls_key)
    try:
        parse_mirrors(settings.registry_mirrors)
    except ValueError as exc:
        raise InvalidRequest(f"AENV_REGISTRY_MIRRORS: {exc}") from None
    Rules.parse(settings.build_allow_out, what="AENV_BUILD_ALLOW_OUT", domains_allowed=True)
    static_hosts()
    if settings.driver == "fake" and not _loopback(settings.host):
        raise InvalidRequest(
            f"AENV_DRIVER=fake isolates nothing (its sandboxes are host processes): it serves on a loopback "
            f"address only, not {settings.host}"
        )
    if settings.cluster:
        from aenv.cluster.agent import advertise_of, cluster_store

        cluster_store(settings)  # parsed and the files read; no connection yet
        advertise_of(settings)
    elif settings.cluster_ca or settings.cluster_cert or settings.cluster_key:
        raise InvalidRequest("AENV_CLUSTER_CA, _CERT and _KEY are for a cluster: --cluster etcds://... is missing")
    elif settings.cluster_user or settings.cluster_password_file or settings.cluster_password:
        raise InvalidRequest("AENV_CLUSTER_USER and its password are for a cluster: --cluster etcd://... is missing")


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def serve(
    settings: Settings, *, on_log: Callable[[str], None] | None = None, ready_file: Path | None = None
) -> None:
    from aenv.templates.builder import ensure_base

    say = on_log or (lambda line: log.info("%s", line))
    os.umask(datadir.PRIVATE_UMASK)  # the node's files, its tools' (runsc's images) and logs: owner-only
    check_settings(settings)
    # Listening before the node starts and `base` builds (a minute): a second server on this port
    # (or data dir: the node's lock) fails at once; connections wait in the backlog meanwhile.
    sockets = listen.bind(settings.host, settings.port)
    try:
        api_key = resolve_api_key(settings)
        node = Node(settings)
        await node.start()
    except BaseException:
        listen.close(sockets)
        raise
    try:  # alone as in a cluster: its lists and dashboard name it (nodeID), by the id it would join with
        settings.node_id = node_id_of(settings)
    except BaseException as exc:
        await node.stop()
        listen.close(sockets)
        if isinstance(exc, EntryError):
            raise InvalidRequest(str(exc)) from exc
        raise
    try:
        if settings.build_base:
            try:
                node.find_template("base")
            except LookupError:
                say("building the `base` template (first start only; takes about a minute)")
            await listen.until_signalled(ensure_base(node, on_log=say))
        app = build(node, api_key, start_node=False)
        agent = None
        if settings.cluster:
            from aenv.cluster.agent import leaving_with, refusing_without_quorum, start_agent
            from aenv.cluster.agent.drain import serving_drain

            agent = await start_agent(node, settings, api_key)
            app = leaving_with(serving_drain(refusing_without_quorum(app, agent), agent, api_key), agent)
        config = uvicorn.Config(
            connections.OwnHeaders(app),  # one date and server header per answer
            host=settings.host,
            port=settings.port,
            ssl_certfile=settings.tls_cert,
            ssl_keyfile=settings.tls_key,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=5,
            timeout_keep_alive=settings.http_keepalive,
            http=connections.protocol_with(connections.HttpLimits.of(settings)),
            date_header=False,
            server_header=False,
            ws_max_size=settings.port_ws_max_message_mb * 2**20,  # what a client may send a sandbox's port
        )
        logging.getLogger("uvicorn.error").addFilter(envd_streams.DroppedStreamsAreNotErrors())
        connections.raise_open_files_limit()  # every connection is a file descriptor
        server = uvicorn.Server(config)
        if agent is not None and settings.drain_timeout > 0 and settings.repo.strip().lower() != "none":
            from aenv.cluster.agent.drain import DrainFirst

            server = DrainFirst(config, agent, settings.drain_timeout)  # SIGTERM drains the node first
        url = f"{'https' if settings.tls_cert else 'http'}://{settings.host}:{settings.port}"
        say(f"aenv listening on {url} (API key in {settings.data_dir / 'api-key'})")
        if settings.driver == "fake":  # said again where an operator looks last: this node isolates nothing
            from aenv.runtime.fake import WARNING

            log.warning("%s", WARNING)
        if ready_file is not None:
            ready_file.write_text(f"{url}\n")
    except BaseException as exc:
        await node.stop()
        listen.close(sockets)
        if isinstance(exc, listen.Stopped):
            say(f"{exc}: stopped before serving")
            return
        raise
    await server.serve(sockets=sockets)  # the app's shutdown stops the node
