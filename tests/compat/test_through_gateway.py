"""The compat suite's core through a gateway: the official Python SDK, unchanged, against two
nodes behind `aenv gateway` (commands, files, pause and resume, lists over both nodes, secure
sandboxes and their signed URLs, WebSockets to a port, the SDK's errors).

The same test functions as against one node, collected here a second time with ``deployment``
pointing at the gateway. A subset, to keep CI short; every test of the suite passes through a
gateway when run with ``AENV_COMPAT_URL=<gateway URL>`` (docs/cluster.md says what differs).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster.cluster import running_cluster
from tests.compat.conftest import Deployment
from tests.compat.test_python_sync import (  # noqa: F401  (collected here again, through the gateway)
    sbx,
    test_commands_stream_and_report_exit_codes,
    test_errors_are_the_sdk_exceptions,
    test_files_of_several_megabytes_and_the_filesystem_api,
    test_get_host_websocket,
    test_list_with_filters_and_pagination,
    test_pause_connect_and_kill,
    test_secure_sandbox_requires_its_token,
)
from tests.conftest import API_KEY

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def deployment(deployment: Deployment) -> Iterator[Deployment]:
    """The gateway of a fresh 2-node cluster (the nodes share the session server's repository,
    where `base` is: the overridden ``deployment`` has started that server)."""
    if os.environ.get("AENV_COMPAT_URL"):  # a deployment of its own (perhaps a gateway already)
        yield deployment
        return
    with running_cluster(gateways=1) as cluster:
        yield Deployment(cluster.gateway.url, API_KEY)
