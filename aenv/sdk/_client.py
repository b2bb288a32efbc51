"""The native async SDK's entry point: creating and finding sandboxes, and what a node or a cluster
offers besides them (templates and builds, images, nodes and drains, logs, the repository,
snapshots).

A sandbox's own calls are on :class:`~aenv.sdk._sandbox.AsyncSandbox`; both are imported from
:mod:`aenv.sdk`.
"""

from __future__ import annotations

import asyncio
import builtins
import json
import os
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO, Literal

import httpx

from aenv.errors import AenvError, from_body
from aenv.sdk._config import ClientConfig
from aenv.sdk._sandbox import AsyncSandbox, SandboxInfo
from aenv.sdk._templates import ProgressFn, _chunks_of, _pack_context, _recipe_in, _template_stream
from aenv.sdk._wire import raise_for as _raise_for


class AsyncClient:
    """Entry point: ``async with AsyncClient() as c: sbx = await c.create()``."""

    def __init__(
        self, url: str | None = None, api_key: str | None = None, *, request_timeout: float | None = None
    ) -> None:
        self.config = ClientConfig.resolve(url, api_key, request_timeout)
        self._auth = {"X-API-Key": self.config.api_key} if self.config.api_key else {}
        self._http = httpx.AsyncClient(base_url=self.config.url, timeout=self.config.request_timeout)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the client's connections (its sandboxes live on)."""
        await self._http.aclose()

    async def _get(self, path: str, params: Mapping[str, Any] | None = None) -> Any:
        r = await self._http.get(path, params=params, headers=self._auth)
        _raise_for(r)
        return r.json()

    async def _post(self, path: str, body: Mapping[str, Any]) -> Any:
        r = await self._http.post(path, json=body, headers=self._auth)
        _raise_for(r)
        return r.json() if r.content else {}

    async def create(
        self,
        template: str = "base",
        *,
        timeout: int | None = None,
        metadata: Mapping[str, str] | None = None,
        envs: Mapping[str, str] | None = None,
        auto_pause: bool = False,
        keep_memory: bool = True,
        limits: Mapping[str, Any] | None = None,
        auto_resume: bool = False,
        grace: int | None = None,
        image: str | None = None,
        volumes: Mapping[str, str] | None = None,
    ) -> AsyncSandbox:
        """A new sandbox; with ``auto_pause`` its timeout pauses it (keeping only its file system
        unless ``keep_memory``) instead of killing it; with ``auto_resume`` its use (a command, a
        file, its ports) resumes it when paused with its memory. ``timeout``: seconds it runs
        (the node's default, 300, when None), and again after each resume that names none.
        ``grace``: seconds it is held after its timeout for scoring: its commands stop at the
        timeout, only ``exec(..., scoring=True)`` runs until the grace period ends it.
        ``volumes``: the team's volumes it mounts, mount path -> volume name (docs/volumes.md)."""
        body: dict[str, Any] = {"templateID": template, "metadata": dict(metadata or {}), "envVars": dict(envs or {})}
        if timeout is not None:
            body["timeout"] = timeout
        if grace:
            body["grace"] = grace
        if auto_pause:
            body["autoPause"] = True
        if auto_resume:
            body["autoResume"] = True
        if not keep_memory:
            body["autoPauseMemory"] = False
        if limits:
            body["limits"] = dict(limits)
        if volumes:
            body["volumeMounts"] = [{"name": name, "path": path} for path, name in volumes.items()]
        if image is not None:  # an OCI image reference, pulled and built on its first create
            del body["templateID"]
            body["image"] = image
        return AsyncSandbox(self, await self._post("/v2/sandboxes", body))

    async def connect(self, sandbox_id: str, *, timeout: int | None = None) -> AsyncSandbox:
        """A handle on an existing sandbox; a paused one is resumed, with its own timeout unless
        ``timeout`` names one (as a sandbox's ``resume``)."""
        body = await self._post(f"/v2/sandboxes/{sandbox_id}/connect", {"timeout": timeout} if timeout else {})
        return AsyncSandbox(self, body)

    async def list(
        self,
        *,
        state: list[str] | None = None,
        metadata: Mapping[str, str] | None = None,
        all_teams: bool = False,
    ) -> list[SandboxInfo]:
        """The sandboxes in these states (all when ``state`` is None) with this metadata; with
        ``all_teams``, every team's (the deployment's admin key only: ``X-Team-ID: *``)."""
        from urllib.parse import quote

        params: dict[str, Any] = {}
        if state:
            params["state"] = ",".join(state)
        if metadata:
            params["metadata"] = "&".join(f"{quote(k)}={quote(v)}" for k, v in metadata.items())
        out: builtins.list[SandboxInfo] = []
        token: str | None = None
        while True:
            if token:
                params["nextToken"] = token
            headers = {**self._auth, "X-Team-ID": "*"} if all_teams else self._auth
            r = await self._http.get("/v2/sandboxes", params=params, headers=headers)
            _raise_for(r)
            out += [SandboxInfo.from_json(b) for b in r.json()]
            token = r.headers.get("x-next-token")
            if not token:
                return out

    async def templates(self) -> builtins.list[dict[str, Any]]:
        """The node's templates."""
        result: builtins.list[dict[str, Any]] = await self._get("/templates")
        return result

    async def warm_pool(self, template: str, size: int | None | Literal["keep"] = "keep") -> dict[str, Any]:
        """The template's warm pool (idle sandboxes restored ahead of creates); with ``size``, first
        set the most it keeps (None: back to the node's default, ``AENV_WARM_POOL``)."""
        from urllib.parse import quote

        path = f"/templates/{quote(template, safe='')}/warm-pool"
        if size == "keep":
            result: dict[str, Any] = await self._get(path)
            return result
        r = await self._http.put(path, json={"size": size}, headers=self._auth)
        _raise_for(r)
        answer: dict[str, Any] = r.json()
        return answer

    async def template_from_image(
        self,
        name: str,
        image: str,
        *,
        username: str | None = None,
        password: str | None = None,
        on_log: Callable[[str], None] | None = None,
        on_progress: Callable[[int, int, int, int], None] | None = None,
    ) -> dict[str, Any]:
        """Pull ``image`` (an OCI reference; ``username``/``password`` for a private registry,
        used for this pull only) and commit it as template ``name``. With ``on_log`` or
        ``on_progress(layer, layers, done, total)`` the node streams the pull as it goes."""
        body: dict[str, Any] = {"name": name, "image": image}
        if username:
            body.update(username=username, password=password or "")
        if on_log is None and on_progress is None:
            r = await self._http.post("/templates/from-image", json=body, headers=self._auth, timeout=3600)
            _raise_for(r)
            result: dict[str, Any] = r.json()
            return result
        headers = {**self._auth, "Accept": "application/x-ndjson"}
        async with self._http.stream("POST", "/templates/from-image", json=body, headers=headers, timeout=None) as r:
            return await _template_stream(r, on_log, on_progress)

    async def fetch_template(
        self, name: str, *, on_progress: Callable[[int, int], None] | None = None
    ) -> dict[str, Any]:
        """Bring a committed template's or snapshot's files into the node's cache from the
        repository, ahead of its first create; ``on_progress(done, total)`` in bytes. Returns
        ``{"template" | "snapshot": ..., "fetchedBytes": N}``."""
        from urllib.parse import quote

        path = f"/templates/{quote(name, safe='')}/fetch"
        if on_progress is None:
            r = await self._http.post(path, headers=self._auth, timeout=None)
            _raise_for(r)
            result: dict[str, Any] = r.json()
            return result
        headers = {**self._auth, "Accept": "application/x-ndjson"}
        async with self._http.stream("POST", path, headers=headers, timeout=None) as r:
            if r.status_code != 200:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                item = json.loads(line) if line.strip() else {}
                if "progress" in item:
                    on_progress(item["progress"]["done"], item["progress"]["total"])
                elif "error" in item:
                    raise from_body(int(item["error"].get("code", 500)), item["error"])
                elif "fetchedBytes" in item:
                    return dict(item)
        raise AenvError("the fetch's stream ended without a result")

    async def build(
        self,
        name: str,
        context: str | os.PathLike[str] = ".",
        *,
        dockerfile: str = "Dockerfile",
        build_args: Mapping[str, str] | None = None,
        on_log: Callable[[str], None] | None = None,
        on_upload: ProgressFn | None = None,
    ) -> dict[str, Any]:
        """Build template ``name`` from ``context``/``dockerfile``; build logs go to ``on_log``,
        ``on_upload(sent, total)`` follows the packed context's upload. An absolute ``dockerfile``
        may be anywhere (as ``docker build -f``): one outside the context is sent along with it
        under a name of its own."""
        dockerfile, outside = _recipe_in(Path(context), dockerfile)
        params: builtins.list[tuple[str, Any]] = [("name", name), ("dockerfile", dockerfile)]
        params += [("buildArg", f"{k}={v}") for k, v in (build_args or {}).items()]
        # Packed to a temporary file, not memory: contexts of several GiB exist (datasets, weights).
        with tempfile.TemporaryFile() as packed:
            await asyncio.to_thread(_pack_context, packed, Path(context), outside, dockerfile)
            size = packed.tell()
            packed.seek(0)
            return await self._send_build(packed, size, params, on_log, on_upload)

    async def build_builtin(
        self, name: str = "desktop", *, browser: str | None = None, on_log: Callable[[str], None] | None = None
    ) -> dict[str, Any]:
        """Build a built-in template (``desktop``) on the node anew, its log to ``on_log`` (the
        deployment's admin key; minutes: packages downloaded and installed, the desktop started
        and snapshotted)."""
        params = {"browser": browser} if browser else None
        async with self._http.stream(
            "POST", f"/templates/builtin/{name}", params=params, headers=self._auth, timeout=None
        ) as r:
            return await _template_stream(r, on_log, None)

    async def _send_build(
        self,
        packed: BinaryIO,
        size: int,
        params: builtins.list[tuple[str, Any]],
        on_log: Callable[[str], None] | None,
        on_upload: ProgressFn | None,
    ) -> dict[str, Any]:
        headers = {**self._auth, "Content-Length": str(size)}
        body = _chunks_of(packed, size, on_upload)
        async with self._http.stream(
            "POST", "/templates/build", params=params, content=body, headers=headers, timeout=None
        ) as r:
            return await _template_stream(r, on_log, None)

    async def nodes(self) -> builtins.list[dict[str, Any]]:
        """A cluster's nodes with their load (a gateway's ``GET /nodes``; a lone node has none):
        E2B's node fields (``nodeID``, ``status``: ready, draining or unhealthy, ``sandboxCount``,
        ``allocatedCPU``, ...) and aenv's (``address``, ``room``, ``maxSandboxes``, ...)."""
        result: builtins.list[dict[str, Any]] = await self._get("/nodes")
        return result

    async def node(self, node_id: str) -> dict[str, Any]:
        """One node of a cluster (a gateway's ``GET /nodes/{id}``)."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/nodes/{quote(node_id, safe='')}")
        return result

    async def drain_node(
        self, node_id: str, *, move: bool = False, on_progress: Callable[[dict[str, Any]], None] | None = None
    ) -> dict[str, Any]:
        """Drain a cluster's node (a gateway's ``POST /nodes/{id}/drain``): it takes no new work and
        pauses its running sandboxes durably (``move``: and resumes them on other nodes). Each
        progress report goes to ``on_progress``; returns the last one (``done``)."""
        from urllib.parse import quote

        path = f"/nodes/{quote(node_id, safe='')}/drain"
        last: dict[str, Any] | None = None
        async with self._http.stream("POST", path, json={"move": move}, headers=self._auth, timeout=None) as r:
            if r.status_code != 200:
                await r.aread()
                _raise_for(r)
            async for line in r.aiter_lines():
                if not line.strip():
                    continue
                last = json.loads(line)
                if on_progress is not None:
                    on_progress(last)
        if last is None or not last.get("done"):
            raise AenvError("the drain's progress stream ended before the drain did")
        return last

    async def undrain_node(self, node_id: str) -> dict[str, Any]:
        """Take a drained (or draining) node back (a gateway's ``POST /nodes/{id}/undrain``): it
        takes new work again and a drain under way stops; a node not draining is left as it is.
        Returns the node as it is after (``status`` ready)."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._post(f"/nodes/{quote(node_id, safe='')}/undrain", {})
        return result

    async def logs(self, sandbox_id: str) -> dict[str, Any]:
        """A sandbox's recent commands (newest first, with their exit codes) and its log (the node's
        events for it and its agent's lines, oldest first)."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/sandboxes/{quote(sandbox_id, safe='')}/logs")
        return result

    async def rollout_log(self, sandbox_id: str) -> builtins.list[dict[str, Any]]:
        """A sandbox's rollout log by id (see the sandbox's ``rollout_log``), without resuming it."""
        from urllib.parse import quote

        r = await self._http.get(f"/sandboxes/{quote(sandbox_id, safe='')}/rollout-log", headers=self._auth)
        _raise_for(r)
        return [json.loads(line) for line in r.text.splitlines() if line.strip()]

    async def overview(self) -> dict[str, Any]:
        """What the dashboard shows of a node or a cluster: ``nodes`` (state, load, capacity,
        cache use) and ``stats`` (lifecycle counters and latency histograms, commands by outcome
        and their start latency, since start)."""
        nodes, stats = await asyncio.gather(self._get("/dashboard/api/nodes"), self._get("/dashboard/api/stats"))
        return {"nodes": nodes, "stats": stats}

    async def images(self) -> builtins.list[dict[str, Any]]:
        """The images the node holds as templates, or evicted: reference, digest, template id,
        size (its compressed layers), bytes stored here, last use, in use, state (local or evicted)."""
        result: builtins.list[dict[str, Any]] = await self._get("/images")
        return result

    async def prefetch_images(self, images: Sequence[str]) -> dict[str, Any]:
        """Start pulling ``images`` and making them templates ahead of their first creates; the
        job (``prefetchID``, each image's ``state``: pending, pulling, ready or failed)."""
        result: dict[str, Any] = await self._post("/images/prefetch", {"images": list(images)})
        return result

    async def prefetch_status(self, prefetch_id: str) -> dict[str, Any]:
        """A prefetch's progress: each image's state, bytes pulled, template id or error."""
        from urllib.parse import quote

        result: dict[str, Any] = await self._get(f"/images/prefetch/{quote(prefetch_id, safe='')}")
        return result

    async def repository(self) -> dict[str, Any]:
        """Where the node commits templates and snapshots, and what is not committed yet."""
        result: dict[str, Any] = await self._get("/repository")
        return result

    async def repository_gc(self) -> dict[str, Any]:
        """Collect repository chunks no template or snapshot needs any more."""
        result: dict[str, Any] = await self._post("/repository/gc", {})
        return result

    async def snapshots(self) -> builtins.list[dict[str, Any]]:
        """Every snapshot, newest first (the API answers them in pages)."""
        out: builtins.list[dict[str, Any]] = []
        params: dict[str, Any] = {}
        while True:
            r = await self._http.get("/snapshots", params=params, headers=self._auth)
            _raise_for(r)
            out += r.json()
            params["nextToken"] = r.headers.get("x-next-token")
            if not params["nextToken"]:
                return out

    async def delete_snapshot(self, snapshot_id: str) -> None:
        """Delete a snapshot (sandboxes made from it live on)."""
        r = await self._http.delete(f"/snapshots/{snapshot_id}", headers=self._auth)
        _raise_for(r)
