"""The suite's node with the built-in `desktop` template, built once (minutes) when it has none."""

from __future__ import annotations

import json

import pytest

from tests.conftest import Server

BUILD_TIMEOUT = 1800.0


@pytest.fixture(scope="package")
def desktop(server: Server) -> Server:
    """The suite's node with the `desktop` template (built here if it has none)."""
    with server.client() as api:
        if api.get("/templates/desktop").status_code == 200:
            return server
        last: dict[str, object] = {}
        with api.stream("POST", "/templates/builtin/desktop", timeout=BUILD_TIMEOUT) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.strip():
                    last = json.loads(line)
                    if "log" in last:
                        print(last["log"])
        assert "template" in last, last
    return server
