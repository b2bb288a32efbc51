"""Webhook deliveries: each event a team's webhook asked for, POSTed in E2B's shape and signed.

One worker per webhook follows the event store from where that webhook's deliveries stand, in
the order events were committed (so a sandbox's events arrive in order), and moves its position
on after each event is delivered or given up on. A delivery is retried with a doubling wait; a
receiver told the same event twice (a node stopped between its answer and the position's write)
sees the same event ``id`` both times. Only one dispatcher runs for a deployment at a time.

The host is the one making these requests, so where they go is held to the operator's rule: no
loopback, private or link-local address unless the operator allows them (``webhook_private_urls``);
each delivery resolves the name itself and connects to the address it checked (a name that
resolved to a public address at registration cannot turn into 127.0.0.1 later). Redirects are not
followed; what a receiver answers is read only up to a few KiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import socket
import ssl
import uuid
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx

from aenv import __version__
from aenv.errors import InvalidRequest
from aenv.events.model import MAX_URL, LifecycleEvent, Webhook, signature
from aenv.events.store import EventStore

log = logging.getLogger("aenv.events")
MAX_ANSWER = 4096
RESOLVE_TIMEOUT = 5.0
MAX_WAIT = 300.0
PAGE = 200
IDLE_CHECK = 1.0  # how often a dispatcher looks for new events without being woken (another node's)


@dataclass(frozen=True, slots=True)
class Target:
    """Where a delivery connects: the URL's host resolved to an address the rule allows."""

    url: str
    host: str
    address: str
    port: int
    https: bool


class UrlRule:
    def __init__(self, allow_private: bool) -> None:
        self.allow_private = allow_private

    @classmethod
    def of(cls, setting: str, listen_host: str) -> UrlRule:
        if setting == "auto":
            return cls(_loopback_only(listen_host))
        return cls(setting == "allow")

    def check_syntax(self, url: str) -> tuple[str, int, bool]:
        if len(url) > MAX_URL:
            raise InvalidRequest(f"url: longer than {MAX_URL} characters")
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as exc:
            raise InvalidRequest(f"url: not a URL: {exc}") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise InvalidRequest("url: must be an http:// or https:// URL with a host")
        if parts.username is not None or parts.password is not None:
            raise InvalidRequest("url: credentials in the URL are not taken; sign with signatureSecret")
        https = parts.scheme == "https"
        return parts.hostname, port or (443 if https else 80), https

    def allows(self, address: str) -> bool:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_unspecified or ip.is_multicast:
            return False
        return self.allow_private or ip.is_global

    def refusal(self, host: str, address: str) -> str:
        return (
            f"url: {host} is {address}, a loopback, private or link-local address, which this "
            "deployment's webhooks may not reach (AENV_WEBHOOK_PRIVATE_URLS)"
        )

    async def check_registration(self, url: str) -> None:
        """A clear 400 for a URL no delivery could go to; a name that does not resolve yet is
        taken (every delivery checks again)."""
        host, port, _ = self.check_syntax(url)
        for address in await _resolve(host, port, missing_ok=True):
            if not self.allows(address):
                raise InvalidRequest(self.refusal(host, address))

    async def target(self, url: str) -> Target:
        host, port, https = self.check_syntax(url)
        addresses = await _resolve(host, port, missing_ok=False)
        for address in addresses:
            if not self.allows(address):
                raise InvalidRequest(self.refusal(host, address))
        return Target(url, host, addresses[0], port, https)


def _loopback_only(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


async def _resolve(host: str, port: int, *, missing_ok: bool) -> list[str]:
    try:
        return [str(ipaddress.ip_address(host.strip("[]")))]
    except ValueError:
        pass
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), RESOLVE_TIMEOUT)
    except (OSError, TimeoutError, UnicodeError, ValueError) as exc:  # no such name, or not a name at all
        if missing_ok:
            return []
        raise InvalidRequest(f"url: {host} does not resolve: {exc}") from None
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Dispatcher:
    """The deliveries of every webhook of the store."""

    def __init__(
        self,
        store: EventStore,
        rule: UrlRule,
        *,
        timeout: float = 10.0,
        retries: int = 5,
        retry_delay: float = 1.0,
    ) -> None:
        self.store = store
        self.rule = rule
        self.timeout = timeout
        self.retries = retries
        self.retry_delay = retry_delay
        self.hooks: dict[str, Webhook] = {}
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None
        self.delivered = 0  # deliveries a receiver took (a 2xx)
        self.failed = 0  # attempts that did not

    def wake(self) -> None:
        self._wake.set()

    def start(self) -> None:
        self._client = httpx.AsyncClient(
            timeout=self.timeout, follow_redirects=False, trust_env=False, verify=ssl.create_default_context()
        )
        self._task = asyncio.create_task(self._follow(), name="webhook dispatcher")

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._workers.values()) if t is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._task, self._workers = None, {}
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _follow(self) -> None:
        """Keep one worker per webhook and wake them all when events are written."""
        wakers: dict[str, asyncio.Event] = {}
        while True:
            try:
                self.hooks = {h.id: h for h in await self.store.webhooks()}
            except Exception as exc:
                log.warning("webhooks: could not read them (%s)", exc)
            for hook_id in list(self._workers):
                if hook_id not in self.hooks:
                    self._workers.pop(hook_id).cancel()
                    wakers.pop(hook_id, None)
            for hook_id in self.hooks:
                if hook_id not in self._workers or self._workers[hook_id].done():
                    wakers[hook_id] = asyncio.Event()
                    self._workers[hook_id] = asyncio.create_task(
                        self._work(hook_id, wakers[hook_id]), name=f"webhook {hook_id}"
                    )
            for waker in wakers.values():
                waker.set()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), IDLE_CHECK)
            self._wake.clear()

    async def _work(self, hook_id: str, woken: asyncio.Event) -> None:
        while hook_id in self.hooks:
            try:
                position = await self.store.delivered(hook_id)
                if position is None:  # made elsewhere: from now on
                    position = await self.store.last_position()
                    await self.store.set_delivered(hook_id, position)
                page = await self.store.after(position, PAGE)
            except Exception as exc:
                log.warning("webhook %s: the event store did not answer (%s)", hook_id, exc)
                await asyncio.sleep(IDLE_CHECK)
                continue
            if not page:
                await woken.wait()
                woken.clear()
                continue
            try:
                for at, event in page:
                    hook = self.hooks.get(hook_id)
                    if hook is None:
                        return
                    if event is not None and hook.wants(event):
                        await self._deliver(hook_id, event)
                    await self.store.set_delivered(hook_id, at)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the store, or this node no longer delivers: from the last position
                log.warning("webhook %s: %s", hook_id, exc)
                await asyncio.sleep(IDLE_CHECK)

    async def _deliver(self, hook_id: str, event: LifecycleEvent) -> None:
        body = json.dumps(event.delivery(), separators=(",", ":")).encode()
        wait = self.retry_delay
        for attempt in range(self.retries + 1):
            hook = self.hooks.get(hook_id)  # each attempt as the webhook is now (changed, deleted)
            if hook is None or not hook.enabled:
                return
            outcome = await self._attempt(hook, body)
            if outcome is None:
                self.delivered += 1
                return
            self.failed += 1
            if attempt == self.retries:
                log.warning("webhook %s: event %s not delivered (%s); given up", hook.id, event.id, outcome)
                return
            log.info("webhook %s: event %s: %s; again in %.1f s", hook.id, event.id, outcome, wait)
            await asyncio.sleep(wait)
            wait = min(wait * 2, MAX_WAIT)

    async def _attempt(self, hook: Webhook, body: bytes) -> str | None:
        """One POST; None when the receiver took it, else why not."""
        assert self._client is not None
        try:
            target = await self.rule.target(hook.url)
        except InvalidRequest as exc:
            return exc.message
        parts = urlsplit(target.url)
        address = f"[{target.address}]" if ":" in target.address else target.address
        path = parts.path or "/"
        url = f"{parts.scheme}://{address}:{target.port}{path}" + (f"?{parts.query}" if parts.query else "")
        headers = {
            "host": parts.netloc.rpartition("@")[2],
            "content-type": "application/json",
            "user-agent": f"aenv-webhooks/{__version__}",
            "e2b-webhook-id": hook.id,
            "e2b-delivery-id": str(uuid.uuid4()),
            "e2b-signature-version": "v1",
            "e2b-signature": signature(hook.secret, body),
        }
        extensions = {"sni_hostname": target.host} if target.https else {}
        try:
            request = self._client.build_request("POST", url, content=body, headers=headers, extensions=extensions)
            response = await self._client.send(request, stream=True)
            try:
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read >= MAX_ANSWER:
                        break
            finally:
                await response.aclose()
        except httpx.HTTPError as exc:
            return f"{type(exc).__name__}: {exc}"[:300]
        if 200 <= response.status_code < 300:
            return None
        return f"answered {response.status_code}"
