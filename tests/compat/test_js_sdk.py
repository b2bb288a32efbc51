"""The npm `e2b` SDK, unchanged, against aenv: create, commands, files, list, pause/connect, kill."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.compat.conftest import Deployment

pytestmark = pytest.mark.sandbox

JS = Path(__file__).parent / "js"


@pytest.mark.slow  # npm's start and install check: 10-80 s, kept out of the fast tier (it runs through a gateway too)
def test_npm_sdk_smoke(deployment: Deployment) -> None:
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "e2b").is_dir():
        message = "needs node >= 20.18 and `npm install` in tests/compat/js (scripts/install does both)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env = {**os.environ, **deployment.env}
    done = subprocess.run([node, str(JS / "smoke.mjs")], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["stdout"] == "yes user\n" and seen["stderr"] == "err\n" and seen["streamed"] == "yes user\n"
    assert seen["exitError"] == 5
    assert seen["fileRoundTrip"] is True and seen["listed"] == ["blob.bin", "note.txt"] and seen["note"] == "from node"
    assert seen["killedProcess"] is True
    assert seen["listedIds"] == [seen["sandboxId"]]
    assert (seen["paused"], seen["stateAfterPause"], seen["stateAfterConnect"]) == (True, "paused", "running")
    assert seen["noteAfterResume"] == "from node"
    assert (seen["killed"], seen["killedAgain"], seen["connectAfterKill"]) == (True, False, "NotFoundError")
