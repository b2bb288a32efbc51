"""The HTTP surface against hostile clients: authentication by exact route, tokens before any
resume, bounded bodies, uploads streamed into the sandbox, and no 500 for a client mistake."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import secrets
import socket
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.conftest import API_KEY, Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime
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


def test_private_traffic_is_refused_not_ignored(api: httpx.Client) -> None:
    """Ports are made private at create (tests/compat/test_network_options.py): an update asking for
    it must not be taken for done."""
    assert_error(api.put(f"/sandboxes/{NO_SANDBOX}/network", json={"allowPublicTraffic": False}), 400)
    assert_error(api.put(f"/sandboxes/{NO_SANDBOX}/network", json={"maskRequestHost": "x"}), 400)


def test_sandbox_ports_out_of_range_are_400(server: Server) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        for port in ("99999", "0", "-1", "x", "1e3"):
            r = client.get("/", headers={"E2b-Sandbox-Id": NO_SANDBOX, "E2b-Sandbox-Port": port})
            assert r.status_code == 400, (port, r.text)
        r = client.get("/", headers={"Host": f"99999-{NO_SANDBOX}.example.com"})
        assert r.status_code == 400, r.text


def test_template_uploads_are_bounded_by_their_declared_length(api: httpx.Client, server: Server) -> None:
    """A build context or template file upload announcing more than AENV_MAX_UPLOAD_MB is refused
    before a byte of it is stored."""
    files_hash = secrets.token_hex(8)
    link = api.get(f"/templates/bounded/files/{files_hash}").json()["url"]
    upload = "/" + link.split("/", 3)[3]
    for method, target in (("PUT", upload), ("POST", "/templates/build?name=bounded")):
        head = f"{method} {target} HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\nContent-Length: {64 * 2**30}\r\n\r\n"
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(head.encode() + b"x" * 1024)
            status, _, payload = _read_response(sock.makefile("rb"))
        assert status == 413 and json.loads(payload)["error_code"] == "payload_too_large", (method, payload)
    assert api.get(f"/templates/bounded/files/{files_hash}").json()["present"] is False


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


# -- control plane: a client's mistake is a 4xx JSON answer, never a 500 ------------------------------
NO_SANDBOX = "nosuchsandbox0000000"
BODY_ROUTES = [
    ("POST", "/sandboxes"),
    ("POST", "/v2/sandboxes"),
    ("POST", "/v3/templates"),
    ("POST", "/templates/from-image"),
    ("POST", "/templates/tags"),
    ("DELETE", "/templates/tags"),
    ("PATCH", "/templates/no-such-template"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/timeout"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/refreshes"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/connect"),
    ("POST", f"/v2/sandboxes/{NO_SANDBOX}/connect"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/resume"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/snapshots"),
    ("POST", f"/sandboxes/{NO_SANDBOX}/fork"),
    ("PUT", f"/sandboxes/{NO_SANDBOX}/network"),
]
NOT_AN_OBJECT = [b"{", b"[1, 2]", b'"text"', b"5", b"null", b"true", b"\xff\xfe", b'{"a": 1}{']


def test_bodies_that_are_not_objects_are_400(api: httpx.Client) -> None:
    for method, path in BODY_ROUTES:
        for body in NOT_AN_OBJECT:
            r = api.request(method, path, content=body, headers={"content-type": "application/json"})
            assert_error(r, 400)


@pytest.mark.parametrize("path", ["/v3/templates", "/templates/from-image", "/templates/tags"])
@pytest.mark.parametrize("body", [b"", b"  \n", b"{}"])
def test_empty_bodies_where_fields_are_required_are_400(api: httpx.Client, path: str, body: bytes) -> None:
    assert_error(api.post(path, content=body), 400)
    assert_error(api.request("DELETE", "/templates/tags", content=body), 400)
    assert_error(api.post(f"/sandboxes/{NO_SANDBOX}/timeout", content=body), 400)


WRONG_TYPES = [
    # booleans are not numbers
    ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": True}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": False}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "limits": {"memoryMB": True}}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "limits": {"cpuCount": True}}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/fork", {"count": True}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/fork", {"count": 1, "timeout": True}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/timeout", {"timeout": True}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/refreshes", {"duration": True}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/connect", {"timeout": True}),
    # strings and floats are not numbers either
    ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": "30"}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 30.5}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/fork", {"count": "2"}),
    # numbers and strings are not booleans
    ("POST", "/v2/sandboxes", {"templateID": "base", "autoPause": 1}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "secure": "false"}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "autoResume": {"enabled": 1}}),
    ("POST", f"/sandboxes/{NO_SANDBOX}/snapshots", {"durable": 1}),
    # and the rest
    ("POST", "/v2/sandboxes", {"templateID": 5}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "metadata": {"a": 1}}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "envVars": ["A=1"]}),
    ("POST", "/v2/sandboxes", {"templateID": "base", "network": {"allowOut": "1.1.1.1"}}),
    ("POST", "/v3/templates", {"name": 5}),
    ("POST", "/templates/tags", {"target": "base", "tags": "v1"}),
    ("PATCH", "/templates/no-such-template", {"aliases": [1]}),
]


def test_wrong_types_are_400_and_create_nothing(api: httpx.Client) -> None:
    before = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    for method, path, body in WRONG_TYPES:
        assert_error(api.request(method, path, json=body), 400)
    after = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    for created in after - before:
        api.delete(f"/sandboxes/{created}")
    assert after == before


def test_wrong_query_types_are_400(api: httpx.Client) -> None:
    for path in ("/v2/sandboxes?limit=x", "/v2/sandboxes?limit=true", "/templates/a/builds/b/status?logsOffset=x"):
        assert_error(api.get(path), 400)
    assert_error(api.delete("/templates/no-such-template?force=maybe"), 400)
    assert_error(api.get("/templates/a/files/a-b"), 400)


def test_bodies_are_bounded_while_they_arrive(api: httpx.Client, server: Server) -> None:
    """A 400 MiB JSON body once cost 700 MiB of server memory: it is refused at 1 MiB, with or
    without a Content-Length."""
    big = b'{"templateID": "base", "metadata": {"a": "' + b"x" * (2 * 2**20) + b'"}}'
    assert_error(api.post("/v2/sandboxes", content=big), 413)

    def chunked(total: int) -> Iterator[bytes]:
        yield b'{"metadata": {"a": "'
        for _ in range(total // 2**20):
            yield b"x" * 2**20

    rss_before = _rss(server.proc.pid)
    for method, path in BODY_ROUTES:
        r = api.request(method, path, content=chunked(3 * 2**20))
        assert_error(r, 413)
    r = api.post("/v2/sandboxes", content=chunked(200 * 2**20))
    assert_error(r, 413)
    assert _rss(server.proc.pid) - rss_before < 100 * 2**20
    assert api.get("/health").status_code == 200


def _rss(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_unreachable_registry_is_a_502_naming_it_on_a_live_connection(server: Server) -> None:
    """It was a 500 that also dropped the keep-alive connection."""
    body = json.dumps({"name": f"unreachable-{secrets.token_hex(3)}", "image": "127.0.0.1:9/nothing/here:latest"})
    request = (
        f"POST /templates/from-image HTTP/1.1\r\nHost: x\r\nX-API-Key: {API_KEY}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as sock:
        reader = sock.makefile("rb")
        sock.sendall(request)
        status, headers, payload = _read_response(reader)
        assert status == 502, payload
        error = json.loads(payload)
        assert error["error_code"] == "upstream_error" and "127.0.0.1:9" in error["message"], error
        assert headers.get("connection", "").lower() != "close"
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # the same connection still answers
        assert _read_response(reader)[0] == 200


def _read_response(reader: Any) -> tuple[int, dict[str, str], bytes]:
    status = int(reader.readline().split()[1])
    headers = {}
    while (line := reader.readline().strip()) != b"":
        key, _, value = line.decode().partition(":")
        headers[key.strip().lower()] = value.strip()
    return status, headers, reader.read(int(headers.get("content-length", "0")))


# -- envd: what reaches the agent has the types it expects ---------------------------------------------
@pytest.fixture()
def envd(api: httpx.Client, server: Server) -> Iterator[tuple[httpx.Client, str]]:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT), "X-Access-Token": token}
    with httpx.Client(base_url=server.url, headers=headers, timeout=60) as client:
        yield client, sid
    api.delete(f"/sandboxes/{sid}")


NUL = "/home/user/a\x00b"
RPC_MISTAKES = [
    # a NUL byte in every path field
    ("/filesystem.Filesystem/Stat", {"path": NUL}),
    ("/filesystem.Filesystem/ListDir", {"path": NUL}),
    ("/filesystem.Filesystem/MakeDir", {"path": NUL}),
    ("/filesystem.Filesystem/Move", {"source": NUL, "destination": "/tmp/x"}),
    ("/filesystem.Filesystem/Move", {"source": "/tmp", "destination": NUL}),
    ("/filesystem.Filesystem/Remove", {"path": NUL}),
    ("/filesystem.Filesystem/CreateWatcher", {"path": NUL}),
    ("/filesystem.Filesystem/WatchDir", {"path": NUL}),
    ("/process.Process/Start", {"process": {"cmd": "/bin/true", "cwd": NUL}}),
    # paths no file system takes, strings that are not text
    ("/filesystem.Filesystem/Stat", {"path": "/" + "a" * 300}),
    ("/filesystem.Filesystem/MakeDir", {"path": "/tmp/\ud800"}),
    # wrong types for every number
    ("/process.Process/SendSignal", {"process": {"pid": "x"}, "signal": "SIGNAL_SIGKILL"}),
    ("/process.Process/SendSignal", {"process": {"pid": True}, "signal": "SIGNAL_SIGKILL"}),
    ("/process.Process/SendSignal", {"process": {"pid": -1}, "signal": "SIGNAL_SIGKILL"}),
    ("/process.Process/SendSignal", {"process": {"pid": 1}, "signal": {"x": 1}}),
    ("/process.Process/SendSignal", {"process": "x"}),
    ("/process.Process/SendInput", {"process": {"pid": 1.5}, "input": {"stdin": "aGk="}}),
    ("/process.Process/SendInput", {"process": {"pid": 1}, "input": {"stdin": "not base64!"}}),
    ("/process.Process/CloseStdin", {"process": {"pid": [1]}}),
    ("/process.Process/Update", {"process": {"pid": 1}, "pty": {"size": {"cols": "wide", "rows": 24}}}),
    ("/process.Process/Update", {"process": {"pid": 1}, "pty": {"size": {"cols": True, "rows": 24}}}),
    ("/process.Process/Connect", {"process": {"pid": {}}}),
    ("/filesystem.Filesystem/ListDir", {"path": "/", "depth": "x"}),
    ("/filesystem.Filesystem/ListDir", {"path": "/", "depth": True}),
    ("/filesystem.Filesystem/ListDir", {"path": "/", "depth": 2**40}),
    ("/process.Process/Start", {"process": {"cmd": "/bin/true"}, "pty": {"size": {"cols": "x", "rows": 1}}}),
    ("/process.Process/Start", {"process": {"cmd": "/bin/true"}, "pty": {"size": {"cols": 70000, "rows": 1}}}),
    ("/process.Process/Update", {"process": {"pid": 1}, "pty": {"size": {"cols": 80, "rows": 2**32 - 1}}}),
    # numbers are not booleans, and the rest
    ("/process.Process/Start", {"process": {"cmd": "/bin/true"}, "stdin": 1}),
    ("/process.Process/Start", {"process": {"cmd": 5}}),
    ("/process.Process/Start", {"process": {"cmd": "/bin/true", "args": "-x"}}),
    ("/process.Process/Start", {"process": {"cmd": "/bin/true", "envs": {"A": 1}}}),
    ("/process.Process/Start", {"process": "sh"}),
    ("/filesystem.Filesystem/CreateWatcher", {"path": "/tmp", "recursive": "yes"}),
    ("/filesystem.Filesystem/WatchDir", {"path": "/tmp", "recursive": 1}),
    ("/filesystem.Filesystem/GetWatcherEvents", {"watcherId": {"id": 1}}),
    ("/filesystem.Filesystem/RemoveWatcher", {"watcherId": ["w1"]}),
]


def test_envd_field_mistakes_are_400_and_the_sandbox_lives_on(envd: tuple[httpx.Client, str]) -> None:
    client, _ = envd
    for path, msg in RPC_MISTAKES:
        body = json.dumps(msg).encode()
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (path, msg, r.status_code, r.text)
        assert r.json()["code"] == "invalid_argument" and r.json()["message"], r.text
    for body in NOT_AN_OBJECT:
        r = client.post("/filesystem.Filesystem/Stat", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, (body, r.text)
    r = client.post("/filesystem.Filesystem/ListDir", json={"path": "/home", "depth": "2"})  # proto3 JSON allows it
    assert r.status_code == 200 and r.json()["entries"], r.text
    assert client.post("/process.Process/List", json={}).status_code == 200


def test_impossible_file_operations_are_4xx(envd: tuple[httpx.Client, str]) -> None:
    """What the sandbox's file system refuses (read-only, busy) is the client's to fix, not a 500."""
    client, _ = envd
    as_root = {"authorization": "Basic cm9vdDo="}
    cases = [
        ("/filesystem.Filesystem/MakeDir", {"path": "/sys/aenv-test"}, 403),
        ("/filesystem.Filesystem/Remove", {"path": "/sys/kernel"}, 403),
        ("/filesystem.Filesystem/Move", {"source": "/tmp", "destination": "/"}, 400),
    ]
    for path, msg, status in cases:
        r = client.post(path, json=msg, headers=as_root)
        assert r.status_code == status, (path, msg, r.status_code, r.text)
    r = client.post("/files", params={"path": "/sys/aenv-test"}, content=b"x", headers=as_root)
    assert r.status_code == 403 and r.json()["code"] == 403, r.text


def test_envd_files_with_nul_bytes_are_400(envd: tuple[httpx.Client, str]) -> None:
    client, _ = envd
    cases = [
        client.get("/files", params={"path": NUL}),
        client.get("/files", params={"path": "/etc/hostname", "username": "us\x00er"}),
        client.post("/files", params={"path": NUL}, content=b"x", headers={"content-type": "application/octet-stream"}),
        client.post("/files", params={"path": "/tmp/x", "username": "\x00"}, content=b"x"),
        client.post("/files", params={"path": NUL}, files={"file": ("x", b"data")}),
        client.post("/files", content=_multipart(b"/tmp/a\x00b", b"data"), headers={"content-type": MULTIPART}),
        client.get("/files", params={"path": "/etc/hostname"}, headers={"authorization": "Basic dXMAZXI6"}),
    ]
    for r in cases:
        assert r.status_code == 400, (r.request.url, r.status_code, r.text)
        assert r.json()["code"] == 400 and r.json()["message"], r.text
    # and a multipart body that is not one
    r = client.post("/files", content=b"--nope\r\n", headers={"content-type": MULTIPART})
    assert r.status_code == 400, r.text
    r = client.post("/files", content=b"data", headers={"content-type": "multipart/form-data"})
    assert r.status_code == 400, r.text
    r = client.post("/files", content=b"data", headers={"content-type": MULTIPART.replace(BOUNDARY, "b" * 5000)})
    assert r.status_code == 400, r.text
    # a gzip upload that is not gzip, or stops short, writes nothing
    compressed = gzip.compress(b"x" * 100_000)
    for body in (b"not gzip", compressed[: len(compressed) // 2]):
        r = client.post("/files", params={"path": "/home/user/z"}, content=body, headers=GZIP)
        assert r.status_code == 400, r.text
        assert client.get("/files", params={"path": "/home/user/z"}).status_code == 404


GZIP = {"content-type": "application/octet-stream", "content-encoding": "gzip"}
BOUNDARY = "aenvtestboundary"
MULTIPART = f"multipart/form-data; boundary={BOUNDARY}"


def _multipart(filename: bytes, data: bytes) -> bytes:
    head = f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="'.encode()
    return head + filename + b'"\r\n\r\n' + data + f"\r\n--{BOUNDARY}--\r\n".encode()


# -- uploads stream into the sandbox ------------------------------------------------------------------
class Zeros(io.RawIOBase):
    """``size`` bytes read by httpx in pieces, never held whole."""

    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


class TempWatch:
    """The most bytes the server process ever held open in files under the temp dir."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self.root = tempfile.gettempdir().rstrip("/") + "/"  # the server's too: it has our environment
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> TempWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            held = 0
            for fd in Path(f"/proc/{self.pid}/fd").iterdir():
                try:
                    target = os.readlink(fd)
                    if target.startswith(self.root):
                        held += fd.stat().st_size
                except OSError:
                    continue
            self.peak = max(self.peak, held)


@pytest.mark.runsc  # a disk quota (an ext4 upper)
def test_an_upload_past_the_disk_quota_is_507_and_spools_nothing(
    api: httpx.Client, server: Server, e2b_env: Server
) -> None:
    r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300, "limits": {"diskSizeMB": 128}})
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(ENVD_PORT), "X-Access-Token": token}
    try:
        before = _temp_files()
        with TempWatch(server.proc.pid) as watch, httpx.Client(base_url=server.url, timeout=300) as client:
            uploads: list[tuple[dict[str, Any], dict[str, str]]] = [
                ({"params": {"path": "/home/user/big"}, "files": {"file": ("big", Zeros(300 * 2**20))}}, {}),
                ({"params": {"path": "/home/user/big"}, "content": _zeros(300 * 2**20)}, {"content-type": OCTETS}),
                ({"content": _multipart_stream(b"/home/user/big", 300 * 2**20)}, {"content-type": MULTIPART}),
            ]
            for upload, content_type in uploads:
                r = client.post("/files", headers={**headers, **content_type}, **upload)
                error = assert_error(r, 507)
                assert error["error_code"] == "insufficient_storage" and "128 MiB" in str(error["message"]), error
        assert watch.peak < 2**20, f"the server held {watch.peak} bytes in temp files"
        assert _temp_files() - before == set()
        # the sandbox lives on, the partial file is gone and its space is back
        from e2b import NotEnoughSpaceException, Sandbox

        sbx = Sandbox.connect(sid)
        assert sbx.commands.run("ls /home/user/big 2>&1 || echo gone").stdout.strip().endswith("gone")
        assert sbx.commands.run("df -m --output=used /home/user | tail -1").stdout.strip() != ""
        sbx.files.write("/home/user/small.txt", "still writable")
        assert sbx.files.read("/home/user/small.txt") == "still writable"
        with pytest.raises(NotEnoughSpaceException, match="128 MiB"):
            sbx.files.write("/home/user/big", b"\0" * (200 * 2**20), use_octet_stream=False)
        with pytest.raises(NotEnoughSpaceException, match="128 MiB"):
            sbx.files.write("/home/user/big", io.BytesIO(bytes(200 * 2**20)), gzip=True)
        sbx.files.write("/home/user/after.txt", "ok")
        assert sbx.files.read("/home/user/after.txt") == "ok"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_streamed_uploads_keep_every_byte(sandbox: Any) -> None:
    data = os.urandom(24 * 2**20)
    digest = hashlib.sha256(data).hexdigest()
    sandbox.files.write("/home/user/multipart.bin", data, use_octet_stream=False)
    sandbox.files.write("/home/user/octet.bin", io.BytesIO(data))
    sandbox.files.write("/home/user/gzip.bin", io.BytesIO(data), gzip=True)
    sandbox.files.write_files(
        [{"path": "/home/user/one.txt", "data": "one"}, {"path": "/home/user/two.bin", "data": data[:1000]}]
    )
    out = sandbox.commands.run("cd /home/user && sha256sum multipart.bin octet.bin gzip.bin && cat one.txt").stdout
    assert out.count(digest) == 3 and out.endswith("one"), out
    assert sandbox.files.read("/home/user/two.bin", format="bytes") == data[:1000]


OCTETS = "application/octet-stream"


def _zeros(size: int) -> Iterator[bytes]:
    for _ in range(size // 2**20):
        yield bytes(2**20)


def _multipart_stream(filename: bytes, size: int) -> Iterator[bytes]:
    head, tail = _multipart(filename, b"").split(b"\r\n\r\n", 1)
    yield head + b"\r\n\r\n"
    yield from _zeros(size)
    yield tail


def _temp_files() -> set[str]:
    return {str(p) for p in Path(tempfile.gettempdir()).iterdir() if p.is_file() and p.stat().st_size > 2**20}
