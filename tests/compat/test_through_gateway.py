"""The compat suite's core through a gateway: the official Python SDK, unchanged, against two
nodes behind `aenv gateway`.

In CI (to keep it within its budget), a second collection, with ``deployment`` pointing at the
gateway, of the tests of test_python_sync.py that cross what a gateway does (commands streamed
both ways, the SDK's errors, files of several megabytes, a port's WebSockets, lists over both
nodes, pause and connect, secure sandboxes and signed URLs), the lists of snapshots and the
metrics of several sandboxes (both merged from every node by the gateway), and the npm SDK's
smoke test (create, commands, files, list, pause and connect, kill). The whole compat suite
runs through a gateway with ``AENV_COMPAT_URL=<gateway> python -m pytest tests/compat``
(docs/cluster.md, "Through a gateway": the last such run and what differs from one node).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.cluster.cluster import running_cluster
from tests.compat.conftest import Deployment
from tests.compat.test_js_sdk import test_npm_sdk_smoke  # noqa: F401  (the npm SDK, through the gateway)
from tests.compat.test_lists_and_metrics import (  # noqa: F401  (lists and metrics merged over the nodes)
    api,
    snapshots,
    tag,
    tagged,
    test_a_forged_token_is_a_400,
    test_latest_metrics_of_several_sandboxes,
    test_pages_of_snapshots_neither_repeat_nor_skip,
    test_snapshots_filtered_by_name_and_id,
)
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

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture(scope="module")
def deployment(deployment: Deployment) -> Iterator[Deployment]:
    """The gateway of a fresh 2-node cluster (the nodes share the session server's repository,
    where `base` is: the overridden ``deployment`` has started that server)."""
    if os.environ.get("AENV_COMPAT_URL"):  # a deployment of its own (perhaps a gateway already)
        yield deployment
        return
    with running_cluster(gateways=1) as cluster:
        yield Deployment(cluster.gateway.url, API_KEY)
