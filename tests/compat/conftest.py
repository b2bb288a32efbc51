"""The E2B compatibility suite: the official SDKs, unchanged, against an aenv deployment.

By default it drives the test session's own server. Point it at any other deployment with
``AENV_COMPAT_URL=http://host:3000 E2B_API_KEY=... pytest tests/compat`` (the URL serves both
the API and the sandbox proxy, as ``E2B_API_URL`` and ``E2B_SANDBOX_URL`` would).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from tests.conftest import API_KEY, e2b_sandbox

pytestmark = pytest.mark.sandbox


@dataclass(frozen=True)
class Deployment:
    url: str
    api_key: str

    @property
    def env(self) -> dict[str, str]:
        return {"E2B_API_KEY": self.api_key, "E2B_API_URL": self.url, "E2B_SANDBOX_URL": self.url}


@pytest.fixture(scope="session")
def deployment(request: pytest.FixtureRequest) -> Deployment:
    url = os.environ.get("AENV_COMPAT_URL")
    if url:
        return Deployment(url.rstrip("/"), os.environ["E2B_API_KEY"])
    server = request.getfixturevalue("server")
    return Deployment(server.url, API_KEY)


@pytest.fixture(autouse=True)
def e2b_vars(deployment: Deployment, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for key, value in deployment.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("E2B_DEBUG", raising=False)
    yield


@pytest.fixture()
def sandbox(deployment: Deployment) -> Iterator[object]:
    """A sandbox of the deployment under test (the suite-wide fixture's is the session server's,
    which is another machine when AENV_COMPAT_URL names a gateway)."""
    yield from e2b_sandbox()
