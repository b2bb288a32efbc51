"""A client for the OCI distribution API (registry HTTP API v2): manifests, configs and blobs.

Image indexes (OCI and Docker manifest lists) resolve to the manifest of one platform; every
blob and every manifest fetched by digest is verified against that digest. Credentials come from
the user's Docker config (``~/.docker/config.json`` or ``$DOCKER_CONFIG``): bearer tokens are
fetched from the realm a 401 names, basic auth is sent where the registry asks for it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import platform
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aenv.errors import InvalidRequest, NotFound, UpstreamError
from aenv.images.reference import DOCKER_HUB, ImageRef

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = {OCI_INDEX, DOCKER_LIST}
MANIFESTS = {OCI_MANIFEST, DOCKER_MANIFEST}
ACCEPT = ", ".join([OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST])
CHUNK = 1 << 20


class RegistryError(UpstreamError):
    """A registry refused, failed, or sent something that does not check out."""


@contextmanager
def _talking_to(registry: str) -> Iterator[None]:
    """A registry out of reach (refused, no such host, TLS, timeout) is an error naming it."""
    try:
        yield
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason = str(exc) or type(exc).__name__
        raise RegistryError(f"registry {registry} cannot be reached: {reason}", status=502) from exc


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise RegistryError(f"{what} is not a JSON object", status=502)
    return body


def _descriptor(desc: Any, what: str) -> dict[str, Any]:
    if not isinstance(desc, dict) or not isinstance(desc.get("digest"), str):
        raise RegistryError(f"{what} has no digest", status=502)
    return desc


def host_platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    return "linux", {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def docker_credentials(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` from the Docker config, if any."""
    config = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    try:
        auths = json.loads(config.read_text()).get("auths", {})
    except (OSError, ValueError):
        return None
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == DOCKER_HUB:
        keys += ["https://index.docker.io/v1/", "index.docker.io", "docker.io"]
    for key in keys:
        entry = auths.get(key)
        if not entry:
            continue
        if entry.get("auth"):
            user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            return user, password
        if entry.get("username"):
            return entry["username"], entry.get("password", "")
    return None


def _challenge(header: str) -> tuple[str, dict[str, str]]:
    scheme, _, rest = header.partition(" ")
    return scheme.lower(), dict(re.findall(r'(\w+)="([^"]*)"', rest))


@dataclass
class Image:
    """A resolved image: its manifest (for one platform), config and layer descriptors."""

    ref: ImageRef
    digest: str  # of the platform manifest
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: list[dict[str, Any]] = field(default_factory=list)

    @property
    def diff_ids(self) -> list[str]:
        return list(self.config.get("rootfs", {}).get("diff_ids", []))


class RegistryClient:
    def __init__(
        self,
        *,
        insecure: set[str] | None = None,
        credentials: dict[str, tuple[str, str]] | None = None,
        timeout: float = 60.0,
    ) -> None:
        self.insecure = insecure or set()
        # registry -> (user, password) given with the request; before the Docker config's
        self.credentials = credentials or {}
        self.http = httpx.AsyncClient(timeout=timeout, follow_redirects=True)
        self._tokens: dict[tuple[str, str], str] = {}

    async def close(self) -> None:
        await self.http.aclose()

    def _base(self, ref: ImageRef) -> str:
        plain = ref.registry in self.insecure or ref.registry.split(":")[0] in ("localhost", "127.0.0.1")
        return f"{'http' if plain else 'https'}://{ref.registry}/v2/{ref.repository}"

    async def _request(self, method: str, ref: ImageRef, path: str, **kw: Any) -> httpx.Response:
        url = f"{self._base(ref)}/{path}"
        headers = dict(kw.pop("headers", {}))
        token = self._tokens.get((ref.registry, ref.repository))
        if token:
            headers["Authorization"] = token
        with _talking_to(ref.registry):
            response = await self.http.request(method, url, headers=headers, **kw)
            if response.status_code == 401 and "www-authenticate" in response.headers:
                headers["Authorization"] = await self._authorize(ref, response.headers["www-authenticate"])
                self._tokens[(ref.registry, ref.repository)] = headers["Authorization"]
                response = await self.http.request(method, url, headers=headers, **kw)
        if response.status_code in (401, 403):
            raise RegistryError(f"{ref}: the registry refused access ({response.status_code})", status=403)
        return response

    async def _authorize(self, ref: ImageRef, header: str) -> str:
        scheme, params = _challenge(header)
        creds = self.credentials.get(ref.registry) or docker_credentials(ref.registry)
        if scheme == "basic":
            if creds is None:
                raise RegistryError(f"{ref.registry} wants a login; none given or in the Docker config", status=403)
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme != "bearer" or "realm" not in params:
            raise RegistryError(f"{ref.registry}: unsupported auth challenge {header!r}", status=403)
        query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        with _talking_to(params["realm"]):
            reply = await self.http.get(params["realm"], params=query, auth=creds)
        if reply.status_code != 200:
            raise RegistryError(f"{ref.registry}: token request failed ({reply.status_code})", status=403)
        body = _json_object(reply.content, f"{ref.registry}: the token answer")
        return "Bearer " + str(body.get("token") or body.get("access_token"))

    async def _manifest(self, ref: ImageRef, reference: str) -> tuple[str, dict[str, Any], str]:
        response = await self._request("GET", ref, f"manifests/{reference}", headers={"Accept": ACCEPT})
        if response.status_code == 404:
            raise NotFound(f"image {ref} not found (manifest {reference})")
        if response.status_code != 200:
            raise RegistryError(f"{ref}: manifest {reference}: HTTP {response.status_code}", status=502)
        raw = response.content
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(f"{ref}: manifest digest mismatch ({digest} != {reference})", status=502)
        body = _json_object(raw, f"{ref}: manifest {reference}")
        kind = body.get("mediaType") or response.headers.get("content-type", "").split(";")[0]
        if kind not in INDEXES | MANIFESTS:
            kind = OCI_INDEX if "manifests" in body else OCI_MANIFEST
        return kind, body, digest

    async def resolve(self, ref: ImageRef, platform_: tuple[str, str] | None = None) -> Image:
        """The image ``ref`` names, for ``platform_`` (default: this host's)."""
        want_os, want_arch = platform_ or host_platform()
        kind, body, digest = await self._manifest(ref, ref.reference)
        if kind in INDEXES:
            entries = [m for m in body.get("manifests") or [] if isinstance(m, dict)]
            platforms = [m.get("platform") if isinstance(m.get("platform"), dict) else {} for m in entries]
            pairs = zip(entries, platforms, strict=True)
            chosen = [m for m, p in pairs if (p.get("os"), p.get("architecture")) == (want_os, want_arch)]
            if not chosen:
                offered = sorted(f"{p.get('os')}/{p.get('architecture')}" for p in platforms)
                raise InvalidRequest(f"image {ref} has no {want_os}/{want_arch} variant (has {', '.join(offered)})")
            kind, body, digest = await self._manifest(ref, _descriptor(chosen[0], f"{ref}: an index entry")["digest"])
        config_desc = _descriptor(body.get("config"), f"{ref}: the manifest's config")
        config = _json_object(await self.blob_bytes(ref, config_desc["digest"]), f"{ref}: the image config")
        layers = [_descriptor(layer, f"{ref}: a layer") for layer in body.get("layers") or []]
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(layers) != len(diff_ids):
            raise RegistryError(f"{ref}: manifest and config disagree on the layer count", status=502)
        return Image(ref, digest, body, config, layers)

    async def blob_bytes(self, ref: ImageRef, digest: str) -> bytes:
        response = await self._request("GET", ref, f"blobs/{digest}")
        if response.status_code != 200:
            raise RegistryError(f"{ref}: blob {digest}: HTTP {response.status_code}", status=502)
        if "sha256:" + hashlib.sha256(response.content).hexdigest() != digest:
            raise RegistryError(f"{ref}: blob {digest} does not match its digest", status=502)
        return response.content

    async def fetch_blob(self, ref: ImageRef, digest: str, dest: Path, on_bytes: Any = None) -> None:
        """Stream a blob to ``dest``, verifying its digest (a bad blob leaves no file)."""
        url = f"{self._base(ref)}/blobs/{digest}"
        headers = {}
        token = self._tokens.get((ref.registry, ref.repository))
        if token:
            headers["Authorization"] = token
        hasher = hashlib.sha256()
        tmp = dest.with_name(dest.name + ".part")
        try:
            with _talking_to(ref.registry):
                async with self.http.stream("GET", url, headers=headers) as response:
                    if response.status_code == 401:
                        await response.aread()
                        await self._request("HEAD", ref, f"blobs/{digest}")  # gets a token, then retry
                        return await self.fetch_blob(ref, digest, dest, on_bytes)
                    if response.status_code != 200:
                        raise RegistryError(f"{ref}: blob {digest}: HTTP {response.status_code}", status=502)
                    with open(tmp, "wb") as out:
                        async for chunk in response.aiter_bytes(CHUNK):
                            hasher.update(chunk)
                            out.write(chunk)
                            if on_bytes is not None:
                                on_bytes(len(chunk))
            if "sha256:" + hasher.hexdigest() != digest:
                raise RegistryError(f"{ref}: blob {digest} does not match its digest", status=502)
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)
