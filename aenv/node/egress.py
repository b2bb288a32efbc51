"""The host's end of egress: each sandbox's network policy, decided and enforced here.

The guest agent's proxy (aenv/guest/egress.py) turns every outbound connection into an
``egress.connect`` stream naming a host and port. Here the name is resolved, every address is
checked against the sandbox's policy, and only then is a TCP connection made: from this node,
to the address that was checked (so a DNS answer cannot change between check and use).

Policy, in order (E2B's fields: ``allow_internet_access``, ``network.allowOut``/``denyOut``):
1. loopback, link-local, multicast and unspecified addresses are never reachable (this node's
   own services and cloud metadata endpoints live there);
2. a destination in ``allowOut`` (CIDR, address, domain or ``*.domain``) is allowed;
3. a destination in ``denyOut`` is denied;
4. without internet access everything else is denied;
5. with it, public (globally routable) addresses are allowed and private ones are not: a
   private range has to be named in ``allowOut``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aenv.channel import OpenHandler, Stream, splice
from aenv.errors import AenvError, InvalidRequest
from aenv.node.metrics import EGRESS

log = logging.getLogger("aenv.egress")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

RESOLVE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
ALL_TRAFFIC = "0.0.0.0/0"
LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
DOMAIN = re.compile(rf"(?:\*\.)?(?:{LABEL}\.)*{LABEL}")


def never_reachable(addr: Address) -> bool:
    """Loopback, link-local (cloud metadata), multicast, unspecified or reserved: the node's own
    services and its cloud's live there."""
    return addr.is_loopback or addr.is_link_local or addr.is_multicast or addr.is_unspecified or addr.is_reserved


def plain(addr: Address) -> Address:
    """IPv4-mapped IPv6 (::ffff:127.0.0.1) is judged as the IPv4 address it is."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


@dataclass(frozen=True)
class Rules:
    networks: tuple[Network, ...] = ()
    domains: tuple[str, ...] = ()  # "example.com" or "*.example.com", lower case

    @classmethod
    def parse(cls, entries: list[str] | None, *, what: str, domains_allowed: bool) -> Rules:
        nets: list[Network] = []
        names: list[str] = []
        for raw in entries or []:
            entry = str(raw).strip().lower()
            try:
                net = ipaddress.ip_network(entry, strict=False)
            except ValueError:
                pass
            else:
                nets.append(net)
                if entry == ALL_TRAFFIC:  # E2B's "all traffic" covers IPv6 as well
                    nets.append(ipaddress.ip_network("::/0"))
                continue
            if not domains_allowed or not DOMAIN.fullmatch(entry):
                kind = "an IP, a CIDR or a domain" if domains_allowed else "an IP or a CIDR"
                raise InvalidRequest(f"network.{what}: {raw!r} is not {kind}")
            names.append(entry)
        return cls(tuple(nets), tuple(names))

    def has_address(self, addr: Address) -> bool:
        return any(addr.version == net.version and addr in net for net in self.networks)

    def has_domain(self, host: str) -> bool:
        host = host.lower().rstrip(".")
        for pattern in self.domains:
            if pattern.startswith("*."):
                if host.endswith(pattern[1:]):
                    return True
            elif host == pattern:
                return True
        return False


@dataclass(frozen=True)
class EgressPolicy:
    internet: bool = True
    allow: Rules = field(default_factory=Rules)
    deny: Rules = field(default_factory=Rules)

    @classmethod
    def of(cls, internet: bool, network: dict[str, Any] | None) -> EgressPolicy:
        network = network or {}
        return cls(
            internet=internet,
            allow=Rules.parse(network.get("allowOut"), what="allowOut", domains_allowed=True),
            deny=Rules.parse(network.get("denyOut"), what="denyOut", domains_allowed=False),
        )

    def check(self, host: str, addr: Address) -> str | None:
        """None if ``addr`` (which ``host`` resolved to) may be reached, else the reason not."""
        addr = plain(addr)
        if never_reachable(addr):
            return f"{host} ({addr}) is a loopback, link-local or reserved address, never reachable from a sandbox"
        if self.allow.has_domain(host) or self.allow.has_address(addr):
            return None
        if self.deny.has_address(addr):
            return f"{host} ({addr}) is in this sandbox's denyOut list"
        if not self.internet:
            return f"this sandbox has no internet access and {host} is not in its allowOut list"
        if not addr.is_global:
            return f"{host} ({addr}) is a private address; name it in allowOut to reach it"
        return None


async def resolve(host: str, port: int) -> list[Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), RESOLVE_TIMEOUT
    )
    seen: list[Address] = []
    for *_, sockaddr in infos:
        addr = ipaddress.ip_address(sockaddr[0])
        if addr not in seen:
            seen.append(addr)
    return seen


async def serve_connect(stream: Stream, policy: EgressPolicy) -> str:
    """Carry out one ``egress.connect``; returns how it ended (for metrics and logs)."""
    host = str(stream.params.get("host", ""))[:253]
    port = stream.params.get("port")
    if not host or not isinstance(port, int) or not 0 < port < 65536:
        await stream.end(error=("invalid_argument", f"bad destination {host!r}:{port!r}"))
        return "invalid"
    try:
        addrs = await resolve(host, port)
    except (OSError, TimeoutError) as exc:
        await stream.end(error=("unavailable", f"cannot resolve {host}: {exc}"))
        return "unresolved"
    reasons = [policy.check(host, addr) for addr in addrs]
    allowed = [addr for addr, reason in zip(addrs, reasons, strict=True) if reason is None]
    if not allowed or any(never_reachable(plain(addr)) for addr in addrs):  # one bad address taints the name
        reason = next((r for r in reasons if r), f"{host} has no address")
        await stream.end(error=("permission_denied", f"egress to {host}:{port} denied: {reason}"))
        return "denied"
    last: Exception | None = None
    for addr in allowed:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(str(addr), port), CONNECT_TIMEOUT)
            break
        except (OSError, TimeoutError) as exc:
            last = exc
    else:
        await stream.end(error=("unavailable", f"cannot connect to {host}:{port}: {last}"))
        return "unreachable"
    await stream.send({"ok": True, "address": str(addr)})
    await splice(stream, reader, writer)
    await stream.end()
    return "connected"


def guest_requests(sandbox_id: str, policy_of: Callable[[], EgressPolicy]) -> OpenHandler:
    """The handler for streams a sandbox's agent opens; ``policy_of`` reads the current policy,
    so a changed policy applies to the next connection."""

    async def serve(stream: Stream) -> None:
        if stream.method != "egress.connect":
            await stream.end(error=("unimplemented", f"the host serves no {stream.method!r}"))
            return
        try:
            policy = policy_of()
        except AenvError as exc:
            await stream.end(error=("unavailable", str(exc)))
            return
        outcome = await serve_connect(stream, policy)
        EGRESS.labels(outcome=outcome).inc()
        if outcome == "denied":
            log.info("egress denied", extra={"sandbox_id": sandbox_id, "host": stream.params.get("host")})

    return serve
