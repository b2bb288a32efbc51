"""Create and fork bodies (aenv/api/schemas.py, aenv/api/sandboxes.py): what a client may set is
checked before anything is made. Metadata and env vars carry no control characters (a NUL in a
metadata key was accepted) and are bounded; an unknown, misspelt or mistyped field is a 400, not
ignored (a fork body ``{"n": 1000000000}`` made one child with 201); E2B features aenv has not
built (volume mounts, workload identity, HTTPS ports) are refused in E2B's words, while every
field the E2B SDKs (Python and npm) and aenv's own SDK send keeps working.

Each refusal test was run against the code before these checks and failed there (the bodies were
answered 201). One busybox node for the module (nothing to debootstrap).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import Server, e2b_client, start_busybox_node

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime
TEMPLATE = "bb"
JS = Path(__file__).parent.parent / "compat" / "js"


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_busybox_node(tmp_path_factory.mktemp("validation") / "data", {"AENV_MIN_FREE_MEMORY_MB": "0"})
    yield srv
    srv.stop()


@pytest.fixture()
def api(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(node, monkeypatch, empty_after=True)


def sandboxes(api: httpx.Client) -> set[str]:
    return {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}


def refused(api: httpx.Client, method: str, path: str, bodies: list[dict[str, Any]]) -> list[str]:
    """The bodies answered with anything but a 400 JSON error (what each was answered)."""
    wrong = []
    for body in bodies:
        r = api.request(method, path, json=body)
        error = r.json() if r.headers.get("content-type", "").startswith("application/json") else None
        if r.status_code != 400 or not (isinstance(error, dict) and error.get("code") == 400 and error.get("message")):
            wrong.append(f"{json.dumps(body)[:120]} -> {r.status_code} {r.text[:120]}")
    return wrong


BAD_LABELS: list[dict[str, Any]] = [
    {"metadata": {"a\x00b": "v"}},
    {"metadata": {"k": "v\x00"}},
    {"metadata": {"k\n": "v"}},
    {"metadata": {"k": "line\nbreak"}},
    {"metadata": {"k": "\x1b[31mred"}},
    {"metadata": {"k\x7f": "v"}},
    {"metadata": {"k": "next\x85line"}},  # C1
    {"metadata": {"": "v"}},
    {"metadata": {"k" * 257: "v"}},
    {"metadata": {"é" * 129: "v"}},  # 258 bytes in UTF-8
    {"metadata": {"k": "v" * 4097}},
    {"metadata": {f"k{i}": "v" for i in range(129)}},
    {"metadata": {f"k{i}": "v" * 4000 for i in range(17)}},  # 68 KB together
    {"envVars": {"A\x00": "1"}},
    {"envVars": {"A": "1\x00"}},
    {"envVars": {"A=B": "1"}},
    {"envVars": {"": "1"}},
    {"envVars": {"A\n": "1"}},
    {"envVars": {"A": "\x1b]0;title\x07"}},
    {"envVars": {f"V{i}": "1" for i in range(1025)}},
    {"envVars": {"A": "x" * (64 * 1024 + 1)}},
]

UNKNOWN_OR_MISTYPED: list[dict[str, Any]] = [
    {"templateId": TEMPLATE},  # misspelt: was a sandbox of `base`
    {"template": TEMPLATE},
    {"n": 3},
    {"timeoutMs": 1000},
    {"envs": {"A": "1"}},  # the SDKs' argument name, not the wire's
    {"autoResume": {"enabled": True, "when": "idle"}},
    {"autoResume": {"policy": "sometimes"}},
    {"lifecycle": {"onTimeout": "pause", "then": "kill"}},
    {"lifecycle": {"keepMemory": "no"}},
    {"network": {"allowOut": ["1.1.1.1"], "allowIn": ["0.0.0.0/0"]}},
    {"network": {"dnsServers": ["not-an-address"]}},
    {"network": {"dnsServers": "8.8.8.8"}},
    {"network": {"dnsServers": [8]}},
    {"iam": {"token": {}}},
    {"iam": "aws"},
    {"volumeMounts": "/data"},
    {"mcp": "github"},
    {"mcp": ["github"]},
    {"secure": 1},
]


def test_labels_with_control_characters_or_past_their_bounds_are_400(api: httpx.Client) -> None:
    before = sandboxes(api)
    for path in ("/v2/sandboxes", "/sandboxes"):
        bodies = [{"templateID": TEMPLATE, "timeout": 60, **b} for b in BAD_LABELS]
        assert refused(api, "POST", path, bodies) == []
    assert sandboxes(api) == before


def test_unknown_misspelt_and_mistyped_create_fields_are_400(api: httpx.Client) -> None:
    before = sandboxes(api)
    named = {"templateId", "template"}
    bodies = [{"timeout": 60, **({} if named & set(b) else {"templateID": TEMPLATE}), **b} for b in UNKNOWN_OR_MISTYPED]
    assert refused(api, "POST", "/v2/sandboxes", bodies) == []
    r = api.post("/v2/sandboxes", json={"templateId": TEMPLATE})
    assert r.json()["message"] == "invalid request body: templateId: Extra inputs are not permitted"
    # a key the client sent is quoted short and printable in the message
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "metadata": {"\x00" * 5000: 1}})
    assert r.status_code == 400 and len(r.json()["message"]) < 300 and "\x00" not in r.json()["message"]
    assert sandboxes(api) == before


@pytest.mark.parametrize(
    ("field", "message"),
    [
        (
            {"iam": {"tokens": {"aws": {"audience": "sts.amazonaws.com", "tokenType": "JWT-SVID"}}}},
            "Sandbox IAM workload tokens are not available for your team.",
        ),
        (
            {"network": {"httpsPorts": [8443]}},
            "HTTPS sandbox ports (network.httpsPorts) are not available for your team.",
        ),
    ],
    ids=["iam", "httpsPorts"],
)
def test_unbuilt_e2b_features_are_refused_in_e2b_words(api: httpx.Client, field: dict[str, Any], message: str) -> None:
    """They were 201 with the feature silently missing: a sandbox without the volume or token asked for."""
    before = sandboxes(api)
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 60, **field})
    assert (r.status_code, r.json()["message"]) == (400, message), r.text
    assert sandboxes(api) == before


def test_a_mount_of_a_volume_that_does_not_exist_is_a_404_naming_it(api: httpx.Client) -> None:
    before = sandboxes(api)
    body = {"templateID": TEMPLATE, "timeout": 60, "volumeMounts": [{"name": "data", "path": "/mnt/data"}]}
    r = api.post("/v2/sandboxes", json=body)
    assert (r.status_code, r.json()["message"]) == (404, "volume 'data' not found"), r.text
    assert sandboxes(api) == before


def test_empty_forms_of_unbuilt_features_and_sound_labels_are_accepted(api: httpx.Client, node: Server) -> None:
    """What an SDK sends when a feature is not used (null, empty) is fine, and labels at their
    bounds, in any script, and multi-line env values (a PEM key) go through unchanged."""
    from e2b import Sandbox

    metadata = {"é": "ü", "emoji": "🙂 ok", "k" * 256: "v" * 4096, "tab-free": "a b"}
    pem = "-----BEGIN KEY-----\r\nAAAA\tBBBB\n-----END KEY-----\n"
    body = {
        "templateID": TEMPLATE,
        "timeout": 120,
        "metadata": metadata,
        "envVars": {"PEM": pem, "EMPTY": "", "dotted.name": "1"},
        "volumeMounts": [],
        "iam": {"tokens": {}},
        "mcp": None,
        "secure": None,
        "autoResume": {"policy": "off"},
        "network": {"allowOut": [], "denyOut": [], "dnsServers": ["8.8.8.8"], "httpsPorts": [], "rules": None},
    }
    r = api.post("/v2/sandboxes", json=body)
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert api.get(f"/sandboxes/{sid}").json()["metadata"] == metadata
    for empty in ({"iam": None, "volumeMounts": None, "mcp": {}}, {"iam": {}, "network": None}):
        r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 60, **empty})
        assert r.status_code == 201, r.text
    sbx = Sandbox.connect(sid)
    assert sbx.commands.run('printf %s "$PEM"').stdout == pem


def test_the_sdks_create_and_fork_with_every_option_they_send(api: httpx.Client, node: Server) -> None:
    """The fields each SDK puts in a create and a fork, as it sends them."""
    from e2b import Sandbox

    from aenv.sdk import Client

    sbx = Sandbox.create(
        template=TEMPLATE,
        timeout=120,
        metadata={"suite": "validation"},
        envs={"FROM": "python"},
        secure=True,
        allow_internet_access=False,
        network={"allow_out": ["1.1.1.1"], "deny_out": ["10.0.0.0/8"], "allow_public_traffic": True},
        lifecycle={"on_timeout": "pause", "auto_resume": True},
    )
    assert sbx.commands.run("echo $FROM").stdout == "python\n"
    children = sbx.fork(count=2, timeout=60)
    assert len(children) == 2 and all(not isinstance(c, Exception) for c in children), children
    with Client(node.url, node.env["AENV_API_KEY"]) as aenv:
        own = aenv.create(
            TEMPLATE,
            timeout=120,
            metadata={"suite": "validation"},
            envs={"FROM": "aenv"},
            auto_pause=True,
            keep_memory=False,
            limits={"memoryMB": 256},
        )
        assert len(own.fork(2, timeout=60)) == 2
    node_bin = shutil.which("node")
    if node_bin is None or not (JS / "node_modules" / "e2b").is_dir():
        if os.environ.get("CI"):
            pytest.fail("needs node and `npm install` in tests/compat/js (scripts/install does both)")
        return
    script = """
import { Sandbox } from 'e2b'
const sbx = await Sandbox.create('bb', {
  timeoutMs: 120_000, metadata: { suite: 'validation' }, envs: { FROM: 'js' }, allowInternetAccess: false,
  network: { allowOut: ['1.1.1.1'], denyOut: ['10.0.0.0/8'], allowPublicTraffic: true },
  lifecycle: { onTimeout: 'pause', autoResume: true },
})
const out = (await sbx.commands.run('echo $FROM')).stdout
const children = await Sandbox.fork(sbx.sandboxId, { count: 2, timeoutMs: 60_000 })
console.log(JSON.stringify({ out, children: children.map((c) => (c instanceof Error ? String(c) : 'ok')) }))
"""
    done = subprocess.run(
        [node_bin, "--input-type=module", "-e", script],
        cwd=JS,
        env={
            **os.environ,
            "E2B_API_KEY": node.env["AENV_API_KEY"],
            "E2B_API_URL": node.url,
            "E2B_SANDBOX_URL": node.url,
        },
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {"out": "js\n", "children": ["ok", "ok"]}


BAD_FORKS: list[Any] = [
    {"n": 1000000000},
    {"n": True},
    {"n": -1},
    {"count": 1, "n": 2},
    {"count": 1, "timeoutMs": 1000},
    {"count": 17},  # past AENV_MAX_FORK (16)
    {"count": 10**12},
    {"count": 2**64},
    {"count": 1.0},
    {"count": True},
    {"count": 0},
    {"count": -1},
    {"count": "2"},
    {"count": None},
    {"timeout": True},
    {"timeout": 0},
    # aenv's per-child metadata: one map, or one per child, of strings within a create's bounds
    {"count": 1, "metadata": [{"a": "b"}, {"c": "d"}]},
    {"count": 2, "metadata": [{"a": "b"}]},
    {"metadata": {"k": 1}},
    {"metadata": [{"k": "v\x00"}]},
    {"metadata": "k=v"},
    {"metadata": {f"k{i}": "v" for i in range(129)}},
]


def test_fork_bodies_with_unknown_or_mistyped_fields_are_400_and_fork_nothing(api: httpx.Client) -> None:
    r = api.post("/v2/sandboxes", json={"templateID": TEMPLATE, "timeout": 120})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    assert refused(api, "POST", f"/sandboxes/{sid}/fork", BAD_FORKS) == []
    for raw in (b"true", b"-1", b"1000000000", b"[2]", b'"n"'):
        r = api.post(f"/sandboxes/{sid}/fork", content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400, (raw, r.status_code, r.text)
    assert sandboxes(api) == {sid}  # no child was made
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    r = api.post(f"/sandboxes/{sid}/fork", json={})  # E2B's default: one child
    assert r.status_code == 201 and len(r.json()) == 1, r.text


def test_signed_urls_with_paths_no_file_can_have_are_414_and_sdk_urls_still_work(
    api: httpx.Client, node: Server
) -> None:
    """A signed /files URL's path and username are bounded before its signature is hashed (a
    node hashed the whole URL once per secure sandbox: aenv/api/signed.py); the SDK's own URLs,
    naming no sandbox, still find theirs. The 414s were 401s after that search before."""
    from e2b import Sandbox

    sbx = Sandbox.create(template=TEMPLATE, timeout=120)
    sbx.files.write("/home/user/signed.txt", "signed")
    assert httpx.get(sbx.download_url("/home/user/signed.txt", use_signature_expiration=60)).text == "signed"
    upload = sbx.upload_url("/home/user/up.txt", use_signature_expiration=60)
    assert httpx.post(upload, files={"file": ("up.txt", b"uploaded")}).status_code == 200
    assert sbx.files.read("/home/user/up.txt") == "uploaded"
    routed = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    for path, user in (("/" + "a" * 60_000, "user"), ("/home/user/" + "b/" * 3_000, "user"), ("/x", "u" * 300)):
        url = sbx.download_url(path, user, use_signature_expiration=60)
        for headers in ({}, routed):
            r = httpx.get(url, headers=headers)
            assert r.status_code == 414 and r.json()["code"] == 414, (len(path), headers, r.text[:200])
