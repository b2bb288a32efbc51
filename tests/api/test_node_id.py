"""A node names itself in its sandbox lists and details (``nodeID``), alone as in a cluster: the id
AENV_NODE_ID gives, else one made once and kept in the data dir (a restart keeps it), the id the
node would join a cluster with. The dashboard's Node column and scripts read it.

Seen failing before: a node without AENV_NODE_ID (alone, or in a cluster without --node-id) left
``nodeID`` out of its list items.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import Server, start_busybox_node

pytestmark = pytest.mark.sandbox
STATES = ("running", "paused")  # the paused one last


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_busybox_node(tmp_path_factory.mktemp("nodeid") / "data")
    yield srv
    srv.stop()


def named(srv: Server) -> set[str | None]:
    """The ``nodeID`` of every item of every list and detail the node answers."""
    seen: set[str | None] = set()
    with srv.client() as api:
        lists = [api.get("/sandboxes").json(), *(api.get("/v2/sandboxes", params={"state": s}).json() for s in STATES)]
        assert lists[-1], "no paused sandbox listed"
        for items in lists:
            seen |= {item.get("nodeID") for item in items}
            seen |= {api.get(f"/sandboxes/{item['sandboxID']}").json().get("nodeID") for item in items}
    return seen


def test_a_lone_node_names_itself_in_lists_and_details(node: Server) -> None:
    with node.client() as api:
        made = [api.post("/sandboxes", json={"templateID": "bb", "timeout": 300}) for _ in range(2)]
        assert all(r.status_code == 201 for r in made), [r.text for r in made]
        assert api.post(f"/sandboxes/{made[1].json()['sandboxID']}/pause").status_code == 204
    kept = (node.data_dir / "node-id").read_text().strip()
    assert kept and named(node) == {kept}
    node.restart()  # the same id after a restart: it is the node's, not the process's
    assert named(node) == {kept}


def test_aenv_node_id_names_it(tmp_path: Path) -> None:
    srv = start_busybox_node(tmp_path / "data", {"AENV_NODE_ID": "lone-1"})
    try:
        with srv.client() as api:
            assert api.post("/sandboxes", json={"templateID": "bb", "timeout": 60}).status_code == 201
            assert api.post("/sandboxes", json={"templateID": "bb", "timeout": 60}).status_code == 201
            sid = api.get("/sandboxes").json()[0]["sandboxID"]
            assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        assert named(srv) == {"lone-1"}
    finally:
        srv.stop()
