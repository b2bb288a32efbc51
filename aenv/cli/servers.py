"""Commands that run a process here: a node (``aenv server``), a gateway (``aenv gateway``), and
turning etcd's auth on for a cluster (``aenv etcd-auth``).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from pathlib import Path
from typing import Any

import typer

from aenv.cli.common import JSON_OPTION, _emit, app, err, out
from aenv.sdk import AenvError


@app.command()
def server(
    host: str = typer.Option(None, help="Address to listen on [default: 127.0.0.1]"),
    port: int = typer.Option(None, help="Port [default: 3000]"),
    data_dir: Path = typer.Option(None, "--data-dir", help="State directory [default: /var/lib/aenv]"),
    repo: str = typer.Option(
        None, "--repo", help="Snapshot repository: a path, s3://bucket/prefix or none [default: <data-dir>/repo]"
    ),
    cluster: str = typer.Option(None, "--cluster", help="Join a cluster: etcd[s]://H1:P1,H2:P2,... (docs/cluster.md)"),
    advertise: str = typer.Option(
        None, "--advertise", help="URL gateways reach this node at [default: http://host:port]"
    ),
    node_id: str = typer.Option(
        None, "--node-id", help="This node's id in the cluster [default: kept in the data dir]"
    ),
) -> None:
    """Run a node: the API on one port, with the `base` template ready."""
    from pydantic import ValidationError

    from aenv.api.server import check_settings, serve
    from aenv.config import Settings

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["host"] = host
    if port is not None:
        overrides["port"] = port
    if data_dir is not None:
        overrides["data_dir"] = data_dir
    if repo is not None:
        overrides["repo"] = repo
    for name, value in (("cluster", cluster), ("advertise", advertise), ("node_id", node_id)):
        if value is not None:
            overrides[name] = value
    try:
        settings = Settings(**overrides)
        check_settings(settings)
    except ValidationError as exc:
        for problem in exc.errors():
            where = ".".join(str(part) for part in problem["loc"])
            err.print(f"[red]error:[/red] AENV_{where.upper()}: {problem['msg']}")
        raise typer.Exit(2) from None
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    try:
        asyncio.run(serve(settings))
    except AenvError as exc:  # the port or the data dir taken, a failed `base` build: no traceback
        from rich.markup import escape

        err.print(f"[red]error:[/red] {escape(exc.message)}")  # log lines may hold [brackets]
        raise typer.Exit(1) from None


@app.command()
def gateway(
    cluster: str = typer.Option(
        None, "--cluster", help="The cluster's etcd: etcd[s]://H1:P1,... [default: $AENV_CLUSTER]"
    ),
    host: str = typer.Option("127.0.0.1", help="Address to listen on"),
    port: int = typer.Option(8080, help="Port"),
    ws_max_message_mb: int = typer.Option(
        16, "--ws-max-message-mb", min=1, help="Largest WebSocket message relayed either way (larger: close 1009)"
    ),
    create_timeout: float = typer.Option(
        120.0, "--create-timeout", min=0.1, help="Seconds a node has to answer a create before it is tried again"
    ),
    domain: str | None = typer.Option(
        None, "--domain", help="Domain mode: api.DOMAIN is the control plane, <port>-<id>.DOMAIN a sandbox's port"
    ),
    tls_cert: Path = typer.Option(None, "--tls-cert", help="Serve HTTPS with this PEM certificate (chain)"),
    tls_key: Path = typer.Option(None, "--tls-key", help="The certificate's PEM private key"),
) -> None:
    """Run a gateway: one URL in front of the cluster's nodes (docs/cluster.md)."""
    from aenv.api.connections import check_tls
    from aenv.cluster.gateway import GatewaySettings, check_domain, serve_gateway
    from aenv.cluster.store import ClusterStore, EtcdTls, EtcdUser

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per forwarded request otherwise
    cluster = cluster or os.environ.get("AENV_CLUSTER", "")
    if not cluster:
        err.print("[red]error:[/red] --cluster etcd://HOST:PORT[,...] (or AENV_CLUSTER) is needed")
        raise typer.Exit(2)
    api_key = os.environ.get("AENV_API_KEY", "")
    if not api_key:  # the nodes' key: the gateway's own routes (the node list) need it too
        err.print("[red]error:[/red] AENV_API_KEY (the cluster's API key, as the nodes have it) is needed")
        raise typer.Exit(2)
    cluster_tls = EtcdTls.from_env(os.environ)
    try:
        cluster_user = EtcdUser.from_env(os.environ)
        ClusterStore.from_url(cluster, tls=cluster_tls)  # the URL and the TLS files checked (no connection yet)
        domain = check_domain(domain) if domain else None
        check_tls(tls_cert, tls_key)
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(2) from None
    settings = GatewaySettings(
        cluster=cluster,
        api_key=api_key,
        ws_max_message_mb=ws_max_message_mb,
        create_timeout=create_timeout,
        domain=domain,
        tls_cert=str(tls_cert) if tls_cert else None,
        tls_key=str(tls_key) if tls_key else None,
        cluster_tls=cluster_tls,
        cluster_user=cluster_user,
    )
    try:
        asyncio.run(serve_gateway(settings, host=host, port=port))
    except AenvError as exc:  # the port taken: one line, no traceback
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None


@app.command("etcd-auth")
def etcd_auth(
    cluster: str = typer.Option(None, "--cluster", help="etcd://H1:P1,... (or AENV_CLUSTER)"),
    root_password_file: Path = typer.Option(..., "--root-password-file", help="etcd's root user's password"),
    node_password_file: Path = typer.Option(
        None, "--node-password-file", help="aenv-node's password [default: random: it logs in by certificate]"
    ),
    gateway_password_file: Path = typer.Option(
        None, "--gateway-password-file", help="aenv-gateway's password [default: random: by certificate]"
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """Turn etcd's auth on for a cluster: etcd's root user, and the users and roles aenv-node
    (everything under /aenv/) and aenv-gateway (reads; writes sandbox entries and tombstones only).
    Run it again to change the passwords given (a user given none keeps its own). Nodes and
    gateways then log in with AENV_CLUSTER_USER
    and AENV_CLUSTER_PASSWORD_FILE, or by a client certificate whose CN is the user
    (docs/cluster.md, "etcd users and roles")."""
    from aenv.cluster.auth import GATEWAY_USER, NODE_USER, enable_auth
    from aenv.cluster.store import EtcdTls

    cluster = cluster or os.environ.get("AENV_CLUSTER", "")
    if not cluster:
        err.print("[red]error:[/red] --cluster etcd://HOST:PORT[,...] (or AENV_CLUSTER) is needed")
        raise typer.Exit(2)

    def secret(path: Path | None) -> str | None:
        if path is None:
            return None
        try:
            value = path.read_text(errors="replace")[:1025].removesuffix("\n")
        except OSError as exc:
            raise AenvError(f"cannot read {path}: {exc.strerror}") from None
        if not value or len(value) > 1024:
            raise AenvError(f"{path} must hold a password of 1 to 1024 characters")
        return value

    try:
        root = secret(root_password_file)
        assert root is not None
        passwords = {NODE_USER: secret(node_password_file), GATEWAY_USER: secret(gateway_password_file)}
        report = asyncio.run(enable_auth(cluster, root, passwords, tls=EtcdTls.from_env(os.environ)))
    except AenvError as exc:
        err.print(f"[red]error:[/red] {exc.message}")
        raise typer.Exit(1) from None
    rows = [{"user": user, "role": user, "may": ", ".join(grants)} for user, grants in report.users.items()]
    if as_json or not out.is_terminal:
        print(json.dumps({"enabledNow": report.enabled_now, "users": rows}))
        return
    _emit(rows, ["user", "role", "may"])
    out.print("etcd's auth turned on" if report.enabled_now else "etcd's auth was on already: users and roles updated")
