"""A sandbox's network as E2B's ``network`` object sets it: the egress rules aenv enforces, the
ingress options (public traffic, a masked Host), and what E2B has that aenv refuses as E2B refuses
it to a team without it; on create and through ``PUT /sandboxes/{id}/network``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any

from fastapi import APIRouter, Request, Response

from aenv.api.proxy import PORT_PLACEHOLDER
from aenv.api.sandboxes.requests import _body, json_body, node_of
from aenv.api.schemas import NetworkUpdate, NewSandbox
from aenv.errors import Forbidden, InvalidRequest, snippet
from aenv.node.service import Transforms

router = APIRouter()


# What E2B's SandboxNetworkConfig has (the SDKs send each only when it is set).
CREATE_NETWORK_FIELDS = frozenset(
    {"allowOut", "denyOut", "allowPublicTraffic", "maskRequestHost", "rules", "egressProxy", "dnsServers", "httpsPorts"}
)
# What E2B's SandboxNetworkUpdateConfig has (allow_internet_access apart), and the ingress fields
# refused unless left as they are: the update replaces every rule, so a misspelt one ignored would
# open the sandbox (`allowout` cleared a denyOut of 0.0.0.0/0).
UPDATE_NETWORK_FIELDS = frozenset(
    {"allowOut", "denyOut", "rules", "egressProxy", "dnsServers", "allowPublicTraffic", "maskRequestHost"}
)


def unbuilt_features(body: NewSandbox) -> None:
    """E2B features aenv does not have, refused as E2B refuses them to a team without them (a
    sandbox without its workload tokens is not the one asked for); empty is fine."""
    if body.iam is not None and body.iam.tokens:
        raise InvalidRequest("Sandbox IAM workload tokens are not available for your team.")


def egress_rules(
    network: Any, *, field: str = "network.egressProxy", known: frozenset[str] | None = None
) -> dict[str, Any]:
    """The part of E2B's `network` object that aenv enforces (allowOut, denyOut, rules: headers
    the node sets on requests, aenv/node/transforms.py).

    An egress proxy is refused as E2B refuses them to a team without them
    (docs/architecture.md, Egress, says why aenv has neither); ``field`` names the proxy's field
    as E2B's message for that endpoint does. With ``known``, any other field is a 400."""
    if network is None:
        return {}
    if not isinstance(network, dict):
        raise InvalidRequest("network must be an object")
    unknown = sorted(set(network) - known) if known is not None else []
    if unknown:
        raise InvalidRequest(f"invalid request body: network.{snippet(unknown[0], 64)}: Extra inputs are not permitted")
    _dns_servers(network.get("dnsServers"))
    if network.get("httpsPorts"):
        # a port proxy that speaks TLS to the sandbox's server: not built (the proxy speaks HTTP)
        raise InvalidRequest("HTTPS sandbox ports (network.httpsPorts) are not available for your team.")
    if network.get("rules") is not None:
        Transforms.parse(network["rules"])  # the 400 now, not at the first request
    if network.get("egressProxy") is not None:
        raise Forbidden(f"Egress proxy ({field}) is not enabled for this team.")
    out = {}
    for key in ("allowOut", "denyOut", "rules"):
        value = network.get(key)
        if value is None:
            continue
        if key != "rules" and (not isinstance(value, list) or not all(isinstance(v, str) for v in value)):
            raise InvalidRequest(f"network.{key} must be a list of strings")
        out[key] = value
    return out


MAX_DNS_SERVERS = 16


def _dns_servers(servers: Any) -> None:
    """E2B's ``dnsServers`` (name servers a sandbox may reach when ``allowOut`` names a domain),
    checked as E2B checks them. Nothing to open here: a sandbox's names are looked up by its node."""
    if servers is None:
        return
    if not isinstance(servers, list) or len(servers) > MAX_DNS_SERVERS:
        raise InvalidRequest(f"network.dnsServers must be a list of at most {MAX_DNS_SERVERS} IPv4 addresses")
    for server in servers:
        try:
            if not isinstance(server, str):
                raise ValueError(server)  # IPv4Address takes an int too
            ipaddress.IPv4Address(server)
        except ValueError:
            shown = snippet(server, 64) if isinstance(server, str) else type(server).__name__
            raise InvalidRequest(f"network.dnsServers: {shown!r} is not an IPv4 address") from None


MAX_MASK_REQUEST_HOST = 255
# What may stand in the Host header a port receives: a name or an [IPv6] literal, and a port.
MASK_REQUEST_HOST = re.compile(r"(?:[A-Za-z0-9_.-]+|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?")


def ingress_options(network: Any, *, secure: bool) -> tuple[bool, str]:
    """(public traffic, mask request host) from E2B's `network` object, checked as E2B checks them."""
    if not isinstance(network, dict):
        return True, ""
    public = network.get("allowPublicTraffic", True)
    if public is None:
        public = True
    if not isinstance(public, bool):
        raise InvalidRequest("network.allowPublicTraffic must be a boolean")
    mask = network.get("maskRequestHost")
    if mask is None:
        mask = ""
    if not isinstance(mask, str):
        raise InvalidRequest("network.maskRequestHost must be a string")
    if not mask.isascii():
        raise InvalidRequest(f"mask request host '{snippet(mask)}' is not ASCII. Please use ASCII characters only.")
    # ${PORT} becomes a port number on each request; what it makes must be a host, whatever the port
    if mask and (
        len(mask) > MAX_MASK_REQUEST_HOST or not MASK_REQUEST_HOST.fullmatch(mask.replace(PORT_PLACEHOLDER, "1"))
    ):
        raise InvalidRequest(f"mask request host is not valid: {snippet(mask)}")
    if not public and not secure:
        raise InvalidRequest(
            "You cannot create a sandbox without public access unless you enable secure envd access via 'secure' flag."
        )
    return public, mask


@router.put(
    "/sandboxes/{sandbox_id}/network",
    status_code=204,
    summary="Replace the sandbox's egress rules",
    openapi_extra=json_body(NetworkUpdate),
)
async def update_network(request: Request, sandbox_id: str) -> Response:
    body: NetworkUpdate = await _body(request, NetworkUpdate)
    update = body.model_dump(by_alias=True)
    # E2B's update has no ingress fields and would ignore them; refused instead, so nobody believes
    # a running sandbox's ports were made private (or its Host masked) when they were not.
    if update.get("allowPublicTraffic") is False or update.get("maskRequestHost") is not None:
        raise InvalidRequest("network.allowPublicTraffic and network.maskRequestHost are set when a sandbox is created")
    internet = update.pop("allow_internet_access", None)
    rules = egress_rules(update, field="egressProxy", known=UPDATE_NETWORK_FIELDS)
    # The update replaces the whole egress configuration, internet access included: left out, it
    # is the default again (Harbor's `{}` for a public phase after a no-network one).
    node = node_of(request)
    await node.set_network(sandbox_id, rules, node.settings.internet_by_default if internet is None else internet)
    return Response(status_code=204)
