"""The host's end of egress: each sandbox's network policy, decided and enforced here.

The guest agent's proxy (aenv/guest/egress.py) turns every outbound connection into an
``egress.connect`` stream naming a host and port. Here the name is resolved, every address is
checked against the sandbox's policy, and only then is a TCP connection made: from this node,
to the address that was checked (so a DNS answer cannot change between check and use).

Policy, in order (E2B's fields: ``allow_internet_access``, ``network.allowOut``/``denyOut``):
1. loopback, link-local, multicast, unspecified and reserved addresses are never reachable
   (this node's own services and cloud metadata endpoints live there);
2. a private address (RFC 1918, CGNAT, ULA, ...) or one of this node's own (any interface's, a
   gateway's) is *inside*: only an ``allowOut`` address or CIDR that names it opens it, not a
   domain rule (a name can resolve anywhere: DNS rebinding) and not the catch-all 0.0.0.0/0;
3. a destination in ``allowOut`` (CIDR, address, domain or ``*.domain``) is allowed;
4. a destination in ``denyOut`` is denied;
5. without internet access everything else is denied;
6. with it, the rest (public addresses) is allowed.

A host with a ``network.rules`` transform (aenv/node/transforms.py) is reached the same way, but its
HTTP (80) and HTTPS (443) connections are relayed request by request (aenv/node/intercept.py) so
that the node, never the sandbox, fills in the team's secrets.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import os
import re
import socket
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from aenv.channel import ChannelClosed, Stream, splice
from aenv.errors import AenvError, InvalidRequest
from aenv.guest.egress import valid_name
from aenv.node.intercept import Interceptor
from aenv.node.metrics import EGRESS
from aenv.node.transforms import NO_TRANSFORMS, Rule, Transforms

log = logging.getLogger("aenv.egress")

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[list[Address]]]
T = TypeVar("T")

INTERCEPTED_PORTS = {80: False, 443: True}  # where a rule's headers are set: port -> TLS (HTTPS)
RESOLVE_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10.0
NODE_ADDRESSES_TTL = 5.0  # how long this node's own addresses are taken as known
ALL_TRAFFIC = "0.0.0.0/0"
LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
DOMAIN = re.compile(rf"(?:\*\.)?(?:{LABEL}\.)*{LABEL}")
THIS_NETWORK = ipaddress.ip_network("0.0.0.0/8")  # Linux connects 0.x to this node itself
RTF_GATEWAY = 0x2


def never_reachable(addr: Address) -> bool:
    """Loopback, link-local (cloud metadata), multicast, unspecified, reserved or 0.0.0.0/8: the
    node's own services and its cloud's live there."""
    return (
        addr.is_loopback
        or addr.is_link_local
        or addr.is_multicast
        or addr.is_unspecified
        or addr.is_reserved
        or addr in THIS_NETWORK
    )


def plain(addr: Address) -> Address:
    """IPv6 that carries an IPv4 address to where it leads is judged as that address: IPv4-mapped
    (::ffff:127.0.0.1) and 6to4 (2002:a00:1::, tunnelled to 10.0.0.1 where 6to4 is routed).
    NAT64's 64:ff9b::/96 is reserved, hence never reachable."""
    if isinstance(addr, ipaddress.IPv6Address):
        return addr.ipv4_mapped or addr.sixtofour or addr
    return addr


def _lines(path: str) -> list[str]:
    try:
        return Path(path).read_text().splitlines()
    except OSError:
        return []


def _read_node_addresses() -> frozenset[Address]:
    found: set[Address] = set()
    last = ""
    for line in _lines("/proc/net/fib_trie"):  # "|-- 192.0.2.2" then "/32 host LOCAL": a local address
        text = line.strip()
        if text.startswith("|-- "):
            last = text[4:]
        elif text.endswith("host LOCAL") and last:
            found.add(ipaddress.ip_address(last))
    for line in _lines("/proc/net/if_inet6"):
        found.add(ipaddress.IPv6Address(int(line.split()[0], 16)))
    for line in _lines("/proc/net/route")[1:]:
        fields = line.split()
        if len(fields) > 3 and int(fields[3], 16) & RTF_GATEWAY:
            found.add(ipaddress.IPv4Address(int(fields[2], 16).to_bytes(4, "little")))
    for line in _lines("/proc/net/ipv6_route"):
        fields = line.split()
        if len(fields) > 8 and int(fields[8], 16) & RTF_GATEWAY:
            found.add(ipaddress.IPv6Address(int(fields[4], 16)))
    return frozenset(found)


_node_addresses: tuple[float, frozenset[Address]] = (-NODE_ADDRESSES_TTL, frozenset())


def node_addresses() -> frozenset[Address]:
    """This node's own addresses (every interface's, from the kernel's local table) and its gateways'."""
    global _node_addresses
    read_at, addresses = _node_addresses
    if time.monotonic() - read_at >= NODE_ADDRESSES_TTL:
        addresses = _read_node_addresses()
        _node_addresses = (time.monotonic(), addresses)
    return addresses


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

    def has_address(self, addr: Address, *, named: bool = False) -> bool:
        """``addr`` is in one of the networks (``named``: one narrower than all traffic)."""
        return any(
            addr.version == net.version and addr in net and (net.prefixlen > 0 or not named) for net in self.networks
        )

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
    transforms: Transforms = NO_TRANSFORMS  # network.rules: headers set on requests (they open nothing)

    @classmethod
    def of(cls, internet: bool, network: dict[str, Any] | None) -> EgressPolicy:
        network = network or {}
        return cls(
            internet=internet,
            allow=Rules.parse(network.get("allowOut"), what="allowOut", domains_allowed=True),
            deny=Rules.parse(network.get("denyOut"), what="denyOut", domains_allowed=False),
            transforms=Transforms.parse(network.get("rules")),
        )

    def may_resolve(self, host: str) -> bool:
        """Whether any address ``host`` resolves to could be allowed. The host's resolver is asked
        only then: a sandbox without internet access must not use it to send names out (DNS
        exfiltration) or to probe the node's own DNS."""
        return self.internet or bool(self.allow.networks) or self.allow.has_domain(host)

    def check(self, host: str, addr: Address, node: Collection[Address] | None = None) -> str | None:
        """None if ``addr`` (which ``host`` resolved to) may be reached, else the reason not.

        ``node``: this node's own addresses (read from the kernel when not given)."""
        addr = plain(addr)
        if never_reachable(addr):
            return f"{host} ({addr}) is a loopback, link-local or reserved address, never reachable from a sandbox"
        inside = not addr.is_global or addr in (node_addresses() if node is None else node)
        if self.allow.has_address(addr, named=inside) or (not inside and self.allow.has_domain(host)):
            return None
        if self.deny.has_address(addr):
            return f"{host} ({addr}) is in this sandbox's denyOut list"
        if not self.internet:
            return f"this sandbox has no internet access and {host} is not in its allowOut list"
        if inside:
            return (
                f"{host} ({addr}) is a private address or this node's own; only an allowOut entry naming it "
                "(the address, or a CIDR narrower than 0.0.0.0/0) opens it"
            )
        return None


def destination(params: dict[str, Any]) -> tuple[str, int] | None:
    """(host, port) if ``params`` name a DNS name (as the guest's proxy checks it) or an IP literal
    (no zone id) and a TCP port: all a guest may ask for. Anything else never reaches the resolver."""
    host, port = params.get("host"), params.get("port")
    if not isinstance(host, str) or not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        return None
    if len(host) > 253 or "%" in host:
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return (host, port) if valid_name(host) else None
    return host, port


def _literal(host: str) -> Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


# Lookups run on threads of their own: a lookup whose servers never answer holds its thread for the
# resolver's whole timeout (well past RESOLVE_TIMEOUT), and a sandbox asking for such names must not
# fill the event loop's default executor, which the node's mounts and file work run on.
RESOLVERS = ThreadPoolExecutor(max_workers=16, thread_name_prefix="egress-dns")
LOOKUPS_PER_SANDBOX = 4  # of those threads, what one sandbox may hold at once
DENIED_LOG_EVERY = 10.0  # seconds between two "egress denied" lines of one sandbox


HOSTS_ENV = "AENV_EGRESS_HOSTS"


@functools.cache
def static_hosts(spec: str | None = None) -> dict[str, Address]:
    """The operator's fixed names for sandboxes' egress (``AENV_EGRESS_HOSTS``, "name=address,..."),
    answered before DNS as /etc/hosts entries would be: an internal API's name where the node's DNS
    has none, a test's receiver. The policy still checks the address (a private one needs allowOut)."""
    if spec is None:
        spec = os.environ.get(HOSTS_ENV, "")
    out: dict[str, Address] = {}
    for entry in filter(None, (part.strip() for part in spec.split(","))):
        name, sep, addr = entry.partition("=")
        name = name.strip().lower().rstrip(".")
        literal = _literal(addr.strip())
        if not sep or not name or literal is None or _literal(name) is not None:
            raise InvalidRequest(f"{HOSTS_ENV}: {entry!r} is not name=address")
        out[name] = literal
    return out


async def resolve(host: str, port: int) -> list[Address]:
    if (literal := _literal(host)) is not None:
        return [literal]
    if (fixed := static_hosts().get(host.lower().rstrip("."))) is not None:
        return [fixed]
    lookup = functools.partial(socket.getaddrinfo, host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    infos = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(RESOLVERS, lookup), RESOLVE_TIMEOUT)
    seen: list[Address] = []
    for *_, sockaddr in infos:
        addr = ipaddress.ip_address(sockaddr[0])
        if addr not in seen:
            seen.append(addr)
    return seen


class Refused(AenvError):
    """An egress.connect that ends without a connection: the stream's error and the outcome."""

    def __init__(self, code: str, message: str, outcome: str) -> None:
        super().__init__(message)
        self.code, self.outcome = code, outcome


class Abandoned(AenvError):
    """The guest ended the stream before it had its answer."""


async def connect(
    host: str, port: int, policy: EgressPolicy, *, resolver: Resolver = resolve, node: Collection[Address] | None = None
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Address]:
    """Resolve ``host``, check every address and connect to the first allowed one that answers."""
    literal = _literal(host)
    if literal is None and not policy.may_resolve(host):
        reason = f"this sandbox has no internet access and {host} is not in its allowOut list"
        raise Refused("permission_denied", f"egress to {host}:{port} denied: {reason}", "denied")
    try:
        addrs = [literal] if literal is not None else await resolver(host, port)
    except (OSError, TimeoutError, UnicodeError) as exc:
        raise Refused("unavailable", f"cannot resolve {host}: {exc}", "unresolved") from None
    reasons = [policy.check(host, addr, node) for addr in addrs]
    allowed = [addr for addr, reason in zip(addrs, reasons, strict=True) if reason is None]
    if not allowed or any(never_reachable(plain(addr)) for addr in addrs):  # one bad address taints the name
        reason = next((r for r in reasons if r), f"{host} has no address")
        raise Refused("permission_denied", f"egress to {host}:{port} denied: {reason}", "denied")
    last: Exception | None = None
    for addr in allowed:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(str(addr), port), CONNECT_TIMEOUT)
        except (OSError, TimeoutError) as exc:
            last = exc
        else:
            return reader, writer, addr
    raise Refused("unavailable", f"cannot connect to {host}:{port}: {last}", "unreachable")


async def _unless_abandoned(stream: Stream, work: Coroutine[Any, Any, T]) -> T:
    """``work``, unless the guest ends the stream first (before our answer it sends nothing else)."""
    attempt = asyncio.ensure_future(work)
    given_up = asyncio.ensure_future(stream.recv())
    try:
        await asyncio.wait({attempt, given_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        given_up.cancel()
        if not attempt.done():
            attempt.cancel()
            await asyncio.wait({attempt})  # a cancelled connect closes its own socket
    if attempt.cancelled():
        raise Abandoned("the guest ended the stream before its answer")
    return attempt.result()


async def serve_connect(
    stream: Stream,
    policy: EgressPolicy,
    *,
    resolver: Resolver = resolve,
    held: Connections | None = None,
    interceptor: Interceptor | None = None,
) -> str:
    """Carry out one ``egress.connect``; returns how it ended (for metrics and logs). ``held``
    records the connection while it is open, so that new rules can end it (:meth:`Guest.recheck`).
    A host with a ``network.rules`` transform on port 443 or 80 goes through ``interceptor`` (its
    requests get the rule's headers); without one such a connection is refused, never made bare."""
    dest = destination(stream.params)
    if dest is None:
        host, port = stream.params.get("host"), stream.params.get("port")
        await stream.end(error=("invalid_argument", f"bad destination {str(host)[:300]!r}:{str(port)[:20]!r}"))
        return "invalid"
    host, port = dest
    rule = policy.transforms.match(host) if port in INTERCEPTED_PORTS else None
    if rule is not None and interceptor is None:
        await stream.end(error=("unavailable", f"egress to {host}:{port}: this node cannot apply network.rules"))
        return "unavailable"
    try:
        reader, writer, addr = await _unless_abandoned(stream, connect(host, port, policy, resolver=resolver))
    except Refused as exc:
        await stream.end(error=(exc.code, exc.message))
        return exc.outcome
    except Abandoned:
        return "abandoned"
    revoked = asyncio.Event()
    if held is not None:
        held[revoked] = (host, addr, rule)
    try:
        await stream.send({"ok": True, "address": str(addr)})
        if rule is not None and interceptor is not None:
            await interceptor.run(stream, reader, writer, host, rule, tls=INTERCEPTED_PORTS[port], until=revoked)
        else:
            await splice(stream, reader, writer, until=revoked)
    except ChannelClosed:  # the guest ended the stream right after our answer
        return "abandoned"
    finally:
        writer.close()
        if held is not None:
            held.pop(revoked, None)
    if revoked.is_set():
        message = f"egress to {host}:{port} ended: this sandbox's network rules no longer allow {addr}"
        await stream.end(error=("permission_denied", message))
        return "revoked"
    await stream.end()
    return "connected"


# The connections a sandbox holds open: each one's "end it" event, where it goes and the
# network.rules rule its requests get (None: spliced, untouched).
Connections = dict[asyncio.Event, tuple[str, Address, Rule | None]]


def build_guest(label: str, internet: bool, allow_out: Collection[str] = ()) -> Guest:
    """The egress of a template build's sandbox: public addresses when ``internet`` (a RUN step's
    apt-get or pip install) and what ``allow_out`` names (a private mirror), under the same checks
    as a sandbox's (never a private address or one of the node's own otherwise)."""
    policy = EgressPolicy.of(internet, {"allowOut": list(allow_out)})
    return Guest(label, lambda: policy)


class Guest:
    """The handler of the streams one sandbox's agent opens (its egress connections); ``policy_of``
    reads the current policy, so a changed policy applies to the next connection, and
    :meth:`recheck` applies it to those already open."""

    def __init__(
        self, sandbox_id: str, policy_of: Callable[[], EgressPolicy], interceptor: Interceptor | None = None
    ) -> None:
        self.sandbox_id = sandbox_id
        self.policy_of = policy_of
        self.interceptor = interceptor
        self.connections: Connections = {}
        self._lookups = asyncio.Semaphore(LOOKUPS_PER_SANDBOX)
        self._denied_logged_at = -DENIED_LOG_EVERY
        self._denied_unlogged = 0

    async def __call__(self, stream: Stream) -> None:
        if stream.method != "egress.connect":
            await stream.end(error=("unimplemented", f"the host serves no {stream.method!r}"))
            return
        try:
            policy = self.policy_of()
        except AenvError as exc:
            await stream.end(error=("unavailable", str(exc)))
            return
        outcome = await serve_connect(
            stream, policy, resolver=self._resolve, held=self.connections, interceptor=self.interceptor
        )
        EGRESS.labels(outcome=outcome).inc()
        if outcome == "denied":
            self._log_denied(str(stream.params.get("host"))[:253])

    def _log_denied(self, host: str) -> None:
        """At most one line per DENIED_LOG_EVERY seconds and sandbox, with how many were left out:
        the sandbox decides how often it is refused, and must not fill the node's log (the
        aenv_egress_connections_total metric counts every one)."""
        now = time.monotonic()
        if now - self._denied_logged_at < DENIED_LOG_EVERY:
            self._denied_unlogged += 1
            return
        more = f" (and {self._denied_unlogged} more since)" if self._denied_unlogged else ""
        log.info("egress denied%s", more, extra={"sandbox_id": self.sandbox_id, "host": host})
        self._denied_logged_at, self._denied_unlogged = now, 0

    async def _resolve(self, host: str, port: int) -> list[Address]:
        """:func:`resolve`, a few at a time: a sandbox whose lookups never end waits for its own."""
        async with self._lookups:
            return await resolve(host, port)

    def recheck(self) -> int:
        """End the open connections the current policy refuses (a denyOut added, an allowOut taken
        away, internet access turned off); how many."""
        policy = self.policy_of()
        ended = 0
        for revoked, (host, addr, rule) in list(self.connections.items()):
            # a changed or removed rule ends its connections too: their next request must not
            # carry a secret the rules no longer send there
            changed = rule is not None and policy.transforms.match(host) != rule
            if changed or policy.check(host, addr) is not None:
                revoked.set()
                ended += 1
        return ended
