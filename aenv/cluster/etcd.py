"""The cluster store's connection to etcd: reaching it (members, TLS, a user), and one call at a time
with a deadline, logins and retries.

etcd v3 through `aetcd` (gRPC). Every failure to reach a quorum becomes ``ClusterUnavailable``
(503) within the call's deadline: requests carry etcd's "require leader" metadata, so a member cut
off from the others refuses at once instead of waiting for an election that cannot happen. What
the cluster keeps in etcd, and how it changes, is :mod:`aenv.cluster.store`'s.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Self, TypeVar
from urllib.parse import urlsplit

import aetcd
import aetcd.exceptions
import aetcd.rpc
import aetcd.watcher
import grpc

from aenv.errors import ClusterUnavailable, InvalidRequest

log = logging.getLogger("aenv.cluster")

T = TypeVar("T")

DEFAULT_TIMEOUT = 2.0  # seconds any one call may take
MAX_ENDPOINTS = 16
MAX_PEM = 256 * 1024  # a CA bundle, a certificate chain or a key
MAX_USER = 128
LOGIN_RETRY = 1.0  # seconds a failed login is the answer to every call, before one logs in again
MAX_PASSWORD = 1024
LEADER_CHANGED = "leader changed"  # etcd dropped the request: its leader changed meanwhile
ELECTION_PAUSE = 0.2  # seconds before a call dropped for a leader change is made again
# etcd refuses a request on a member that has no leader when this metadata is set (instead of
# holding it until an election that, without quorum, never comes).
REQUIRE_LEADER = (("hasleader", "true"),)
# Keepalive pings find a dead member behind a connection that never closes (etcd's default
# enforcement allows one every 5 s).
CHANNEL_OPTIONS: dict[str, int | str] = {
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
    "grpc.keepalive_permit_without_calls": 1,
    "grpc.max_receive_message_length": 64 * 2**20,
}


class WatchCompacted(ClusterUnavailable):
    """A watch cannot resume where it stopped: etcd compacted that history. Read everything again."""


@dataclass(frozen=True, slots=True)
class Endpoint:
    host: str
    port: int


@dataclass(frozen=True, slots=True)
class EtcdTls:
    """TLS to etcd (``etcds://``): PEM files of the CA that signed the members' certificates (the
    system's roots without one) and, for etcd's --client-cert-auth, this process's certificate and
    key."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EtcdTls:
        """AENV_CLUSTER_CA, AENV_CLUSTER_CERT, AENV_CLUSTER_KEY."""
        return cls(*(environ.get(f"AENV_CLUSTER_{name}") or None for name in ("CA", "CERT", "KEY")))

    def credentials(self) -> grpc.ChannelCredentials:
        """The channel's credentials, the files read now (a missing one is a clear error at start)."""
        if (self.cert is None) != (self.key is None):
            raise InvalidRequest("a client certificate for etcd needs its key, and the key its certificate")
        ca, cert, key = (_read_pem(path) for path in (self.ca, self.cert, self.key))
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)


def _read_pem(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_PEM + 1)
    except OSError as exc:
        raise InvalidRequest(f"cannot read {path[:200]}: {exc.strerror}") from None
    if len(data) > MAX_PEM or b"-----BEGIN " not in data:
        raise InvalidRequest(f"{path[:200]} is not a PEM file of at most {MAX_PEM // 1024} KiB")
    return data


@dataclass(frozen=True, slots=True)
class EtcdUser:
    """An etcd user this process logs in as, when etcd's auth is on (docs/cluster.md, etcd users
    and roles). Over TLS with client certificates etcd takes the user from the certificate's
    common name instead, and no password is needed."""

    name: str
    password: str = field(repr=False)

    @classmethod
    def load(cls, name: str | None, password_file: str | None, password: str | None = None) -> EtcdUser | None:
        """AENV_CLUSTER_USER with AENV_CLUSTER_PASSWORD_FILE (a file holding the password: what a
        Kubernetes Secret or a systemd credential gives) or AENV_CLUSTER_PASSWORD; None with none."""
        if not name and not password_file and not password:
            return None
        if not name:
            raise InvalidRequest("an etcd password needs its user: AENV_CLUSTER_USER")
        if len(name) > MAX_USER or not name.isprintable():
            raise InvalidRequest(f"AENV_CLUSTER_USER must be at most {MAX_USER} printable characters")
        if password_file and password:
            raise InvalidRequest("give the etcd password once: AENV_CLUSTER_PASSWORD_FILE or AENV_CLUSTER_PASSWORD")
        if password_file:
            try:
                with open(password_file, "rb") as f:
                    data = f.read(MAX_PASSWORD + 2)
            except OSError as exc:
                raise InvalidRequest(f"cannot read {password_file[:200]}: {exc.strerror}") from None
            password = data.decode(errors="replace").removesuffix("\n")
        if not password or len(password) > MAX_PASSWORD:
            raise InvalidRequest(
                f"etcd user {name!r} needs a password of 1 to {MAX_PASSWORD} characters "
                "(AENV_CLUSTER_PASSWORD_FILE or AENV_CLUSTER_PASSWORD)"
            )
        return cls(name, password)

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> EtcdUser | None:
        return cls.load(*(environ.get(f"AENV_CLUSTER_{n}") or None for n in ("USER", "PASSWORD_FILE", "PASSWORD")))


def parse_cluster_url(url: str) -> list[Endpoint]:
    """``etcd://H1:P1,H2:P2,...`` (``etcds://`` for TLS; the port defaults to 2379) -> the member list."""
    # Split by hand: urlsplit takes one host, and newer Pythons refuse a bracketed IPv6 member
    # among others ("Invalid IPv6 URL"); each member is then read as a URL of its own.
    scheme, sep, rest = url.partition("://")
    netloc, slash, path = rest.partition("/")
    if scheme not in ("etcd", "etcds") or not sep or not netloc or path or "?" in netloc or "#" in netloc:
        raise InvalidRequest(f"cluster URL must be etcd[s]://HOST[:PORT][,HOST[:PORT]...], not {url[:200]!r}")
    endpoints = [_endpoint(item) for item in netloc.split(",") if item]
    if not endpoints or len(endpoints) > MAX_ENDPOINTS:
        raise InvalidRequest(f"cluster URL must name 1 to {MAX_ENDPOINTS} etcd members")
    return endpoints


def _endpoint(item: str) -> Endpoint:
    try:
        split = urlsplit("//" + item)
        port = split.port or 2379
    except ValueError:
        raise InvalidRequest(f"invalid etcd member {item[:100]!r}") from None
    if not split.hostname:
        raise InvalidRequest(f"invalid etcd member {item[:100]!r}")
    return Endpoint(split.hostname, port)


class _Watcher(aetcd.watcher.Watcher):  # type: ignore[misc]
    """aetcd's watcher, but a watch etcd cancels (its creation refused: no permission, or a token
    the member does not know; or ended by the server) fails instead of going silent: aetcd does
    not look at a response's ``canceled``."""

    async def _handle_response(self, response: Any) -> None:
        if not response.canceled or response.compact_revision:  # aetcd's: a compacted history's error
            await super()._handle_response(response)
            return
        error = aetcd.exceptions.ClientError(f"watch canceled: {response.cancel_reason or 'by etcd'}")
        async with self._lock:
            if response.created:  # a creation refused: the one waiting, if it has not given up
                if self._new_callback is not None:
                    self._new_callback.error = error
                    self._new_callback_ready.notify_all()
                return  # (its watch id is the request's, not a live watch's)
            callback = self._callbacks.pop(response.watch_id, None)
        if callback is not None:
            await self._process_callback(callback, error)


class _Client(aetcd.Client):  # type: ignore[misc]  # aetcd ships no type hints
    """aetcd's client, asking for a leader on every request (unary and watch), over TLS when
    given credentials (aetcd itself only opens plaintext channels), logged in as ``user`` when
    given one (aetcd would log in once and keep a stale token)."""

    def __init__(
        self, *, credentials: grpc.ChannelCredentials | None = None, user: EtcdUser | None = None, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self.credentials = credentials
        self.user = user
        self.logins = 0  # how many times it logged in: calls refused for an older token log in again

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self.credentials is None:
            await super().connect()
        else:
            self._open_tls_channel()
        self._watcher = _Watcher(aetcd.rpc.WatchStub(self.channel), timeout=self._timeout)
        self._use(REQUIRE_LEADER)

    def _use(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata
        self._watcher._metadata = metadata  # aetcd hands its watcher the metadata at connect

    async def login(self) -> None:
        """Log in as ``user``: every later call carries the token. A watch stream opened with the
        old one is ended (its watches fail and are made again on a new stream)."""
        assert self.user is not None
        await self.connect()
        request = aetcd.rpc.AuthenticateRequest(name=self.user.name, password=self.user.password)
        try:
            reply = await aetcd.rpc.AuthStub(self.channel).Authenticate(
                request, timeout=self._timeout, metadata=REQUIRE_LEADER
            )
        except grpc.aio.AioRpcError as exc:
            aetcd.exceptions._handle_exception(exc)
        self._use((*REQUIRE_LEADER, ("token", reply.token)))
        self.logins += 1
        if self.logins > 1:  # its watches fail, and are made again on a stream with the new token
            await self._watcher._terminate_stream(aetcd.exceptions.ClientError("logged in to etcd again"))

    def _open_tls_channel(self) -> None:
        """What aetcd's connect sets up, on a secure channel."""
        target = f"{self._host}:{self._port}"
        self.channel = aetcd.rpc.secure_channel(target, self.credentials, options=self._options.items())
        self.kvstub = aetcd.rpc.KVStub(self.channel)
        self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
        self.leasestub = aetcd.rpc.LeaseStub(self.channel)
        self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
        self._connected.set()


class EtcdConnection:
    """One connection to the etcd cluster and its calls. Safe to share between tasks of one event loop."""

    def __init__(
        self,
        endpoints: list[Endpoint],
        *,
        timeout: float = DEFAULT_TIMEOUT,
        tls: EtcdTls | None = None,
        user: EtcdUser | None = None,
    ) -> None:
        if not endpoints:
            raise InvalidRequest("no etcd member given")
        self.endpoints = endpoints
        self.timeout = timeout
        self.credentials = tls.credentials() if tls is not None else None
        self.user = user
        self._client: _Client | None = None
        self._connecting = asyncio.Lock()
        self._login_failed: tuple[float, ClusterUnavailable] | None = None

    @classmethod
    def from_url(
        cls, url: str, *, timeout: float = DEFAULT_TIMEOUT, tls: EtcdTls | None = None, user: EtcdUser | None = None
    ) -> Self:
        """A connection for ``url``; ``etcds://`` speaks TLS (with ``tls``'s files, else the system's
        roots). Files given for an ``etcd://`` URL are refused rather than silently unused."""
        endpoints = parse_cluster_url(url)
        secure = urlsplit(url).scheme == "etcds"
        if not secure and tls is not None and tls != EtcdTls():
            raise InvalidRequest("etcd TLS files (AENV_CLUSTER_CA, _CERT, _KEY) need an etcds:// cluster URL")
        if user is not None and not secure:
            log.warning("etcd user %s logs in over plaintext (etcd://): its password crosses the network", user.name)
        return cls(endpoints, timeout=timeout, tls=(tls or EtcdTls()) if secure else None, user=user)

    async def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            try:
                await asyncio.wait_for(client.close(), self.timeout)
            except (TimeoutError, aetcd.exceptions.ClientError) as exc:
                log.warning("closing the cluster store connection: %s", exc)

    # -- calls ----------------------------------------------------------------------------------------
    async def _connected(self) -> _Client:
        try:
            async with asyncio.timeout(self.timeout + 0.5):  # waiting for another's login included
                return await self._connect()
        except TimeoutError:
            raise ClusterUnavailable("the cluster store did not answer (connect and log in)") from None

    async def _connect(self) -> _Client:
        async with self._connecting:
            if self._client is None:
                target = await self._target()
                # gRPC tries the members in order and moves on when one is down (pick_first).
                # aetcd joins host and port into the gRPC target: split ours at its last port.
                host, port = target.rsplit(":", 1)
                options = CHANNEL_OPTIONS
                if self.credentials is not None:  # certificates name a member, not the gRPC target's list
                    options = {**options, "grpc.ssl_target_name_override": self.endpoints[0].host}
                self._client = _Client(
                    host=host,
                    port=int(port),
                    timeout=self.timeout,
                    options=options,
                    credentials=self.credentials,
                    user=self.user,
                )
            client = self._client
            if client.user is not None and client.logins == 0:  # not yet, or the first login failed
                await self._login_once(client)
            return client

    async def _target(self) -> str:
        """A gRPC target naming every member: ``ipv4:A:P,B:P`` (or ``ipv6:[A]:P,...``)."""
        loop = asyncio.get_running_loop()
        addresses: list[tuple[str, int]] = []
        for ep in self.endpoints:
            try:
                ip = ipaddress.ip_address(ep.host)
                addresses.append((str(ip), ep.port))
                continue
            except ValueError:
                pass
            try:
                infos = await asyncio.wait_for(
                    loop.getaddrinfo(ep.host, ep.port, type=socket.SOCK_STREAM), self.timeout
                )
            except (OSError, TimeoutError) as exc:
                log.warning("cannot resolve etcd member %s: %s", ep.host, exc)
                continue
            addresses.extend((str(info[4][0]), ep.port) for info in infos)
        v4 = [f"{a}:{p}" for a, p in addresses if ":" not in a]
        v6 = [f"[{a}]:{p}" for a, p in addresses if ":" in a]
        if v4:
            return "ipv4:" + ",".join(dict.fromkeys(v4))
        if v6:
            return "ipv6:" + ",".join(dict.fromkeys(v6))
        raise ClusterUnavailable("no etcd member address could be resolved")

    async def _call(self, what: str, make: Callable[[_Client], Awaitable[T]], *, again: bool = False) -> T:
        """``make(client)``'s answer within the deadline. With ``again`` (a read, or a write that
        may be made twice) a call etcd dropped for a leader change is made again within that
        deadline: the new leader is elected within about a second, while no quorum ("no
        leader") stays a failure at once."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return await self._call_once(what, make)
            except ClusterUnavailable as exc:
                if not again or LEADER_CHANGED not in exc.message or time.monotonic() + ELECTION_PAUSE > deadline:
                    raise
            await asyncio.sleep(ELECTION_PAUSE)

    async def call(self, what: str, make: Callable[[Any], Awaitable[T]], *, again: bool = False) -> T:
        """``make(client)``, an aetcd call, with this store's deadline, logins and retries: for the
        cluster's other keys (teams and keys, aenv/teams/cluster.py)."""
        return await self._call(what, make, again=again)

    async def _call_once(self, what: str, make: Callable[[_Client], Awaitable[T]]) -> T:
        """``make(client)``'s answer within the deadline. A call etcd refused for its login token
        (tokens live in one member's memory: a restart or a move to another member forgets them;
        etcd checks a watch's token only as a refused permission) logs in again and is made once
        more: a refused call did nothing."""
        client = await self._connected()
        for attempt in (1, 2):
            generation = client.logins
            try:
                return await asyncio.wait_for(make(client), self.timeout + 0.5)
            except aetcd.exceptions.RevisionCompactedError as exc:
                raise WatchCompacted(f"cluster store: {what}: {exc}") from None
            except (aetcd.exceptions.ClientError, TimeoutError) as exc:
                refused = _refusal(exc)
                if attempt == 1 and client.user is not None and refused in ("token", "permission"):
                    await self._login_again(client, generation)
                    continue
                if refused == "token" and client.user is None:
                    raise ClusterUnavailable(
                        f"the cluster store refused {what}: etcd's auth is on and this process logs in as no "
                        "user (AENV_CLUSTER_USER and AENV_CLUSTER_PASSWORD_FILE, or a client certificate)"
                    ) from None
                if refused == "permission":
                    who = f"etcd user {client.user.name!r}" if client.user is not None else "this client"
                    raise ClusterUnavailable(
                        f"the cluster store refused {what}: {who} lacks the permission "
                        "(its role: docs/cluster.md, etcd users and roles)"
                    ) from None
                raise ClusterUnavailable(f"the cluster store did not answer ({what}): {_reason(exc)}") from None
        raise AssertionError("unreachable")

    async def _login_again(self, client: _Client, generation: int) -> None:
        """Log in once for every call that found the token refused since login ``generation``."""
        try:
            async with asyncio.timeout(self.timeout + 0.5), self._connecting:
                if client.logins == generation:
                    await self._login_once(client)
        except TimeoutError:
            raise ClusterUnavailable("the cluster store did not answer (log in again)") from None

    async def _login_once(self, client: _Client) -> None:
        """Log in (the caller holds ``_connecting``). A login that failed a moment ago is the
        answer of the calls queued behind it: each would otherwise try (a bcrypt on etcd) in turn."""
        failed = self._login_failed
        if failed is not None and time.monotonic() - failed[0] < LOGIN_RETRY:
            raise failed[1]
        try:
            await self._call_login(client)
        except ClusterUnavailable as exc:
            self._login_failed = (time.monotonic(), exc)
            raise
        self._login_failed = None

    async def _call_login(self, client: _Client) -> None:
        try:
            await asyncio.wait_for(client.login(), self.timeout + 0.5)
        except (aetcd.exceptions.ClientError, TimeoutError) as exc:
            assert client.user is not None
            if _refusal(exc) == "password":
                raise ClusterUnavailable(
                    f"etcd refused the login of user {client.user.name!r}: wrong user name or password"
                ) from None
            raise ClusterUnavailable(f"the cluster store did not answer (log in): {_reason(exc)}") from None

    async def auth_request(self, what: str, method: str, request: Any, *, done_if: str = "") -> Any:
        """One call of etcd's Auth service (users, roles, turning auth on: ``aenv.cluster.auth``);
        None when etcd's refusal says ``done_if`` (e.g. "already exists": nothing left to do)."""

        async def call(client: _Client) -> Any:
            await client.connect()
            try:
                stub = aetcd.rpc.AuthStub(client.channel)
                return await getattr(stub, method)(request, timeout=self.timeout, metadata=client.metadata)
            except grpc.aio.AioRpcError as exc:
                if done_if and done_if in (exc.details() or ""):
                    return None
                aetcd.exceptions._handle_exception(exc)

        return await self._call(what, call)


def _refusal(exc: BaseException) -> Literal["token", "permission", "password"] | None:
    """Why etcd refused a call, if for its login: the token unknown to the member (restarted,
    another one, expired), the user's permissions (also how a watch refuses a bad token), or the
    password."""
    cause = exc.__cause__
    code = cause.code() if isinstance(cause, grpc.aio.AioRpcError) else None
    text = str(exc)
    if code == grpc.StatusCode.UNAUTHENTICATED or "invalid auth token" in text or "auth store is old" in text:
        return "token"
    if "user name is empty" in text:  # a call without a token where etcd wants one
        return "token"
    if code == grpc.StatusCode.PERMISSION_DENIED or "permission denied" in text:
        return "permission"
    if "authentication failed" in text:
        return "password"
    return None


def _reason(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text[:300]
