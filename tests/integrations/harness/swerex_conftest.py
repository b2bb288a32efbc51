"""The conftest that scripts/harness-suite puts beside SWE-ReX's own tests/test_execution.py
(unpacked from the swe-rex sdist at the installed version, not kept here): the fixtures that
file asks for, over an aenv deployment instead of a local uvicorn thread.

One AenvDeployment for the session, as SWE-ReX's own conftest keeps one server; each test gets
a fresh RemoteRuntime on it (closed after, as theirs is). ``_Action`` and ``_Command`` are the
5-second variants that file imports from its conftest.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import AsyncIterator, Iterator

import pytest
from swerex.runtime.abstract import BashAction, CloseBashSessionRequest, Command, CreateBashSessionRequest
from swerex.runtime.remote import RemoteRuntime

from aenv.integrations.swerex import AenvDeployment


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5


@pytest.fixture(scope="session")
def deployment() -> Iterator[AenvDeployment]:
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    d = AenvDeployment(template=os.environ.get("AENV_SWEREX_TEMPLATE", "base"))
    asyncio.run_coroutine_threadsafe(d.start(), loop).result(600)
    yield d
    asyncio.run_coroutine_threadsafe(d.stop(), loop).result(120)
    loop.call_soon_threadsafe(loop.stop)


@pytest.fixture
async def remote_runtime(deployment: AenvDeployment) -> AsyncIterator[RemoteRuntime]:
    r = deployment.new_runtime()
    try:
        yield r
    finally:
        await r.close()


@pytest.fixture
async def runtime_with_default_session(remote_runtime: RemoteRuntime) -> AsyncIterator[RemoteRuntime]:
    await remote_runtime.create_session(CreateBashSessionRequest())
    try:
        yield remote_runtime
    finally:
        await remote_runtime.close_session(CloseBashSessionRequest())
