"""E2B's npm Desktop SDK (`@e2b/desktop`), unchanged, against the `desktop` template: its own
calls (screen size, cursor, a move, a screenshot, open, the stream's URL with its password)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import Server

pytestmark = [pytest.mark.runsc, pytest.mark.sandbox, pytest.mark.timeout(2400)]

JS = Path(__file__).parents[1] / "compat" / "js"


def test_the_npm_desktop_sdk(desktop: Server) -> None:
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "@e2b" / "desktop").is_dir():
        message = "needs node >= 20.18 and `npm install` in tests/compat/js (scripts/install does both)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    env = {
        **os.environ,
        "E2B_API_KEY": desktop.env["AENV_API_KEY"],
        "E2B_API_URL": desktop.url,
        "E2B_SANDBOX_URL": desktop.url,
    }
    env.pop("E2B_DEBUG", None)
    done = subprocess.run([node, str(JS / "desktop.mjs")], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["size"] == {"width": 1024, "height": 768}
    assert seen["cursor"] == {"x": 512, "y": 384} and seen["moved"] == {"x": 100, "y": 200}
    assert seen["png"] == "89504e470d0a1a0a"
    assert seen["url"].startswith(f"https://6080-{seen['sandboxId']}.") and "password=" in seen["url"]
