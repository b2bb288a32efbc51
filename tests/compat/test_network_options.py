"""E2B's `network` ingress options against aenv: private ports behind the traffic access token
(`allowPublicTraffic: false`), the Host a port sees (`maskRequestHost`), and the egress options
aenv refuses as E2B refuses them to a team without them (`egressProxy`), or checks as E2B (`rules`).

E2B's own tests (`test_network.py::test_allow_public_traffic_false`, `::test_mask_request_host`)
reach the port through `https://<port>-<id>.<domain>`; here the same requests go to the test node
with the routing headers or the `<port>-<id>.<anything>` Host, as `E2B_SANDBOX_URL` clients do.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxNetworkOpts, SandboxState
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect as ws_connect

from tests.compat.conftest import Deployment
from tests.compat.servers import WEBSOCKET_SERVER
from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

TOKEN = "e2b-traffic-access-token"
# Answers every GET with the request's path and headers, as the port received them.
HEADERS_SERVER = r"""
import http.server, json, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        out = json.dumps({"path": self.path, "headers": [[k.lower(), v] for k, v in self.headers.items()]}).encode()
        self.send_response(200); self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out))); self.end_headers(); self.wfile.write(out)
    def log_message(self, *args): pass
http.server.ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""
PORT = 8080


def routed(sandbox_id: str, port: int = PORT, **extra: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port), **extra}


def serve_headers(sandbox: Sandbox, deployment: Deployment, token: str | None) -> None:
    """Start the headers server on PORT and wait until the proxy reaches it."""
    sandbox.files.write("/home/user/headers.py", HEADERS_SERVER)
    sandbox.commands.run(f"python3 /home/user/headers.py {PORT}", background=True)
    headers = routed(sandbox.sandbox_id, **({TOKEN: token} if token else {}))
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if httpx.get(f"{deployment.url}/probe", headers=headers).status_code == 200:
            return
        time.sleep(0.2)
    raise AssertionError(f"nothing answers on {PORT} inside the sandbox")


def seen_headers(response: httpx.Response) -> dict[str, list[str]]:
    assert response.status_code == 200, response.text
    out: dict[str, list[str]] = {}
    for name, value in response.json()["headers"]:
        out.setdefault(name, []).append(value)
    return out


def assert_refused(response: httpx.Response, sandbox_id: str, why: str) -> None:
    """E2B's proxy answer: 403 with its JSON body."""
    assert response.status_code == 403, response.text
    assert response.headers["content-type"] == "application/json; charset=utf-8"
    body = response.json()
    assert body["code"] == 403 and body["sandboxId"] == sandbox_id
    assert body["message"] == f"Sandbox is secured with traffic access token. {why}", body


MISSING = f"Token header '{TOKEN}' is missing"
INVALID = f"Provided token in header '{TOKEN}' is invalid"


@pytest.fixture()
def api(deployment: Deployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployment.url, headers={"X-API-Key": deployment.api_key}, timeout=120) as client:
        yield client


@pytest.fixture()
def private() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(timeout=300, secure=True, network=SandboxNetworkOpts(allow_public_traffic=False))
    yield sandbox
    sandbox.kill()


def test_private_ports_need_the_traffic_token(private: Sandbox, deployment: Deployment) -> None:
    token = private.traffic_access_token
    assert token and token != private._envd_access_token
    serve_headers(private, deployment, token)
    url, sid = f"{deployment.url}/hello", private.sandbox_id
    by_host = {"Host": f"{PORT}-{sid}.aenv.test"}
    for route in (routed(sid), by_host):
        assert_refused(httpx.get(url, headers=route), sid, MISSING)
        assert_refused(httpx.get(url, headers={**route, TOKEN: ""}), sid, MISSING)
        assert_refused(httpx.get(url, headers={**route, TOKEN: token[:-1]}), sid, INVALID)
        assert_refused(httpx.get(url, headers={**route, TOKEN: token + "0"}), sid, INVALID)
        assert_refused(httpx.get(url, headers={**route, TOKEN: token.upper()}), sid, INVALID)
        envd_token = private._envd_access_token or ""
        assert_refused(httpx.get(url, headers={**route, TOKEN: envd_token}), sid, INVALID)
        # the first header counts, as in Go's Header.Get
        doubled = httpx.Headers([*route.items(), (TOKEN, "wrong"), (TOKEN, token)])
        assert_refused(httpx.get(url, headers=doubled), sid, INVALID)
        seen = seen_headers(httpx.get(url, headers={**route, TOKEN: token}))
        assert TOKEN not in seen  # the proxy's credential stays at the proxy
    # other methods and bodies, and the WebSocket upgrade, are refused the same way
    assert_refused(httpx.post(url, headers=routed(sid), content=b"x" * 1000), sid, MISSING)
    upgrade = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
    upgrade["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
    assert_refused(httpx.get(url, headers={**upgrade, **routed(sid)}), sid, MISSING)
    assert_refused(httpx.get(url, headers={**upgrade, **routed(sid, **{TOKEN: "x"})}), sid, INVALID)
    # envd keeps its own rules: the SDK works, and the traffic token is no envd token
    assert private.commands.run("echo ok").stdout == "ok\n"
    envd = routed(sid, 49983, **{TOKEN: token})
    rpc = httpx.post(f"{deployment.url}/filesystem.Filesystem/Stat", json={"path": "/"}, headers=envd)
    assert rpc.status_code == 401
    # connect and get give the same token
    assert Sandbox.connect(sid).traffic_access_token == token


def test_a_token_opens_only_its_own_sandbox(private: Sandbox, deployment: Deployment) -> None:
    other = Sandbox.create(timeout=120, secure=True, network=SandboxNetworkOpts(allow_public_traffic=False))
    try:
        assert other.traffic_access_token not in (None, private.traffic_access_token)
        serve_headers(private, deployment, private.traffic_access_token)
        wrong = routed(private.sandbox_id, **{TOKEN: other.traffic_access_token or ""})
        assert_refused(httpx.get(f"{deployment.url}/", headers=wrong), private.sandbox_id, INVALID)
    finally:
        other.kill()
    # a public sandbox has no token and needs none; a token sent to it does not matter
    public = Sandbox.create(timeout=120, network=SandboxNetworkOpts(allow_public_traffic=True))
    try:
        assert public.traffic_access_token is None
        serve_headers(public, deployment, None)
        with_token = routed(public.sandbox_id, **{TOKEN: private.traffic_access_token or ""})
        assert httpx.get(f"{deployment.url}/", headers=with_token).status_code == 200
    finally:
        public.kill()


@pytest.mark.runsc  # its server keeps running through pause and fork
def test_the_token_survives_pause_resume_and_fork(private: Sandbox, deployment: Deployment, api: httpx.Client) -> None:
    token = private.traffic_access_token or ""
    sid = private.sandbox_id
    serve_headers(private, deployment, token)
    private.pause()
    # a caller without the token cannot wake it, whatever the lifecycle says
    assert_refused(httpx.get(f"{deployment.url}/", headers=routed(sid)), sid, MISSING)
    assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    detail = api.get(f"/sandboxes/{sid}").json()
    assert detail["network"]["allowPublicTraffic"] is False and detail["trafficAccessToken"] == token
    again = Sandbox.connect(sid)
    assert again.traffic_access_token == token
    assert httpx.get(f"{deployment.url}/", headers=routed(sid, **{TOKEN: token})).status_code == 200
    # fork children keep the parent's ingress options, each with a token of its own
    children = api.post(f"/sandboxes/{sid}/fork", json={"count": 2, "timeout": 120}).json()
    kids = [c["sandbox"] for c in children]
    try:
        tokens = {k["trafficAccessToken"] for k in kids}
        assert len(tokens) == 2 and token not in tokens
        for kid in kids:
            kid_id = kid["sandboxID"]
            assert_refused(httpx.get(f"{deployment.url}/", headers=routed(kid_id)), kid_id, MISSING)
            parents = routed(kid_id, **{TOKEN: token})
            assert_refused(httpx.get(f"{deployment.url}/", headers=parents), kid_id, INVALID)
            own = routed(kid_id, **{TOKEN: kid["trafficAccessToken"]})
            assert httpx.get(f"{deployment.url}/", headers=own).status_code == 200  # the server was forked too
    finally:
        for kid in kids:
            api.delete(f"/sandboxes/{kid['sandboxID']}")


def test_a_request_without_the_token_does_not_wake_a_paused_sandbox(deployment: Deployment, api: httpx.Client) -> None:
    body = {"templateID": "base", "timeout": 120, "autoResume": {"enabled": True}}
    created = api.post("/v2/sandboxes", json={**body, "network": {"allowPublicTraffic": False}}).json()
    sid, token = created["sandboxID"], created["trafficAccessToken"]
    try:
        api.post(f"/sandboxes/{sid}/pause").raise_for_status()
        for headers in (routed(sid), routed(sid, **{TOKEN: "0" * len(token)})):
            assert httpx.get(f"{deployment.url}/", headers=headers).status_code == 403
            ws = {"Upgrade": "websocket", "Connection": "Upgrade", "Sec-WebSocket-Version": "13"}
            ws["Sec-WebSocket-Key"] = "dGhlIHNhbXBsZSBub25jZQ=="
            assert httpx.get(f"{deployment.url}/", headers={**headers, **ws}).status_code == 403
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "paused"
        # with its token the request wakes it (nothing listens: the port's answer, after the resume)
        woken = httpx.get(f"{deployment.url}/", headers=routed(sid, **{TOKEN: token}), timeout=120)
        assert woken.status_code == 502 and "port is not open" in woken.json()["message"]
        assert api.get(f"/sandboxes/{sid}").json()["state"] == "running"
    finally:
        api.delete(f"/sandboxes/{sid}")


def test_websockets_carry_the_token_and_the_mask(deployment: Deployment) -> None:
    network = SandboxNetworkOpts(allow_public_traffic=False, mask_request_host="masked.example:${PORT}")
    sandbox = Sandbox.create(timeout=120, secure=True, network=network)
    try:
        token = sandbox.traffic_access_token or ""
        sandbox.files.write("/home/user/ws.py", WEBSOCKET_SERVER)
        sandbox.commands.run("python3 /home/user/ws.py 8765", background=True)
        url = deployment.url.replace("http", "ws", 1) + "/ws"
        deadline = time.monotonic() + 20
        while True:
            try:
                ws = ws_connect(url, additional_headers=routed(sandbox.sandbox_id, 8765, **{TOKEN: token}))
                break
            except (InvalidStatus, OSError):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with ws:
            ws.send("headers")
            names = ws.recv()
        assert "'x-forwarded-host'" in names and f"'{TOKEN}'" not in names
        with pytest.raises(InvalidStatus) as refused:
            ws_connect(url, additional_headers=routed(sandbox.sandbox_id, 8765))
        assert refused.value.response.status_code == 403
    finally:
        sandbox.kill()


@pytest.mark.runsc  # its server keeps running through a restart's pause
def test_the_token_survives_a_node_restart(server: Server, deployment: Deployment) -> None:
    if deployment.url != server.url:
        pytest.skip("restarts the test session's own node")
    sandbox = Sandbox.create(timeout=300, secure=True, network=SandboxNetworkOpts(allow_public_traffic=False))
    try:
        token = sandbox.traffic_access_token or ""
        serve_headers(sandbox, deployment, token)
        sandbox.pause()
        server.restart()
        assert_refused(httpx.get(f"{deployment.url}/", headers=routed(sandbox.sandbox_id)), sandbox.sandbox_id, MISSING)
        again = Sandbox.connect(sandbox.sandbox_id)
        assert again.get_info().state == SandboxState.RUNNING
        assert again.traffic_access_token == token
        ok = httpx.get(f"{deployment.url}/", headers=routed(sandbox.sandbox_id, **{TOKEN: token}))
        assert ok.status_code == 200
    finally:
        sandbox.kill()


@pytest.mark.parametrize(
    ("mask", "expected"),
    [("custom-host.example.com:${PORT}", f"custom-host.example.com:{PORT}"), ("custom-host.example.com", None)],
)
def test_mask_request_host(deployment: Deployment, mask: str, expected: str | None) -> None:
    sandbox = Sandbox.create(timeout=120, network=SandboxNetworkOpts(mask_request_host=mask))
    try:
        serve_headers(sandbox, deployment, None)
        expected = expected or mask
        by_header = seen_headers(httpx.get(f"{deployment.url}/", headers=routed(sandbox.sandbox_id)))
        assert by_header["host"] == [expected]
        assert by_header["x-forwarded-host"] == [httpx.URL(deployment.url).netloc.decode()]
        own_host = f"{PORT}-{sandbox.sandbox_id}.aenv.test"
        spoofed = {"Host": own_host, "X-Forwarded-Host": "evil.example"}
        by_host = seen_headers(httpx.get(f"{deployment.url}/", headers=spoofed))
        assert by_host["host"] == [expected] and by_host["x-forwarded-host"] == [own_host]
        info = httpx.get(
            f"{deployment.url}/sandboxes/{sandbox.sandbox_id}", headers={"X-API-Key": deployment.api_key}
        ).json()
        assert info["network"]["maskRequestHost"] == mask
    finally:
        sandbox.kill()


def test_without_mask_the_port_sees_the_clients_host(deployment: Deployment) -> None:
    sandbox = Sandbox.create(timeout=120)
    try:
        serve_headers(sandbox, deployment, None)
        own_host = f"{PORT}-{sandbox.sandbox_id}.aenv.test"
        seen = seen_headers(httpx.get(f"{deployment.url}/", headers={"Host": own_host}))
        assert seen["host"] == [own_host] and "x-forwarded-host" not in seen
    finally:
        sandbox.kill()


BAD_NETWORKS = [
    ({"maskRequestHost": "a.example.com\r\nX-Evil: 1"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a.example.com\nX-Evil: 1"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a.example.com X"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a.example.com:${PORT}\x00"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a." * 200 + "com"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a.example.com:123456"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "a.example.com:${HOST}"}, 400, "mask request host is not valid"),
    ({"maskRequestHost": "bücher.example"}, 400, "is not ASCII. Please use ASCII characters only."),
    ({"maskRequestHost": 7}, 400, "network.maskRequestHost must be a string"),
    ({"allowPublicTraffic": "false"}, 400, "network.allowPublicTraffic must be a boolean"),
    ({"allowPublicTraffic": 0}, 400, "network.allowPublicTraffic must be a boolean"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"X-Token": "${e2b.secrets.x"}}}]}}, 400, "unterminated"),
    ({"rules": {"api.example.com": [{"transform": {"headers": {"X": "${e2b.identity.tokens.a}"}}}]}}, 400, "identity"),
    ({"rules": ["api.example.com"]}, 400, "network.rules must be an object"),
    ({"egressProxy": {"address": "proxy.example.com:1080"}}, 403, "Egress proxy (network.egressProxy) is not enabled"),
]


@pytest.mark.parametrize(("network", "status", "message"), BAD_NETWORKS)
def test_bad_network_options_are_refused(api: httpx.Client, network: dict, status: int, message: str) -> None:
    before = {s["sandboxID"] for s in api.get("/v2/sandboxes").json()}
    r = api.post("/v2/sandboxes", json={"templateID": "base", "network": network})
    assert r.status_code == status and r.json()["code"] == status, r.text
    assert message in r.json()["message"]
    assert "\n" not in r.json()["message"] and "\r" not in r.json()["message"]
    assert {s["sandboxID"] for s in api.get("/v2/sandboxes").json()} <= before


def test_private_ports_need_a_secure_sandbox(api: httpx.Client) -> None:
    r = api.post(
        "/v2/sandboxes", json={"templateID": "base", "secure": False, "network": {"allowPublicTraffic": False}}
    )
    assert r.status_code == 400
    assert r.json()["message"] == (
        "You cannot create a sandbox without public access unless you enable secure envd access via 'secure' flag."
    )


def test_network_update_refuses_what_aenv_lacks(sandbox: Sandbox, api: httpx.Client) -> None:
    path = f"/sandboxes/{sandbox.sandbox_id}/network"
    r = api.put(path, json={"egressProxy": {"address": "proxy.example.com:1080"}})
    assert r.status_code == 403 and r.json()["message"] == "Egress proxy (egressProxy) is not enabled for this team."
    r = api.put(path, json={"rules": {"API.example.com": []}})
    assert r.status_code == 400 and "not a lower-case domain" in r.json()["message"]
    rules = {"api.example.com": [{"transform": {"headers": {"Authorization": "Bearer ${e2b.secrets.TOKEN}"}}}]}
    assert api.put(path, json={"rules": rules}).status_code == 204
    assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["network"]["rules"] == rules
    for body in ({"allowPublicTraffic": False}, {"maskRequestHost": "x.example.com"}):
        assert api.put(path, json=body).status_code == 400
    assert api.put(path, json={"allowOut": ["1.1.1.1"]}).status_code == 204
