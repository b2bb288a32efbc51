"""Where a registry pull may send the node, and how much of an answer it reads.

Anyone with an API key names the registry (``POST /templates/from-image``, a Dockerfile's
``FROM``, E2B's ``fromImage``), and a registry names further URLs: the token service of a
``WWW-Authenticate: Bearer realm=...`` challenge, and redirects (blobs usually move to object
storage). All of them go through one :class:`RegistryGuard`, the network backend of the pull's
HTTP client, so no request can skip it:

- only http and https, and plain http only when the registry itself is spoken to over http;
- every name is resolved once per pull and the connection is made to the address that was
  checked (a second DNS answer cannot move it);
- link-local (cloud metadata), multicast, unspecified and reserved addresses are never reached;
- other places rank public < private < loopback, and a realm or redirect may not lead to a
  rank above the registry's own: a public registry reaches public addresses only, an internal
  registry its internal token service, and only a registry on this node this node's loopback;
- redirects are bounded (:func:`send_following`, which never reads a redirect's body); answers
  are read with a bound (:func:`read_bounded`), every read and connect has a timeout, and
  upstream text reaches an error message only as a short, sanitised snippet.
"""

from __future__ import annotations

import enum
import ssl
from collections.abc import Iterable

import httpcore
import httpx

from aenv.errors import InvalidRequest, UpstreamError, snippet
from aenv.node.egress import Address, never_reachable, plain, resolve

MAX_REDIRECTS = 5
CONNECT_TIMEOUT = 10.0
READ_TIMEOUT = 60.0  # between two reads of one answer


class Reach(enum.IntEnum):
    """How far inside a network an address is; ranked, so a ceiling can be compared."""

    PUBLIC = 0
    PRIVATE = 1  # RFC 1918, unique local, shared address space: an operator's internal network
    LOOPBACK = 2  # this node
    NEVER = 3

    def __str__(self) -> str:
        if self is Reach.NEVER:
            return "link-local, multicast or reserved"
        return "loopback (this node)" if self is Reach.LOOPBACK else self.name.lower()


def reach_of(addr: Address) -> Reach:
    addr = plain(addr)
    if addr.is_loopback:
        return Reach.LOOPBACK
    if never_reachable(addr):
        return Reach.NEVER
    return Reach.PUBLIC if addr.is_global else Reach.PRIVATE


async def read_bounded(response: httpx.Response, limit: int, what: str) -> bytes:
    """The whole body of ``response``, refused past ``limit`` bytes (counted as decoded, should a
    server compress what it was asked not to: one read decompresses at most ~1000 times its size)."""
    declared = response.headers.get("content-length", "")
    if declared.isdecimal() and int(declared) > limit:
        raise UpstreamError(f"{what} is {declared} bytes, more than the {limit} it may be", status=502)
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            raise UpstreamError(f"{what} is more than the {limit} bytes it may be", status=502)
    return bytes(body)


async def send_following(
    client: httpx.AsyncClient, request: httpx.Request, auth: tuple[str, str] | None = None
) -> httpx.Response:
    """Send ``request``, following at most MAX_REDIRECTS redirects; the answer is returned unread
    (stream it or read it with :func:`read_bounded`, then close it). A redirect's own body is
    never read, and ``auth`` goes with the first request only (httpx keeps an Authorization
    header on a redirect within the same origin and drops it on any other)."""
    response = await client.send(request, stream=True, auth=auth, follow_redirects=False)
    for _ in range(MAX_REDIRECTS):
        if response.next_request is None:
            return response
        await response.aclose()
        response = await client.send(response.next_request, stream=True, follow_redirects=False)
    if response.next_request is None:
        return response
    await response.aclose()
    raise UpstreamError(f"{snippet(request.url.host)} redirected the node more than {MAX_REDIRECTS} times", status=502)


class RegistryGuard(httpcore.AsyncNetworkBackend):
    """The network backend of one pull's HTTP client: every connection it makes is checked here."""

    def __init__(self, registry_url: httpx.URL) -> None:
        self.registry_host = registry_url.raw_host.decode("ascii").lower()  # as httpcore names it to connect_tcp
        self.plain_http = registry_url.scheme == "http"
        self._inner = httpcore.AnyIOBackend()
        self._resolved: dict[str, list[Address]] = {}

    def check_url(self, url: httpx.URL) -> None:
        """Every request, redirects included, passes here before it is sent."""
        if url.scheme not in ("http", "https") or (url.scheme == "http" and not self.plain_http):
            raise UpstreamError(
                f"registry {self.registry_host} sent the node to {snippet(str(url))}: only https "
                f"(http for a registry spoken to over http) is followed",
                status=502,
            )

    async def _addresses(self, host: str, port: int) -> list[Address]:
        if host not in self._resolved:
            try:
                addrs = await resolve(host, port)
            except (OSError, TimeoutError) as exc:
                raise httpcore.ConnectError(f"cannot resolve {snippet(host)}: {exc}") from exc
            if not addrs:
                raise httpcore.ConnectError(f"{snippet(host)} has no address")
            self._resolved[host] = addrs
        return self._resolved[host]

    async def allowed(self, host: str, port: int) -> list[Address]:
        """The addresses of ``host`` the pull may connect to, or why none."""
        host = host.lower()
        addrs = await self._addresses(host, port)
        worst = max(addrs, key=reach_of)
        if host == self.registry_host:
            if reach_of(worst) is Reach.NEVER:
                raise InvalidRequest(f"registry {host} is at {worst}, a {Reach.NEVER} address: never reached")
            return addrs
        ceiling = min(reach_of(a) for a in await self._addresses(self.registry_host, port))
        if reach_of(worst) > ceiling:
            raise UpstreamError(
                f"registry {self.registry_host} sent the node to {snippet(host)} ({worst}), a {reach_of(worst)} "
                f"address, from a {ceiling} registry: refused",
                status=502,
            )
        return addrs

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,
        local_address: str | None = None,
        socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        last: Exception | None = None
        for addr in await self.allowed(host, port):
            try:
                return await self._inner.connect_tcp(str(addr), port, timeout, local_address, socket_options)
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                last = exc
        assert last is not None
        raise last

    async def connect_unix_socket(
        self, path: str, timeout: float | None = None, socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None
    ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("a registry pull connects over TCP only")

    async def sleep(self, seconds: float) -> None:
        await self._inner.sleep(seconds)


class GuardedTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with the guard as its network backend and URL check."""

    def __init__(self, guard: RegistryGuard, ssl_context: ssl.SSLContext) -> None:
        super().__init__(verify=ssl_context)
        self.guard = guard
        self._pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=guard)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.guard.check_url(request.url)
        return await super().handle_async_request(request)


def guarded_client(registry_url: httpx.URL, read_timeout: float = READ_TIMEOUT) -> httpx.AsyncClient:
    """An HTTP client for one pull from the registry at ``registry_url``: every read has
    ``read_timeout`` (``AENV_REGISTRY_READ_TIMEOUT``). Proxies from the environment are not used:
    a proxy would make the connections the guard cannot check."""
    guard = RegistryGuard(registry_url)
    return httpx.AsyncClient(
        transport=GuardedTransport(guard, httpx.create_ssl_context()),
        timeout=httpx.Timeout(read_timeout, connect=CONNECT_TIMEOUT),
        trust_env=False,
        headers={"Accept-Encoding": "identity"},
    )
