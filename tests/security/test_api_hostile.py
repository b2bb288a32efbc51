"""The HTTP surface against hostile clients: authentication by exact route, tokens before any
resume, bounded bodies, uploads streamed into the sandbox, and no 500 for a client mistake."""

from __future__ import annotations

import secrets
from collections.abc import Iterator

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.conftest import Server

pytestmark = pytest.mark.sandbox
ENVD_PORT = 49983
METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS")


@pytest.fixture()
def anonymous(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=120) as client:
        yield client


def create(api: httpx.Client, **body: object) -> str:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, **body})
    assert r.status_code == 201, r.text
    return str(r.json()["sandboxID"])


def state_of(api: httpx.Client, sandbox_id: str) -> str:
    r = api.get(f"/sandboxes/{sandbox_id}")
    assert r.status_code == 200, r.text
    return str(r.json()["state"])


def assert_error(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, (r.request.method, r.request.url, r.status_code, r.text)
    body = r.json()
    assert isinstance(body, dict) and body.get("code") and body.get("message"), body
    return body


def refused_websocket(url: str, headers: dict[str, str] | None = None) -> bool:
    try:
        with ws_connect(url, additional_headers=headers or {}, open_timeout=30):
            return False
    except InvalidStatus:
        return True


# -- authentication by exact (method, route) ----------------------------------------------------
def test_signed_upload_route_is_open_only_to_a_put_with_its_token(
    api: httpx.Client, anonymous: httpx.Client, server: Server
) -> None:
    """The template-file upload exemption once matched any method: `DELETE /templates/<x>/files/<y>/upload`
    without a key deleted the snapshot of that name."""
    sid = create(api)
    name = f"victim-{secrets.token_hex(3)}/files/b/upload"
    try:
        r = api.post(f"/sandboxes/{sid}/snapshots", json={"name": name})
        assert r.status_code == 201, r.text
        snapshot_id = r.json()["snapshotID"]
        for method in METHODS:
            r = anonymous.request(method, f"/templates/{name}")
            assert r.status_code == 401, (method, r.status_code, r.text)
            for query in ("", "?token=", "?token=" + "0" * 64, "?token=%C3%A9"):
                r = anonymous.request(method, f"/templates/{name}{query}")
                assert r.status_code == 401, (method, query, r.status_code, r.text)
        assert api.get(f"/snapshots/{snapshot_id}").status_code == 200
        # the one open door: PUT with the token the files link (API key needed) handed out
        link = api.get("/templates/tpl/files/abc123").json()["url"]
        upload = "/" + link.split("/", 3)[3]
        for method in METHODS:
            if method != "PUT":
                assert anonymous.request(method, upload).status_code == 401, method
        assert anonymous.put(upload.replace("abc123", "abc124"), content=b"x").status_code == 401
        assert anonymous.put(upload, content=b"").status_code == 200
    finally:
        api.delete(f"/sandboxes/{sid}")
        api.delete(f"/templates/{name}")


def test_public_paths_answer_only_reads_without_a_key(anonymous: httpx.Client, server: Server) -> None:
    for path in ("/health", "/metrics", "/openapi.json", "/docs", "/redoc"):
        assert anonymous.get(path).status_code == 200, path
        for method in ("POST", "PUT", "PATCH", "DELETE"):
            r = anonymous.request(method, path)
            assert_error(r, 401)
    for path in ("/health/", "/HEALTH", "/openapi.json/../sandboxes", "/sandboxes", "/v2/sandboxes", "/templates"):
        assert_error(anonymous.get(path), 401)
    ws = server.url.replace("http://", "ws://")
    for path in ("/sandboxes", "/health", "/templates/a/files/b/upload?token=x"):
        assert refused_websocket(ws + path), path


# -- envd: the access token before any resume ----------------------------------------------------
def test_envd_without_a_valid_token_leaves_a_paused_sandbox_paused(api: httpx.Client, server: Server) -> None:
    r = api.post(
        "/v2/sandboxes",
        json={"templateID": "base", "timeout": 300, "autoPause": True, "autoResume": {"enabled": True}},
    )
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    try:
        assert api.post(f"/sandboxes/{sid}/pause").status_code == 204
        routed = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT)}
        requests = [
            ("POST", "/process.Process/List", {"content-type": "application/json"}, b"{}"),
            ("POST", "/filesystem.Filesystem/Stat", {"content-type": "application/json"}, b'{"path": "/"}'),
            ("GET", "/files?path=/etc/hostname", {}, b""),
            ("GET", "/files?path=/etc/hostname&signature=v1_bogus", {}, b""),
            ("POST", "/files?path=/tmp/x", {"content-type": "application/octet-stream"}, b"data"),
            ("GET", "/envs", {}, b""),
            ("GET", "/metrics", {}, b""),
            ("DELETE", "/files?path=/tmp/x", {}, b""),
            ("GET", "/no/such/endpoint", {}, b""),
        ]
        with httpx.Client(base_url=server.url, timeout=60) as client:
            for credentials in ({}, {"X-Access-Token": "0" * 40}, {"X-Access-Token": token[:-1]}):
                for method, path, headers, body in requests:
                    r = client.request(method, path, headers={**routed, **headers, **credentials}, content=body)
                    assert r.status_code == 401, (credentials, method, path, r.status_code, r.text)
                    assert state_of(api, sid) == "paused", (credentials, method, path)
            # a signed URL without a sandbox in it, and a WebSocket to envd's port, wake nothing either
            r = client.get("/files", params={"path": "/etc/hostname", "signature": "v1_bogus"})
            assert r.status_code == 401
            ws = server.url.replace("http://", "ws://") + "/process.Process/List"
            assert refused_websocket(ws, routed) and refused_websocket(ws, {**routed, "X-Access-Token": token})
            assert state_of(api, sid) == "paused"
            # the right token does resume it
            r = client.post(
                "/process.Process/List",
                headers={**routed, "content-type": "application/json", "X-Access-Token": token},
                content=b"{}",
            )
            assert r.status_code == 200, r.text
            assert state_of(api, sid) == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")
