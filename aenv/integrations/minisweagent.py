"""A mini-swe-agent environment on aenv: `pip install 'aenv[minisweagent]'`.

``AenvEnvironment`` has the methods of mini-swe-agent's ``Environment`` protocol and the
configuration of its ``DockerEnvironment`` (``cwd``, ``env``, ``forward_env``, ``timeout``,
``interpreter``), with an aenv template in place of an image; each command runs in the
environment's own sandbox, stdout and stderr merged in order as ``docker exec`` gives them.

    from minisweagent.agents.default import DefaultAgent
    from minisweagent.models import get_model
    from aenv.integrations.minisweagent import AenvEnvironment

    env = AenvEnvironment(template="base", cwd="/home/user")
    agent = DefaultAgent(get_model(input_model_name="..."), env)
    agent.run("Fix the failing test in /home/user/repo")
    env.cleanup()

In a YAML config: ``environment_class: aenv.integrations.minisweagent.AenvEnvironment``.
"""

from __future__ import annotations

import logging
import os
import platform
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from aenv.errors import AenvError, OperationTimeout
from aenv.sdk import Client, Sandbox


class AenvEnvironmentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    template: str = "base"
    """The template (or snapshot) the sandbox is created from."""
    cwd: str = "/"
    """Working directory in which to execute commands."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment variables to set for every command."""
    forward_env: list[str] = Field(default_factory=list)
    """Variables of this process passed on when set (``env`` wins on a conflict)."""
    timeout: int = 30
    """Seconds a command may run."""
    interpreter: list[str] = Field(default_factory=lambda: ["bash", "-lc"])
    """The command is appended to this argv (as mini-swe-agent's Docker environment does)."""
    user: str | None = None
    """Whom commands run as [default: the template's user]."""
    sandbox_timeout: int = 7200
    """Seconds the sandbox lives unless cleaned up first."""
    url: str | None = None
    api_key: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class AenvEnvironment:
    def __init__(
        self,
        *,
        config_class: type[AenvEnvironmentConfig] = AenvEnvironmentConfig,
        logger: logging.Logger | None = None,
        sandbox_id: str | None = None,
        **kwargs: Any,
    ) -> None:
        """Commands in an aenv sandbox; ``sandbox_id`` adopts one already made (a fork's child,
        say), otherwise one is created from ``template``. See ``AenvEnvironmentConfig``."""
        self.logger = logger or logging.getLogger("minisweagent.environment")
        self.config = config_class(**kwargs)
        self._client: Client | None = Client(self.config.url, self.config.api_key)
        self.sandbox: Sandbox | None = None
        try:
            if sandbox_id is not None:
                self.sandbox = self._client.connect(sandbox_id)
            else:
                cfg = self.config
                self.sandbox = self._client.create(cfg.template, timeout=cfg.sandbox_timeout, metadata=cfg.metadata)
        except BaseException:
            self.cleanup()
            raise

    def execute(self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None) -> dict[str, Any]:
        """Run ``action["command"]``: ``{"output", "returncode", "exception_info"}`` as mini-swe-agent's
        environments return it; a timeout is returncode -1 with its exception described."""
        if self.sandbox is None:
            raise RuntimeError("the environment was cleaned up")
        command = action.get("command", "")
        envs = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        envs.update(self.config.env)
        # one pipe for both streams, so the output interleaves as the command wrote it
        argv = ["/bin/sh", "-c", 'exec "$@" 2>&1', "sh", *self.config.interpreter, command]
        try:
            r = self.sandbox.exec(
                argv,
                cwd=cwd or self.config.cwd,
                envs=envs,
                user=self.config.user,
                timeout=timeout or self.config.timeout,
            )
            output: dict[str, Any] = {"output": r.stdout + r.stderr, "returncode": r.exit_code, "exception_info": ""}
        except (OperationTimeout, AenvError) as exc:
            output = {
                "output": "",
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {exc}",
                "extra": {"exception_type": type(exc).__name__, "exception": str(exc)},
            }
        self._check_finished(output)
        return output

    def _check_finished(self, output: dict[str, Any]) -> None:
        """mini-swe-agent's submission convention: a first line COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT."""
        lines = output.get("output", "").lstrip().splitlines(keepends=True)
        if lines and lines[0].strip() == "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT" and output["returncode"] == 0:
            from minisweagent.exceptions import Submitted

            submission = "".join(lines[1:])
            raise Submitted(
                {"role": "exit", "content": submission, "extra": {"exit_status": "Submitted", "submission": submission}}
            )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        out = {**self.config.model_dump(exclude={"api_key"}), **platform.uname()._asdict()}
        if self.sandbox is not None:
            out["sandbox_id"] = self.sandbox.sandbox_id
        return {**out, **kwargs}

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": self.config.model_dump(mode="json", exclude={"api_key"}),
                    "environment_type": f"{self.__class__.__module__}.{self.__class__.__name__}",
                }
            }
        }

    def fork(self, n: int) -> list[AenvEnvironment]:
        """``n`` environments whose sandboxes are forks of this one (files, processes, memory):
        branch one agent's state into n rollouts. Each is cleaned up on its own."""
        if self.sandbox is None:
            raise RuntimeError("the environment was cleaned up")
        settings = self.config.model_dump()
        return [AenvEnvironment(sandbox_id=child.sandbox_id, **settings) for child in self.sandbox.fork(n)]

    def cleanup(self) -> None:
        """Kill the sandbox (once)."""
        sandbox, self.sandbox = self.sandbox, None
        if sandbox is not None:
            try:
                sandbox.kill()
            except AenvError:
                pass
        if self._client is not None:
            self._client.close()
            self._client = None

    def __del__(self) -> None:
        try:
            self.cleanup()
        except Exception:  # noqa: BLE001 - at interpreter exit anything may be gone
            pass
