"""mini-swe-agent on aenv: its environment contract checked on its own LocalEnvironment and on
AenvEnvironment alike (the assertions of its Docker environment tests, which drive the docker CLI
and so cannot take another class), and its DefaultAgent, with its default config and its
DeterministicModel, solving a task on aenv."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from minisweagent import Environment
from minisweagent.agents.default import DefaultAgent
from minisweagent.config import builtin_config_dir
from minisweagent.environments.local import LocalEnvironment
from minisweagent.models.test_models import DeterministicModel, make_output

from aenv.integrations.minisweagent import AenvEnvironment


@pytest.fixture(params=["local", "aenv"])
def make_env(request: pytest.FixtureRequest) -> Iterator[Any]:
    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        env = LocalEnvironment(**kwargs) if request.param == "local" else AenvEnvironment(**kwargs)
        made.append(env)
        return env

    yield make
    for env in made:
        if isinstance(env, AenvEnvironment):
            env.cleanup()


def test_basic_execution(make_env: Any) -> None:
    env = make_env()
    for method in ("execute", "get_template_vars", "serialize"):  # the Environment protocol's
        assert callable(getattr(env, method)) and hasattr(Environment, method)
    result = env.execute({"command": "echo 'hello world'"})
    assert result["returncode"] == 0 and "hello world" in result["output"]


def test_set_env_variables(make_env: Any) -> None:
    env = make_env(env={"TEST_VAR": "test_value", "ANOTHER_VAR": "another_value"})
    assert "test_value another_value" in env.execute({"command": "echo $TEST_VAR $ANOTHER_VAR"})["output"]


def test_custom_cwd_and_override(make_env: Any) -> None:
    env = make_env(cwd="/tmp")
    assert "/tmp" in env.execute({"command": "pwd"})["output"]
    assert env.execute({"command": "pwd"}, cwd="/")["output"].strip() == "/"


def test_command_failure(make_env: Any) -> None:
    assert make_env().execute({"command": "exit 42"})["returncode"] == 42


def test_stderr_is_in_the_output(make_env: Any) -> None:
    out = make_env().execute({"command": "echo err >&2"})
    assert out["returncode"] == 0 and "err" in out["output"]


def test_timeout(make_env: Any) -> None:
    out = make_env(timeout=1).execute({"command": "sleep 10"})
    assert out["returncode"] == -1 and out["exception_info"]


def test_default_agent_solves_a_task_on_aenv() -> None:
    config = yaml.safe_load((builtin_config_dir / "default.yaml").read_text())["agent"]
    model = DeterministicModel(
        outputs=[
            make_output("Writing the file.", [{"command": "echo 42 > /tmp/answer"}]),
            make_output("Checking.", [{"command": "cat /tmp/answer"}]),
            make_output("Done.", [{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /tmp/answer"}]),
        ]
    )
    env = AenvEnvironment(cwd="/tmp")
    try:
        agent = DefaultAgent(model, env, **config)
        info = agent.run("Write 42 to /tmp/answer and submit it.")
        assert info["exit_status"] == "Submitted" and info["submission"].strip() == "42"
        observations = [m for m in agent.messages if m.get("role") == "user" and "returncode" in str(m.get("content"))]
        assert any("42" in str(m["content"]) for m in observations)
    finally:
        env.cleanup()
