"""Registry mirrors (``AENV_REGISTRY_MIRRORS``): where a registry's images are looked for first.

An operator names, per registry, mirrors that serve the same repositories (a pull-through cache,
a local registry loaded for offline use): ``docker.io=http://127.0.0.1:5000,ghcr.io=https://m.lan``
or the JSON object ``{"docker.io": ["http://127.0.0.1:5000", "https://m.lan/hub"]}``. A mirror URL
is ``http(s)://host[:port]`` with an optional path of repository components that is put before
the repository (a proxy project of Harbor, say). A pull asks each mirror of the image's registry
in turn and then the registry itself; the first that has the image serves its manifest and
blobs (every one checked against its digest, as from the registry). A mirror is the operator's
configuration, not the client's: it is spoken to over the scheme given, with the Docker config's
login for its own host, never the login a client gave for the registry, and through the same
guard as the registry (its token service and redirects may lead no further inside than the
mirror itself).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from aenv.errors import AenvError
from aenv.images.guard import READ_TIMEOUT
from aenv.images.reference import COMPONENT, DOCKER_HUB, REGISTRY, ImageRef
from aenv.images.registry import Image, RegistryClient

DOCKER_HUB_NAMES = {"docker.io", "index.docker.io", DOCKER_HUB}


def registry_key(name: str) -> str:
    """How a registry is named in the mirror map: lower case, Docker Hub by one name."""
    name = name.strip().lower()
    return DOCKER_HUB if name in DOCKER_HUB_NAMES else name


def parse_mirrors(value: Any) -> dict[str, list[str]]:
    """``AENV_REGISTRY_MIRRORS`` (a string of REGISTRY=URL pairs, or JSON) or a mapping, checked
    and normalised: registry -> mirror URLs in the order they are tried. ValueError says what
    is wrong."""
    if value is None:
        return {}
    if isinstance(value, str):
        text = value.strip()
        if not text:
            return {}
        if text.startswith("{"):
            try:
                value = json.loads(text)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
        else:
            pairs: dict[str, list[str]] = {}
            for item in filter(None, (part.strip() for part in text.split(","))):
                registry, sep, url = item.partition("=")
                if not sep or not registry.strip() or not url.strip():
                    raise ValueError(f"{item!r} is not REGISTRY=URL")
                pairs.setdefault(registry.strip(), []).append(url.strip())
            value = pairs
    if not isinstance(value, dict):
        raise ValueError("must be REGISTRY=URL pairs separated by commas, or a JSON object")
    out: dict[str, list[str]] = {}
    for registry, urls in value.items():
        if not isinstance(registry, str) or not REGISTRY.fullmatch(registry.strip()):
            raise ValueError(f"{registry!r} is not a registry (host or host:port)")
        if isinstance(urls, str):
            urls = [urls]
        if not isinstance(urls, list) or not urls or not all(isinstance(u, str) for u in urls):
            raise ValueError(f"the mirrors of {registry} must be a URL or a list of URLs")
        out.setdefault(registry_key(registry), []).extend(str(Mirror.parse(u)) for u in urls)
    return out


@dataclass(frozen=True)
class Mirror:
    scheme: str  # http or https, as the operator wrote it
    host: str  # host[:port]
    namespace: str  # "" or repository components put before the repository

    @classmethod
    def parse(cls, text: str) -> Mirror:
        try:
            url = httpx.URL(text.strip())
        except httpx.InvalidURL as exc:
            raise ValueError(f"mirror {text!r}: {exc}") from None
        if url.scheme not in ("http", "https"):
            raise ValueError(f"mirror {text!r}: must be an http:// or https:// URL")
        if url.userinfo or url.query or url.fragment:
            raise ValueError(f"mirror {text!r}: no login, query or fragment (logins come from the Docker config)")
        host = url.netloc.decode("ascii")
        if not REGISTRY.fullmatch(host):
            raise ValueError(f"mirror {text!r}: {host!r} is not a host or host:port")
        namespace = url.path.strip("/")
        if namespace.startswith("v2/") or namespace == "v2":
            namespace = namespace[2:].lstrip("/")  # the API's own prefix, written out: not a namespace
        if namespace and not all(COMPONENT.fullmatch(part) for part in namespace.split("/")):
            raise ValueError(f"mirror {text!r}: the path must be repository components (a namespace)")
        return cls(url.scheme, host.lower(), namespace)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.host}{'/' + self.namespace if self.namespace else ''}"

    def ref_for(self, ref: ImageRef) -> ImageRef:
        """The image ``ref`` names, as this mirror holds it."""
        repository = f"{self.namespace}/{ref.repository}" if self.namespace else ref.repository
        return ImageRef(self.host, repository, ref.tag, ref.digest)


class MirroredClient:
    """One pull from ``registry``: its mirrors, in order, then the registry itself. The same
    resolve, fetch_blob and close as a :class:`RegistryClient`."""

    def __init__(
        self,
        registry: str,
        mirrors: dict[str, list[str]],
        *,
        insecure: set[str] | None = None,
        credentials: dict[str, tuple[str, str]] | None = None,
        auth: str | None = None,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.registry = registry
        self.auth, self.read_timeout = auth, read_timeout
        self.origin = RegistryClient(
            registry, insecure=insecure, credentials=credentials, auth=auth, read_timeout=read_timeout
        )
        self.mirrors = [Mirror.parse(url) for url in mirrors.get(registry_key(registry), [])]
        self._clients: list[RegistryClient] = []
        self.source = registry  # what served the image, once resolved (logs name it)
        self._serving: tuple[RegistryClient, Mirror | None] = (self.origin, None)

    async def resolve(self, ref: ImageRef) -> Image:
        tried: list[str] = []
        for mirror in self.mirrors:
            # the node's login for the mirror's own host, never one the client gave
            client = RegistryClient(mirror.host, scheme=mirror.scheme, auth=self.auth, read_timeout=self.read_timeout)
            self._clients.append(client)
            try:
                image = await client.resolve(mirror.ref_for(ref))
            except AenvError as exc:
                tried.append(f"mirror {mirror} ({exc.message})")
                continue
            self._serving, self.source = (client, mirror), f"mirror {mirror}"
            return replace(image, ref=ref)
        try:
            return await self.origin.resolve(ref)
        except AenvError as exc:
            if not tried:
                raise
            tried.append(f"then {ref.registry} itself ({exc.message})")
            raise type(exc)(f"image {ref}: tried {', '.join(tried)}", status=exc.status) from exc

    async def fetch_blob(self, ref: ImageRef, desc: dict[str, Any], dest: Path, **kwargs: Any) -> None:
        """From whichever served the manifest: the blobs of one image come from one place."""
        client, mirror = self._serving
        await client.fetch_blob(mirror.ref_for(ref) if mirror else ref, desc, dest, **kwargs)

    async def stream_blob(
        self, ref: ImageRef, desc: dict[str, Any], sink: Callable[[bytes], Awaitable[None]], **kwargs: Any
    ) -> None:
        client, mirror = self._serving
        await client.stream_blob(mirror.ref_for(ref) if mirror else ref, desc, sink, **kwargs)

    async def close(self) -> None:
        for client in [self.origin, *self._clients]:
            await client.close()
