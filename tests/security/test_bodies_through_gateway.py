"""What a client puts in a body, on a node and through a gateway alike (test_validation.py holds
the node's cases; a gateway reads some bodies itself: a create's template for its placement, a
fork's count to spread children, an admin's status change): a body is refused with 400 JSON
``{code, message}`` and makes nothing, never a 500.

JSON nested deeper than Python's decoder recurses (a body of ``[`` x 5000) raised RecursionError,
which no ``except ValueError`` caught: a 500 from the gateway for a create or fork, and from the
node for every envd call and its drain (seen failing before aenv.errors.parse_json). A snapshot
name with a NUL or another control character was taken (201, the name kept as sent; seen failing).

One busybox node in cluster mode (one etcd member) and a gateway in front of it, for the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.cluster.cluster import Gateway, start_gateway, wait_for_nodes
from tests.cluster.conftest import require_etcd
from tests.cluster.etcd import EtcdCluster
from tests.conftest import API_KEY, Server, start_busybox_node
from tests.security.test_validation import BAD_FORKS, BAD_LABELS, UNKNOWN_OR_MISTYPED, refused

pytestmark = pytest.mark.sandbox
NODE_ID = "bodies"
TEMPLATE = "bb"
DEEP = b"[" * 5000
JSON = {"content-type": "application/json"}


@dataclass
class Stack:
    node: Server
    gateway: Gateway


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    require_etcd()
    etcd = EtcdCluster(1)
    etcd.start()
    node: Server | None = None
    gateway: Gateway | None = None
    try:
        env = {"AENV_CLUSTER": etcd.url, "AENV_NODE_ID": NODE_ID, "AENV_SPARE_UPPERS": "0"}
        node = start_busybox_node(tmp_path_factory.mktemp("bodies") / "data", env)
        gateway = start_gateway(etcd.url)
        wait_for_nodes(gateway, {NODE_ID})
        yield Stack(node, gateway)
    finally:
        if gateway is not None:
            gateway.stop()
        if node is not None:
            node.stop()
        etcd.stop()


@pytest.fixture(params=["node", "gateway"])
def api(request: pytest.FixtureRequest, stack: Stack) -> Iterator[httpx.Client]:
    url = stack.node.url if request.param == "node" else stack.gateway.url
    with httpx.Client(base_url=url, headers={"X-API-Key": API_KEY}, timeout=60) as client:
        yield client
        for item in client.get("/v2/sandboxes").json():
            client.delete(f"/sandboxes/{item['sandboxID']}")


def sandboxes(api: httpx.Client) -> set[str]:
    return {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}


def a_sandbox(api: httpx.Client) -> dict[str, Any]:
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 120})
    assert r.status_code == 201, r.text
    return dict(r.json())


def client_error(r: httpx.Response) -> bool:
    """A 400 whose JSON body says so (envd's Connect errors: ``invalid_argument``)."""
    try:
        body = r.json()
    except ValueError:
        return False
    return r.status_code == 400 and isinstance(body, dict) and body.get("code") in (400, "invalid_argument")


def test_json_nested_past_the_decoder_is_400(api: httpx.Client, stack: Stack) -> None:
    sbx = a_sandbox(api)
    sid = sbx["sandboxID"]
    wrong = []
    for path in ("/sandboxes", "/v2/sandboxes", f"/sandboxes/{sid}/fork", f"/sandboxes/{sid}/timeout"):
        for raw in (DEEP, b'{"templateID": "bb", "metadata": ' + DEEP + b"}", b'{"count": ' + DEEP + b"}"):
            r = api.post(path, content=raw, headers=JSON)
            if not client_error(r):
                wrong.append(f"{path} {raw[:30]!r}: {r.status_code} {r.text[:100]}")
    envd = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx["envdAccessToken"], **JSON}
    for path in ("/process.Process/List", "/filesystem.Filesystem/Stat", "/filesystem.Filesystem/ListDir"):
        for raw in (DEEP, b'{"path": ' + DEEP + b"}"):
            r = httpx.post(f"{api.base_url}{path}", content=raw, headers=envd, timeout=30)
            if not client_error(r):
                wrong.append(f"{path} {raw[:30]!r}: {r.status_code} {r.text[:100]}")
    # a streamed call's request is one Connect envelope
    envelope = b"\0" + len(DEEP).to_bytes(4, "big") + DEEP
    r = httpx.post(
        f"{api.base_url}/process.Process/Start",
        content=envelope,
        headers={**envd, "content-type": "application/connect+json"},
        timeout=30,
    )
    said = r.text
    if r.status_code >= 500 or "invalid_argument" not in said:
        wrong.append(f"Start envelope: {r.status_code} {said[:100]}")
    # the admin's node status change (gateway), the node's own drain: 1 KiB bodies, nested past the decoder
    is_gateway = api.base_url != httpx.URL(stack.node.url)
    path = f"/nodes/{NODE_ID}" if is_gateway else "/cluster/drain"
    r = api.post(path, content=b"[" * 1020, headers=JSON)
    if not client_error(r):
        wrong.append(f"{path}: {r.status_code} {r.text[:100]}")
    assert wrong == []
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    assert sandboxes(api) == {sid}


def test_create_and_fork_bodies_are_refused_through_a_gateway_as_on_a_node(api: httpx.Client) -> None:
    """test_validation.py's bodies, and a fork's body as a bare value, wherever the client sends them."""
    sid = a_sandbox(api)["sandboxID"]
    named = {"templateId", "template"}
    creates = [
        {"timeout": 60, **({} if named & set(b) else {"templateID": TEMPLATE}), **b} for b in UNKNOWN_OR_MISTYPED
    ]
    creates += [{"templateID": TEMPLATE, "timeout": 60, **b} for b in BAD_LABELS]
    for path in ("/sandboxes", "/v2/sandboxes"):
        assert refused(api, "POST", path, creates) == []
    assert refused(api, "POST", f"/sandboxes/{sid}/fork", BAD_FORKS) == []
    for raw in (b"true", b"-1", b'"3"', b"1.5", b"null", b"[]", b"[2]", b"1000000000", b"{", b"\xff"):
        r = api.post(f"/sandboxes/{sid}/fork", content=raw, headers=JSON)
        assert client_error(r), (raw, r.status_code, r.text)
    unbuilt = {
        "volumeMounts": ({"volumeMounts": [{"name": "data", "path": "/mnt/data"}]}, "volume 'data' not found"),
        "iam": (
            {"iam": {"tokens": {"aws": {"audience": "sts.amazonaws.com"}}}},
            "Sandbox IAM workload tokens are not available for your team.",
        ),
    }
    for field, message in unbuilt.values():
        r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 60, **field})
        status = 404 if "volumeMounts" in field else 400
        assert (r.status_code, r.json().get("message")) == (status, message), r.text
    assert sandboxes(api) == {sid}  # nothing was made


def test_snapshot_names_carry_no_control_characters(api: httpx.Client) -> None:
    sid = a_sandbox(api)["sandboxID"]
    for name in ("a\x00b", "line\nbreak", "\x1b[31mred", "del\x7f", "c1\x85"):
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": name})
        assert client_error(r), (name, r.status_code, r.text[:200])
        assert json.dumps(name)[1:-1] not in r.text  # quoted printable, if at all
    name = f"fine-name.{sid[:8]}"
    r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": name})
    assert r.status_code == 201, r.text
    assert r.json()["names"] == [name]
    assert api.delete(f"/snapshots/{r.json()['snapshotID']}").status_code == 204


def test_mcp_servers_need_the_mcp_gateway_template(api: httpx.Client, stack: Stack) -> None:
    """E2B's API only records ``mcp``: its SDKs create from the ``mcp-gateway`` template and start
    the gateway in it. A create with MCP servers from any other template was a 201 sandbox with no
    MCP at all (seen failing); from a template named or aliased ``mcp-gateway`` it goes on."""
    servers = {"duckduckgo": {}, "github": {"githubPersonalAccessToken": "t"}}
    for path in ("/sandboxes", "/v2/sandboxes"):
        r = api.post(path, json={"templateID": TEMPLATE, "timeout": 60, "mcp": servers})
        assert r.status_code == 400 and "mcp-gateway" in r.json()["message"], r.text
    assert sandboxes(api) == set()
    with httpx.Client(base_url=stack.node.url, headers={"X-API-Key": API_KEY}, timeout=60) as node:
        assert node.patch(f"/templates/{TEMPLATE}", json={"aliases": ["mcp-gateway"]}).status_code == 200
        try:
            r = api.post("/v2/sandboxes", json={"templateID": "mcp-gateway", "timeout": 60, "mcp": servers})
            assert r.status_code == 201, r.text
        finally:
            assert node.patch(f"/templates/{TEMPLATE}", json={"aliases": []}).status_code == 200


def test_a_network_update_with_a_field_it_does_not_know_changes_nothing(api: httpx.Client) -> None:
    """The update replaces the sandbox's egress rules: a misspelt field (``allowout``) was ignored
    and the rest replaced, so a sandbox held to one address was opened to all (204; seen failing)."""
    held = {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 60, "network": held})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    for body in ({"allowout": ["1.1.1.1"]}, {"allowOut": ["1.1.1.1"], "denyOUT": ["0.0.0.0/0"]}, {"egress": {}}):
        r = api.put(f"/sandboxes/{sid}/network", json=body)
        assert client_error(r) and "Extra inputs are not permitted" in r.json()["message"], (body, r.text)
    assert api.get(f"/sandboxes/{sid}").json()["network"] == held
    # what the SDKs send is taken: the rules, internet access, and an empty update
    for body in ({"allowOut": ["8.8.8.8"], "denyOut": ["0.0.0.0/0"], "allow_internet_access": True}, {}):
        assert api.put(f"/sandboxes/{sid}/network", json=body).status_code == 204, body
    assert api.get(f"/sandboxes/{sid}").json()["network"] == {}
