"""A SWE-ReX deployment on aenv: `pip install 'aenv[swerex]'`.

SWE-ReX's own server (``swerex-remote``, the same package and version as the client's) runs
inside an aenv sandbox; its runtime is SWE-ReX's ``RemoteRuntime``, reaching that server through
the node's port proxy. So everything SWE-agent does through a runtime (bash sessions,
interactive programs, uploads) is SWE-ReX's own code on both ends.

    from aenv.integrations.swerex import AenvDeployment
    from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

    deployment = AenvDeployment(template="base")
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    print((await deployment.runtime.run_in_session(BashAction(command="python3 -V"))).output)
    await deployment.stop()

The server is installed into the sandbox without the sandbox reaching a package index: the host
downloads SWE-ReX's wheels for the sandbox's Python once (pip, into a cache directory), uploads
them and installs them into ``/opt/swerex``; the installed sandbox is then kept as a snapshot
named ``swerex-<version>-<template>``, so every later deployment on the node is a create from it
(no install). A fresh auth token is made for each deployment.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import subprocess
import sys
from importlib.metadata import version as installed_version
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aenv.errors import AenvError, SnapshotNotFound, TemplateNotFound
from aenv.sdk import AsyncClient, AsyncSandbox

try:
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import DeploymentNotStartedError
    from swerex.runtime.abstract import IsAliveResponse
    from swerex.runtime.remote import RemoteRuntime
    from swerex.utils.wait import _wait_until_alive
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError("aenv.integrations.swerex needs SWE-ReX: pip install 'aenv[swerex]'") from exc

VENV = "/opt/swerex"
WHEEL_CACHE = Path(os.environ.get("AENV_SWEREX_WHEELS", Path.home() / ".cache" / "aenv" / "swerex-wheels"))


class AenvDeploymentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    template: str = "base"
    """The template (or snapshot) the sandbox is created from; it needs python3 with venv."""
    url: str | None = None
    """The aenv node or gateway [default: AENV_URL]."""
    api_key: str | None = None
    """[default: AENV_API_KEY, or the node's key file]"""
    port: int = Field(8000, ge=1, le=65535)
    """The port swerex-remote listens on inside the sandbox."""
    sandbox_timeout: int = Field(3600, ge=1)
    """Seconds the sandbox lives unless stopped first (it is killed then)."""
    startup_timeout: float = 120.0
    """Seconds to wait for the install and the server."""
    runtime_timeout: float = 60.0
    """The RemoteRuntime's timeout for a request (SWE-ReX's default is 0.15 s, for a local server)."""
    swerex_version: str | None = None
    """The swe-rex version to run in the sandbox [default: the one installed here]."""
    cache_snapshot: bool = True
    """Keep the installed sandbox as a snapshot, so later deployments skip the install."""
    metadata: dict[str, str] = Field(default_factory=dict)


class AenvRemoteRuntime(RemoteRuntime):
    """SWE-ReX's RemoteRuntime, its requests routed by the node to the sandbox's port."""

    def __init__(self, *, sandbox_id: str, sandbox_port: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._route = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(sandbox_port)}

    @property
    def _headers(self) -> dict[str, str]:
        return {**super()._headers, **self._route}


class AenvDeployment(AbstractDeployment):
    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        """SWE-ReX in an aenv sandbox; see ``AenvDeploymentConfig`` for the keyword arguments."""
        self._config = AenvDeploymentConfig(**kwargs)
        self.logger = logger or logging.getLogger("aenv.swerex")
        self._hooks = CombinedDeploymentHook()
        self._client: AsyncClient | None = None
        self._sandbox: AsyncSandbox | None = None
        self._runtime: AenvRemoteRuntime | None = None
        self._runtime_args: dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: AenvDeploymentConfig) -> AenvDeployment:
        return cls(**config.model_dump())

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    @property
    def sandbox(self) -> AsyncSandbox:
        """The aenv sandbox (fork, snapshot and pause it as any other)."""
        if self._sandbox is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._sandbox

    @property
    def runtime(self) -> RemoteRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return self._runtime

    def new_runtime(self) -> AenvRemoteRuntime:
        """Another RemoteRuntime on this deployment's server (``runtime`` is one)."""
        if not self._runtime_args:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return AenvRemoteRuntime(logger=self.logger, **self._runtime_args)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            raise DeploymentNotStartedError()  # type: ignore[no-untyped-call]
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        cfg = self._config
        version = cfg.swerex_version or installed_version("swe-rex")
        self._client = AsyncClient(cfg.url, cfg.api_key)
        try:
            self._sandbox = await self._installed(version)
            token = secrets.token_hex(16)
            self._hooks.on_custom_step("Starting swerex-remote in the sandbox")
            # setsid and redirected output: the server outlives this exec, which returns at once
            await self._sandbox.exec(
                f"setsid nohup {VENV}/bin/swerex-remote --host 127.0.0.1 --port {cfg.port} "
                f"--auth-token {token} > /tmp/swerex.log 2>&1 < /dev/null &",
                user="root",
                timeout=30,
            )
            assert self._client is not None
            self._runtime_args = {
                "sandbox_id": self._sandbox.sandbox_id,
                "sandbox_port": cfg.port,
                "host": self._client.config.url,
                "auth_token": token,
                "timeout": cfg.runtime_timeout,
            }
            self._runtime = self.new_runtime()
            await _wait_until_alive(self._runtime.is_alive, timeout=cfg.startup_timeout, function_timeout=5)
        except BaseException:
            await self.stop()
            raise

    async def _installed(self, version: str) -> AsyncSandbox:
        """A sandbox with swe-rex ``version`` in /opt/swerex: from the cached snapshot, or installed."""
        cfg, client = self._config, self._client
        assert client is not None
        snapshot = _snapshot_name(version, cfg.template)
        meta = {"swerex": version, **cfg.metadata}
        if cfg.cache_snapshot:
            try:
                return await client.create(snapshot, timeout=cfg.sandbox_timeout, metadata=meta)
            except (TemplateNotFound, SnapshotNotFound):
                pass
        sbx = await client.create(cfg.template, timeout=cfg.sandbox_timeout, metadata=meta)
        try:
            await self._install(sbx, version)
            if cfg.cache_snapshot:
                try:
                    await sbx.snapshot(snapshot)
                except AenvError as exc:  # another deployment's snapshot won the name: fine
                    self.logger.debug("snapshot %s not kept: %s", snapshot, exc.message)
        except BaseException:
            await _kill(sbx)
            raise
        return sbx

    async def _install(self, sbx: AsyncSandbox, version: str) -> None:
        probe = await sbx.exec(
            "python3 -c 'import platform,sys; print(\"%d.%d\" % sys.version_info[:2], platform.machine())'",
            timeout=30,
        )
        if probe.exit_code != 0:
            raise AenvError(f"template {self._config.template!r} has no python3: {probe.stderr.strip()[:200]}")
        py, machine = probe.stdout.split()
        self._hooks.on_custom_step(f"Downloading swe-rex {version} wheels for Python {py} ({machine})")
        wheels = await asyncio.to_thread(download_wheels, version, py, machine)
        self._hooks.on_custom_step(f"Installing swe-rex {version} into the sandbox")
        await sbx.exec(f"mkdir -p /tmp/swerex-wheels {VENV} && chmod 777 /tmp/swerex-wheels", user="root")
        for wheel in sorted(wheels.glob("*.whl")):
            await sbx.write(f"/tmp/swerex-wheels/{wheel.name}", wheel.read_bytes())
        r = await sbx.exec(
            f"python3 -m venv {VENV} && {VENV}/bin/pip install -q --no-index --find-links /tmp/swerex-wheels "
            f"'swe-rex=={version}' && rm -rf /tmp/swerex-wheels",
            user="root",
            timeout=self._config.startup_timeout,
        )
        if r.exit_code != 0:
            raise AenvError(f"installing swe-rex {version} in the sandbox failed: {(r.stderr or r.stdout)[-2000:]}")

    async def stop(self) -> None:
        if self._runtime is not None:
            try:
                await self._runtime.close()
            except Exception:  # noqa: BLE001 - the sandbox is killed next in any case
                pass
            self._runtime, self._runtime_args = None, {}
        if self._sandbox is not None:
            await _kill(self._sandbox)
            self._sandbox = None
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _snapshot_name(version: str, template: str) -> str:
    name = f"swerex-{version}-{template}".lower()
    return re.sub(r"[^a-z0-9._-]", "-", name)[:63]


def download_wheels(version: str, python: str, machine: str) -> Path:
    """The wheels of swe-rex ``version`` and its dependencies for CPython ``python`` on Linux
    ``machine``, downloaded once into the cache directory (``AENV_SWEREX_WHEELS``)."""
    target = WHEEL_CACHE / f"{version}-cp{python.replace('.', '')}-{machine}"
    if (target / ".complete").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    platforms = [f"manylinux{v}_{machine}" for v in ("2014", "_2_17", "_2_28", "1", "2010")] + ["any"]
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "-d", str(target)]
    cmd += ["--only-binary=:all:", "--implementation", "cp", "--python-version", python]
    for platform in platforms:
        cmd += ["--platform", platform]
    cmd.append(f"swe-rex=={version}")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise AenvError(f"pip could not download swe-rex {version} for Python {python}: {done.stderr[-2000:]}")
    (target / ".complete").touch()
    return target


async def _kill(sbx: AsyncSandbox) -> None:
    try:
        await sbx.kill()
    except AenvError:
        pass
