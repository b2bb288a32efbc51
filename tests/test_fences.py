"""The guest agent and the channel run inside any image: standard library only."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import aenv
from tests.source import parse

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)

ROOT = Path(aenv.__file__).parent


def test_guest_and_channel_import_only_stdlib() -> None:
    bad = []
    for pkg in ("guest", "channel"):
        for path in (ROOT / pkg).rglob("*.py"):
            for node in ast.walk(parse(path.read_text())):
                names = []
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                    names = [node.module]
                for name in names:
                    top = name.split(".")[0]
                    if (
                        top in sys.stdlib_module_names
                        or name.startswith(("aenv.guest", "aenv.channel"))
                        or name == "aenv"
                    ):
                        continue
                    bad.append(f"{path.relative_to(ROOT)}: {name}")
    assert bad == []


def test_importing_runtime_loads_no_driver() -> None:
    import subprocess

    code = "import aenv.runtime, sys; print(any(m.startswith('aenv.runtime.gvisor') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
