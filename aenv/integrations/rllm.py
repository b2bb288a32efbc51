"""An rLLM-style sandbox on aenv.

rLLM is not on PyPI, so nothing is imported from it: ``AenvSandbox`` has the methods rLLM's SDK
sandbox backends have (``exec``, ``upload_file``, ``upload_dir``, ``start_agent_process``,
``get_endpoint``, ``close``) and ``create_aenv_sandbox(name, image)`` is the factory shape its
orchestrator calls. ``image`` names an aenv template or snapshot. ``get_endpoint(port)`` returns
the node's URL and the headers that route a request to that port of this sandbox, so an rLLM
worker server inside it is reached without publishing anything.

    from aenv.integrations.rllm import create_aenv_sandbox

    sbx = create_aenv_sandbox("rollout-0", image="base")
    sbx.upload_dir("./agent", "/home/user/agent")
    sbx.start_agent_process("python3 /home/user/agent/server.py --port 8100", port=8100)
    url, headers = sbx.get_endpoint(8100)
    print(httpx.post(f"{url}/run", headers=headers, json={...}).json())
    sbx.close()
"""

from __future__ import annotations

import logging
import os
import shlex
import time
from pathlib import Path

from aenv.errors import AenvError
from aenv.sdk import Client, Sandbox

logger = logging.getLogger(__name__)


class AenvSandbox:
    """One aenv sandbox behind rLLM's sandbox interface."""

    def __init__(
        self,
        name: str,
        image: str = "base",
        *,
        url: str | None = None,
        api_key: str | None = None,
        timeout: int = 3600,
        health_path: str = "/health",
        sandbox_id: str | None = None,
    ) -> None:
        self.name = name
        self.image = image
        self.health_path = health_path
        self._client = Client(url, api_key)
        try:
            if sandbox_id is not None:
                self.sandbox: Sandbox = self._client.connect(sandbox_id)
            else:
                self.sandbox = self._client.create(image, timeout=timeout, metadata={"rllm-sandbox": name[:200]})
        except BaseException:
            self._client.close()
            raise
        logger.info("AenvSandbox %s created (sandbox %s, template %s)", name, self.sandbox.sandbox_id, image)

    def exec(self, command: str, timeout: float | None = None, user: str | None = None) -> str:
        """Run ``command`` with bash; its stdout, or RuntimeError naming the exit code and stderr."""
        r = self.sandbox.exec(["bash", "-c", command], timeout=timeout or None, user=user)
        if r.exit_code != 0:
            raise RuntimeError(
                f"Command failed (exit {r.exit_code}) in sandbox {self.name}: {command}\n{r.stderr[:500]}"
            )
        return r.stdout

    def upload_file(self, local_path: str, remote_path: str) -> None:
        path = Path(local_path)
        self.sandbox.write(remote_path, path.read_bytes())
        if os.access(path, os.X_OK):
            self.sandbox.exec(["chmod", "+x", remote_path])

    def upload_dir(self, local_path: str, remote_path: str) -> None:
        """Upload a directory tree (regular files; links are not followed) to ``remote_path``."""
        root = Path(local_path)
        executable: list[str] = []
        for path in sorted(root.rglob("*")):
            if path.is_symlink() or not path.is_file():
                continue
            target = f"{remote_path.rstrip('/')}/{path.relative_to(root).as_posix()}"
            self.sandbox.write(target, path.read_bytes())
            if os.access(path, os.X_OK):
                executable.append(target)
        if executable:
            self.sandbox.exec(["chmod", "+x", *executable])

    def start_agent_process(self, command: str, port: int, timeout: float = 30.0) -> None:
        """Start ``command`` in the background and wait until ``port`` answers ``health_path``."""
        self.sandbox.exec(f"setsid nohup bash -c {shlex.quote(command)} > /tmp/worker.log 2>&1 < /dev/null &")
        deadline = time.monotonic() + timeout
        probe = f"curl -sf -o /dev/null --max-time 2 http://127.0.0.1:{port}{self.health_path}"
        while time.monotonic() < deadline:
            if self.sandbox.exec(probe, timeout=10).exit_code == 0:
                return
            time.sleep(0.3)
        tail = self.sandbox.exec("tail -c 2000 /tmp/worker.log").stdout
        raise TimeoutError(f"worker did not answer on port {port} within {timeout}s in sandbox {self.name}:\n{tail}")

    def get_endpoint(self, port: int) -> tuple[str, dict[str, str]]:
        """(the node's URL, the headers that route a request there to ``port`` of this sandbox)."""
        headers = {"E2b-Sandbox-Id": self.sandbox.sandbox_id, "E2b-Sandbox-Port": str(port)}
        return self._client.config.url, headers

    def fork(self, n: int) -> list[AenvSandbox]:
        """``n`` sandboxes forked from this one, running processes included (a started worker too)."""
        cfg = self._client.config
        return [
            AenvSandbox(f"{self.name}-{i}", self.image, url=cfg.url, api_key=cfg.api_key, sandbox_id=c.sandbox_id)
            for i, c in enumerate(self.sandbox.fork(n))
        ]

    def close(self) -> None:
        try:
            self.sandbox.kill()
        except AenvError:
            pass
        self._client.close()
        logger.info("AenvSandbox %s closed", self.name)


def create_aenv_sandbox(name: str, image: str = "base", **kwargs: object) -> AenvSandbox:
    """Factory in the shape of rLLM's backends (``create_docker_sandbox(name, image)``)."""
    return AenvSandbox(name, image, **kwargs)  # type: ignore[arg-type]
