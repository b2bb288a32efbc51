"""Quick checks of each harness integration on the suite's node (the full harness suites, with
each harness's own tests, are `scripts/harness-suite`).

- SWE-ReX: SWE-ReX's own server in a sandbox, its RemoteRuntime through the port proxy; the
  second deployment starts from the cached snapshot.
- mini-swe-agent: the environment's contract as mini-swe-agent's Docker environment keeps it.
- rLLM-style sandbox: upload, a worker process reached by get_endpoint's URL and headers, fork.
- SandboxFusion: verl's own `sandbox_fusion/utils.py` (from the verl wheel on PyPI, loaded by
  path: verl's package `__init__` imports torch) scoring code through `aenv fusion`'s app.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Server, free_port

pytestmark = pytest.mark.sandbox
HARNESS_CACHE = Path(os.environ.get("AENV_HARNESS_CACHE", Path.home() / ".cache" / "aenv" / "harness"))
VERL_VERSION = "0.9.1"


@pytest.fixture()
def aenv_env(server: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    monkeypatch.setenv("AENV_URL", server.url)
    monkeypatch.setenv("AENV_API_KEY", server.env["AENV_API_KEY"])
    return server


def live(api: httpx.Client, sandbox_id: str) -> bool:
    return api.get(f"/sandboxes/{sandbox_id}").status_code == 200


# -- SWE-ReX ---------------------------------------------------------------------------------------


def test_swerex_deployment_runs_swerex_in_a_sandbox(aenv_env: Server, api: httpx.Client, tmp_path: Path) -> None:
    from swerex.exceptions import NonZeroExitCodeError
    from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest, ReadFileRequest, UploadRequest

    from aenv.integrations.swerex import AenvDeployment

    steps: list[str] = []

    class Steps:
        def on_custom_step(self, message: str) -> None:
            steps.append(message)

    async def one(tag: str) -> str:
        d = AenvDeployment(template="base", metadata={"test": tag})
        d.add_hook(Steps())  # type: ignore[arg-type]
        await d.start()
        try:
            r = d.runtime
            assert await d.is_alive()
            await r.create_session(CreateBashSessionRequest())
            out = await r.run_in_session(BashAction(command="cd /tmp && x=42 && echo $x $(pwd)", check="raise"))
            assert out.output.strip() == "42 /tmp"
            again = await r.run_in_session(BashAction(command="echo $x", check="raise"))
            assert again.output.strip() == "42"  # one bash session, state kept
            with pytest.raises(NonZeroExitCodeError):
                await r.run_in_session(BashAction(command="false", check="raise"))
            assert (await r.execute(Command(command=["uname", "-s"]))).stdout == "Linux\n"
            (tmp_path / "up.txt").write_text(f"from the host {tag}")
            await r.upload(UploadRequest(source_path=str(tmp_path / "up.txt"), target_path="/tmp/up/up.txt"))
            assert (await r.read_file(ReadFileRequest(path="/tmp/up/up.txt"))).content == f"from the host {tag}"
            return d.sandbox.sandbox_id
        finally:
            await d.stop()

    first = asyncio.run(one("a"))
    assert not live(api, first)  # stop killed it
    installs = sum("Installing" in s for s in steps)
    steps.clear()
    second = asyncio.run(one("b"))
    assert not live(api, second)
    # the second deployment came from the snapshot the first (or an earlier run) left: no install
    assert not any("Installing" in s for s in steps), steps
    assert installs <= 1


# -- mini-swe-agent ----------------------------------------------------------------------------------


def test_minisweagent_environment_contract(
    aenv_env: Server, api: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    from aenv.integrations.minisweagent import AenvEnvironment

    monkeypatch.setenv("HOST_VAR", "from_host")
    monkeypatch.setenv("CONFLICT_VAR", "from_host")
    env = AenvEnvironment(
        cwd="/tmp",
        env={"SET_VAR": "from_config", "CONFLICT_VAR": "from_config"},
        forward_env=["HOST_VAR", "CONFLICT_VAR", "NONEXISTENT_VAR"],
        timeout=5,
    )
    try:
        r = env.execute({"command": "echo $SET_VAR $HOST_VAR $CONFLICT_VAR [$NONEXISTENT_VAR]; pwd"})
        assert r == {"output": "from_config from_host from_config []\n/tmp\n", "returncode": 0, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/home/user")["output"] == "/home/user\n"
        assert env.execute({"command": "exit 42"})["returncode"] == 42
        # one stream, in the order written
        assert env.execute({"command": "echo a; echo b >&2; echo c"})["output"] == "a\nb\nc\n"
        slow = env.execute({"command": "sleep 30"}, timeout=1)
        assert slow["returncode"] == -1 and "error occurred" in slow["exception_info"]
        assert (
            env.get_template_vars()["cwd"] == "/tmp"
            and env.serialize()["info"]["config"]["environment"]["timeout"] == 5
        )
        env.execute({"command": "echo state > /tmp/mark"})
        children = env.fork(2)
        try:
            for child in children:
                assert child.execute({"command": "cat /tmp/mark"})["output"] == "state\n"
        finally:
            for child in children:
                child.cleanup()
        sandbox_id = env.sandbox.sandbox_id if env.sandbox else ""
    finally:
        env.cleanup()
    assert not live(api, sandbox_id)


# -- rLLM-style sandbox ------------------------------------------------------------------------------

WORKER = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = open("/home/user/agent/data.txt", "rb").read() if self.path == "/data" else b"ok"
        self.send_response(200); self.send_header("Content-Length", str(len(body))); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_rllm_sandbox_protocol(aenv_env: Server, api: httpx.Client, tmp_path: Path) -> None:
    from aenv.integrations.rllm import create_aenv_sandbox

    agent = tmp_path / "agent"
    (agent / "sub").mkdir(parents=True)
    (agent / "worker.py").write_text(WORKER)
    (agent / "data.txt").write_text("payload")
    (agent / "sub" / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (agent / "sub" / "run.sh").chmod(0o755)
    sbx = create_aenv_sandbox("smoke", image="base")
    try:
        sbx.upload_dir(str(agent), "/home/user/agent")
        assert sbx.exec("/home/user/agent/sub/run.sh") == "ran\n"
        with pytest.raises(RuntimeError, match="exit 3"):
            sbx.exec("exit 3")
        sbx.start_agent_process("python3 /home/user/agent/worker.py 8100", port=8100)
        url, headers = sbx.get_endpoint(8100)
        assert httpx.get(f"{url}/data", headers=headers, timeout=30).text == "payload"
        [child] = sbx.fork(1)  # the running worker comes along
        try:
            url, headers = child.get_endpoint(8100)
            assert httpx.get(f"{url}/data", headers=headers, timeout=30).text == "payload"
        finally:
            child.close()
        ids = [sbx.sandbox.sandbox_id, child.sandbox.sandbox_id]
    finally:
        sbx.close()
    assert not any(live(api, i) for i in ids)


# -- SandboxFusion (verl) ----------------------------------------------------------------------------


def verl_sandbox_fusion_utils() -> types.ModuleType:
    """verl's `verl/utils/reward_score/sandbox_fusion/utils.py`, from its wheel on PyPI (cached)."""
    target = HARNESS_CACHE / f"verl-{VERL_VERSION}"
    if not (target / ".complete").exists():
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(target)]
            + [f"verl=={VERL_VERSION}"],
            check=True,
            timeout=300,
        )
        (target / ".complete").touch()
    import zipfile

    [wheel] = target.glob("verl-*.whl")
    source = zipfile.ZipFile(wheel).read("verl/utils/reward_score/sandbox_fusion/utils.py")
    path = target / "sandbox_fusion_utils.py"
    path.write_bytes(source)
    spec = importlib.util.spec_from_file_location("verl_sandbox_fusion_utils", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fusion_url(server: Server) -> Iterator[str]:
    import uvicorn

    from aenv.integrations.fusion import create_app
    from aenv.sdk import AsyncClient

    port = free_port()
    client = AsyncClient(server.url, server.env["AENV_API_KEY"])
    config = uvicorn.Config(create_app(client, max_concurrency=4), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_verl_scores_code_through_the_fusion_facade(fusion_url: str, api: httpx.Client) -> None:
    verl = verl_sandbox_fusion_utils()
    url = f"{fusion_url}/run_code"
    code = "import sys\nprint({'input1': 'output1', 'input2': 'output2'}.get(sys.stdin.read(), 'unexpected'))"
    io = {"inputs": ["input1", "input2"], "outputs": ["output1\n", "output2\n"]}
    results, meta = verl.check_correctness(url, io, code)
    assert results == [True, True] and meta[0]["status"] == "success" and meta[0]["stdout"] == "output1\n"
    results, meta = verl.check_correctness(url, io, "print('wrong')")
    assert results == [False, False] and meta[1]["status"] == "wrong_answer"
    results, meta = verl.check_correctness(url, io, "a=b", language="cpp")
    assert results == [-4, -4] and meta[0]["status"] == "compile_error"
    one = {"inputs": ["x"], "outputs": ["x\n"]}
    results, meta = verl.check_correctness(url, one, "raise ValueError('boom')")
    assert results == [-2] and meta[0]["status"] == "runtime_error" and "boom" in meta[0]["stderr"]
    results, meta = verl.check_correctness(url, one, "import time\ntime.sleep(30)", timeout=2)
    assert results == [-3] and meta[0]["status"] == "timeout"
    cpp = "#include <iostream>\nint main(){std::string s; std::cin>>s; std::cout<<s<<s<<std::endl;}"
    results, _ = verl.check_correctness(url, {"inputs": ["ab"], "outputs": ["abab\n"]}, cpp, language="cpp")
    assert results == [True]
    # every request's sandbox is killed once its answer has gone (within seconds)
    deadline = time.monotonic() + 20
    while api.get("/sandboxes", params={"metadata": "aenv-fusion=run"}).json() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert api.get("/sandboxes", params={"metadata": "aenv-fusion=run"}).json() == []


def test_fusion_jupyter_and_client_mistakes(fusion_url: str) -> None:
    cells = ["x = 6", "print('side'); x * 7", "1/0", "x + 1"]
    r = httpx.post(f"{fusion_url}/run_jupyter", json={"cells": cells, "total_timeout": 60}, timeout=90).json()
    assert r["status"] == "Failed"  # a cell raised
    assert r["cells"][1]["stdout"] == "side\n" and r["cells"][1]["display"] == [{"text/plain": "42"}]
    assert r["cells"][2]["error"][0]["ename"] == "ZeroDivisionError"
    assert r["cells"][3]["display"] == [{"text/plain": "7"}]
    files = {"data/in.txt": "aGVsbG8="}  # "hello"
    body = {"code": "print(open('data/in.txt').read()); open('out.txt','w').write('bye')", "files": files}
    r = httpx.post(f"{fusion_url}/run_code", json={**body, "fetch_files": ["out.txt"]}, timeout=60).json()
    assert r["status"] == "Success" and r["run_result"]["stdout"] == "hello\n" and r["files"] == {"out.txt": "Ynll"}
    for bad in (
        {"code": "1", "language": "cobol"},
        {"code": 5},
        {"code": "1", "files": {"../../etc/passwd": "eA=="}},
        {"code": "1", "files": {"a": "not base64!"}},
        {"code": "1", "run_timeout": -1},
        {"code": "1", "fetch_files": ["/etc/shadow"]},
    ):
        resp = httpx.post(f"{fusion_url}/run_code", json=bad, timeout=30)
        assert resp.status_code == 400 and resp.json()["code"] == 400, (bad, resp.text)
    assert httpx.post(f"{fusion_url}/run_code", content=b"{not json", timeout=30).status_code == 400
    huge = httpx.post(f"{fusion_url}/run_code", content=b"x" * (33 << 20), timeout=60)  # refused while it arrives
    assert huge.status_code == 413 and huge.json()["code"] == 413
