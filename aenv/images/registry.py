"""A client for the OCI distribution API (registry HTTP API v2): manifests, configs and blobs.

Image indexes (OCI and Docker manifest lists) resolve to the manifest of one platform; every
blob and every manifest fetched by digest is verified against that digest. Credentials come from
the user's Docker config (``~/.docker/config.json`` or ``$DOCKER_CONFIG``): bearer tokens are
fetched from the realm a 401 names, basic auth is sent where the registry asks for it. Where the
client may connect and how much it reads is :mod:`aenv.images.guard`'s to say.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import platform
import re
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from aenv.errors import ImageNotFound, InvalidRequest, UpstreamError, parse_json, snippet
from aenv.images.guard import READ_TIMEOUT, guarded_client, read_bounded, send_following
from aenv.images.reference import DIGEST, DOCKER_HUB, ImageRef

OCI_INDEX = "application/vnd.oci.image.index.v1+json"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
INDEXES = {OCI_INDEX, DOCKER_LIST}
MANIFESTS = {OCI_MANIFEST, DOCKER_MANIFEST}
ACCEPT = ", ".join([OCI_INDEX, OCI_MANIFEST, DOCKER_LIST, DOCKER_MANIFEST])
CHUNK = 1 << 20
# Registry answers read whole are bounded: a manifest or index (Docker's own limit is 4 MiB), an
# image config, a token answer. Blobs are bounded by the size their descriptor gives.
MAX_DOCUMENT = 4 * 2**20
MAX_TOKEN_ANSWER = 2**20
MAX_TOKEN = 64 * 1024
TOKEN = re.compile(r"[\x21-\x7e]+")  # what a header value can carry as one word
DOCUMENT_DEADLINE = 120.0  # for the whole of one such answer, however slowly it trickles


class RegistryError(UpstreamError):
    """A registry refused, failed, or sent something that does not check out."""


@contextmanager
def _talking_to(ref: ImageRef, read_timeout: float = READ_TIMEOUT) -> Iterator[None]:
    """A registry out of reach (refused, no such host, TLS) is an error naming it (502); one that
    stalls, a gateway timeout (504)."""
    failed = f"failed to pull image '{ref}': registry {ref.registry}"
    try:
        yield
    except httpx.TimeoutException as exc:
        what = "connect" if isinstance(exc, httpx.ConnectTimeout) else f"send a byte within {read_timeout:g}s"
        raise RegistryError(f"{failed} did not answer in time (did not {what})", status=504) from exc
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        reason = snippet(str(exc) or type(exc).__name__)
        raise RegistryError(f"{failed} cannot be reached: {reason}", status=502) from exc
    except TimeoutError as exc:
        raise RegistryError(f"{failed} did not answer within {DOCUMENT_DEADLINE:.0f}s", status=504) from exc


def access_denied(ref: ImageRef, why: str) -> RegistryError:
    """As E2B words a registry's refusal (403: a 401 would read as the API key's own)."""
    return RegistryError(
        f"access denied to '{ref}': authentication required or insufficient permissions ({why})", status=403
    )


def image_not_found(ref: ImageRef, what: str) -> ImageNotFound:
    return ImageNotFound(f"image '{ref}' not found: the image or tag does not exist in the registry ({what})")


def _json_object(raw: bytes, what: str) -> dict[str, Any]:
    try:
        body = parse_json(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict):
        raise RegistryError(f"{what} is not a JSON object", status=502)
    return body


def _descriptor(desc: Any, what: str) -> dict[str, Any]:
    """A descriptor names what to fetch by its sha256 digest and says how large it is."""
    if not isinstance(desc, dict) or not isinstance(desc.get("digest"), str) or not DIGEST.fullmatch(desc["digest"]):
        raise RegistryError(f"{what} has no sha256 digest", status=502)
    size = desc.get("size")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise RegistryError(f"{what} has no size", status=502)
    return desc


def host_platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    return "linux", {"x86_64": "amd64", "aarch64": "arm64"}.get(machine, machine)


def auth_config(value: str | None) -> dict[str, Any]:
    """The Docker config logins come from: ``value`` (``AENV_REGISTRY_AUTH``: the JSON itself, or
    the path of a file holding it, read at each pull so that a rotated login is used at once),
    else ``$DOCKER_CONFIG/config.json`` or ``~/.docker/config.json``. Unreadable: no logins."""
    text = (value or "").strip()
    if text.startswith("{"):
        raw = text
    else:
        path = Path(text) if text else Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
        try:
            raw = path.read_text()
        except (OSError, ValueError):
            return {}
    try:
        body = json.loads(raw)
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def docker_credentials(registry: str, auth: str | None = None) -> tuple[str, str] | None:
    """(user, password) for ``registry`` from the Docker config (see :func:`auth_config`), if any."""
    auths = auth_config(auth).get("auths")
    if not isinstance(auths, dict):
        return None
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == DOCKER_HUB:
        keys += ["https://index.docker.io/v1/", "index.docker.io", "docker.io"]
    for key in keys:
        entry = auths.get(key)
        if not entry or not isinstance(entry, dict):
            continue
        if isinstance(entry.get("auth"), str) and entry["auth"]:
            try:
                user, _, password = base64.b64decode(entry["auth"]).decode().partition(":")
            except ValueError:
                continue
            return user, password
        if isinstance(entry.get("username"), str) and entry["username"]:
            password = entry.get("password", "")
            return entry["username"], password if isinstance(password, str) else ""
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
    """A client for one registry (one pull): every request it makes goes through the pull's
    :mod:`aenv.images.guard`."""

    def __init__(
        self,
        registry: str,
        *,
        insecure: set[str] | None = None,
        credentials: dict[str, tuple[str, str]] | None = None,
        scheme: str | None = None,
        auth: str | None = None,
        read_timeout: float = READ_TIMEOUT,
    ) -> None:
        self.registry = registry
        plain = registry in (insecure or set()) or registry.split(":")[0] in ("localhost", "127.0.0.1")
        self.root = f"{scheme or ('http' if plain else 'https')}://{registry}"  # scheme: a mirror's, as configured
        # registry -> (user, password) given with the request; before the node's (AENV_REGISTRY_AUTH)
        self.credentials = credentials or {}
        self.auth = auth
        self.read_timeout = read_timeout
        self.http = guarded_client(httpx.URL(self.root), read_timeout)
        self._tokens: dict[str, str] = {}  # repository -> Authorization

    async def close(self) -> None:
        await self.http.aclose()

    def _url(self, ref: ImageRef, path: str) -> str:
        if ref.registry != self.registry:
            raise ValueError(f"this client talks to {self.registry}, not {ref.registry}")
        return f"{self.root}/v2/{ref.repository}/{path}"

    @asynccontextmanager
    async def _get(
        self, ref: ImageRef, path: str, headers: dict[str, str] | None = None
    ) -> AsyncIterator[httpx.Response]:
        """GET from the registry, authorising once if it asks; the answer's body is still to be read."""
        url = self._url(ref, path)
        headers = dict(headers or {})
        with _talking_to(ref, self.read_timeout):
            if token := self._tokens.get(ref.repository):
                headers["Authorization"] = token
            response = await send_following(self.http, self.http.build_request("GET", url, headers=headers))
            try:
                challenge = response.headers.get("www-authenticate")
                if response.status_code == 401 and challenge:
                    await response.aclose()
                    headers["Authorization"] = await self._authorize(ref, challenge)
                    self._tokens[ref.repository] = headers["Authorization"]
                    response = await send_following(self.http, self.http.build_request("GET", url, headers=headers))
                if response.status_code in (401, 403):
                    raise access_denied(ref, f"the registry refused access: {response.status_code}")
                yield response
            finally:
                await response.aclose()

    async def _authorize(self, ref: ImageRef, header: str) -> str:
        scheme, params = _challenge(header)
        creds = self.credentials.get(ref.registry) or docker_credentials(ref.registry, self.auth)
        if scheme == "basic":
            if creds is None:
                raise access_denied(ref, f"{ref.registry} wants a login; none given or in the node's Docker config")
            return "Basic " + base64.b64encode(f"{creds[0]}:{creds[1]}".encode()).decode()
        if scheme != "bearer" or "realm" not in params:
            raise RegistryError(f"{ref.registry}: unsupported auth challenge {snippet(header)!r}", status=403)
        query = {"scope": params.get("scope") or f"repository:{ref.repository}:pull"}
        if "service" in params:
            query["service"] = params["service"]
        request = self.http.build_request("GET", params["realm"], params=query)
        async with asyncio.timeout(DOCUMENT_DEADLINE):
            reply = await send_following(self.http, request, auth=creds)
            try:
                if reply.status_code != 200:
                    raise access_denied(ref, f"{ref.registry}: the token request was refused: {reply.status_code}")
                raw = await read_bounded(reply, MAX_TOKEN_ANSWER, f"{ref.registry}: the token answer")
            finally:
                await reply.aclose()
        body = _json_object(raw, f"{ref.registry}: the token answer")
        token = body.get("token") or body.get("access_token")
        if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN or not TOKEN.fullmatch(token):
            raise RegistryError(f"{ref.registry}: the token answer has no usable token", status=502)
        return "Bearer " + token

    async def _document(self, ref: ImageRef, path: str, limit: int, what: str, **headers: str) -> tuple[bytes, str]:
        """A whole answer read (a manifest, an index, a config): bounded in size and in time.
        Returns the body and its content type."""
        # outermost: the deadline's TimeoutError is the registry's too
        with _talking_to(ref, self.read_timeout):
            async with asyncio.timeout(DOCUMENT_DEADLINE), self._get(ref, path, headers) as response:
                if response.status_code == 404:
                    raise image_not_found(ref, what)
                if response.status_code != 200:
                    raise RegistryError(
                        f"failed to pull image '{ref}': registry returned status code {response.status_code} ({what})",
                        status=502,
                    )
                return await read_bounded(response, limit, f"{ref}: {what}"), response.headers.get("content-type", "")

    async def _manifest(self, ref: ImageRef, reference: str) -> tuple[str, dict[str, Any], str]:
        raw, content_type = await self._document(
            ref, f"manifests/{reference}", MAX_DOCUMENT, f"manifest {reference}", Accept=ACCEPT
        )
        digest = "sha256:" + hashlib.sha256(raw).hexdigest()
        if reference.startswith("sha256:") and digest != reference:
            raise RegistryError(
                f"failed to pull image '{ref}': manifest digest mismatch ({digest} != {reference})", status=502
            )
        body = _json_object(raw, f"{ref}: manifest {reference}")
        kind = body.get("mediaType") or content_type.split(";")[0]
        if kind not in INDEXES | MANIFESTS:
            kind = OCI_INDEX if "manifests" in body else OCI_MANIFEST
        return kind, body, digest

    async def resolve(self, ref: ImageRef, platform_: tuple[str, str] | None = None) -> Image:
        """The image ``ref`` names, for ``platform_`` (default: this host's)."""
        want_os, want_arch = platform_ or host_platform()
        kind, body, digest = await self._manifest(ref, ref.reference)
        if kind in INDEXES:
            entries = [m for m in body.get("manifests") or [] if isinstance(m, dict)]
            platforms: list[dict[str, Any]] = [p if isinstance(p := m.get("platform"), dict) else {} for m in entries]
            pairs = zip(entries, platforms, strict=True)
            chosen = [m for m, p in pairs if (p.get("os"), p.get("architecture")) == (want_os, want_arch)]
            if not chosen:
                offered = sorted(snippet(f"{p.get('os')}/{p.get('architecture')}", 40) for p in platforms)[:20]
                raise InvalidRequest(f"image {ref} has no {want_os}/{want_arch} variant (has {', '.join(offered)})")
            kind, body, digest = await self._manifest(ref, _descriptor(chosen[0], f"{ref}: an index entry")["digest"])
        config_desc = _descriptor(body.get("config"), f"{ref}: the manifest's config")
        config = _json_object(await self._config(ref, config_desc), f"{ref}: the image config")
        # A single-platform image says its platform in its config only (an index, in each entry).
        os_, arch = config.get("os"), config.get("architecture")
        if isinstance(os_, str) and isinstance(arch, str):
            arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(arch.lower(), arch.lower())
            if (os_.lower(), arch) != (want_os, want_arch):
                raise InvalidRequest(
                    f"image {ref} is {snippet(f'{os_}/{arch}', 40)}, not {want_os}/{want_arch}: it cannot run here"
                )
        layers = [_descriptor(layer, f"{ref}: a layer") for layer in body.get("layers") or []]
        rootfs = config.get("rootfs")
        diff_ids = rootfs.get("diff_ids") if isinstance(rootfs, dict) else None
        if not isinstance(diff_ids, list) or len(layers) != len(diff_ids):
            raise RegistryError(f"{ref}: manifest and config disagree on the layer count", status=502)
        return Image(ref, digest, body, config, layers)

    async def _config(self, ref: ImageRef, desc: dict[str, Any]) -> bytes:
        digest = desc["digest"]
        what = f"config blob {digest}"
        if desc["size"] > MAX_DOCUMENT:
            raise RegistryError(f"{ref}: {what} is {desc['size']} bytes, more than {MAX_DOCUMENT}", status=502)
        raw, _ = await self._document(ref, f"blobs/{digest}", desc["size"], what)
        if "sha256:" + hashlib.sha256(raw).hexdigest() != digest:
            raise RegistryError(f"failed to pull image '{ref}': blob {digest} does not match its digest", status=502)
        return raw

    async def stream_blob(
        self,
        ref: ImageRef,
        desc: dict[str, Any],
        sink: Callable[[bytes], Awaitable[None]],
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Hand the blob ``desc`` describes to ``sink`` as it arrives; return once it came whole and
        matched its digest. A blob larger than its descriptor says is refused as it arrives, a
        shorter one or one of other bytes at its end: what the sink got must then be thrown away."""
        digest, size = desc["digest"], desc["size"]
        hasher = hashlib.sha256()
        written = 0
        async with self._get(ref, f"blobs/{digest}") as response:
            if response.status_code != 200:
                raise RegistryError(
                    f"failed to pull image '{ref}': registry returned status code {response.status_code} "
                    f"for blob {digest}",
                    status=502,
                )
            too_large = RegistryError(
                f"failed to pull image '{ref}': blob {digest} is larger than its descriptor's {size} bytes", status=502
            )
            declared = response.headers.get("content-length", "")
            if declared.isdecimal() and int(declared) > size:
                raise too_large
            async for chunk in response.aiter_raw(CHUNK):
                written += len(chunk)
                if written > size:
                    raise too_large
                hasher.update(chunk)
                await sink(chunk)
                if on_bytes is not None:
                    on_bytes(len(chunk))
        if written < size:
            raise RegistryError(
                f"failed to pull image '{ref}': blob {digest} ended after {written} of its {size} bytes", status=502
            )
        if "sha256:" + hasher.hexdigest() != digest:
            raise RegistryError(f"failed to pull image '{ref}': blob {digest} does not match its digest", status=502)

    async def fetch_blob(
        self, ref: ImageRef, desc: dict[str, Any], dest: Path, on_bytes: Callable[[int], None] | None = None
    ) -> None:
        """Stream the blob ``desc`` describes to ``dest``, verifying its digest (see
        :meth:`stream_blob`). A bad blob leaves no file."""
        tmp = dest.with_name(dest.name + ".part")
        try:
            with open(tmp, "wb") as out:

                async def write(chunk: bytes) -> None:
                    out.write(chunk)

                await self.stream_blob(ref, desc, write, on_bytes)
            tmp.rename(dest)
        finally:
            tmp.unlink(missing_ok=True)
