"""The sandbox port proxy (E2B get_host): HTTP to a server inside a real sandbox."""

from __future__ import annotations

import time

import httpx
import pytest
from e2b import Sandbox

from tests.conftest import Server, modern_runsc

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

ECHO_SERVER = """
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers['Content-Length']))
        out = json.dumps({"path": self.path, "body": body.decode(), "host": self.headers['Host']}).encode()
        self.send_response(201); self.send_header('Content-Type', 'application/json')
        self.send_header('Content-Length', str(len(out))); self.end_headers(); self.wfile.write(out)
    do_PUT = do_POST
http.server.ThreadingHTTPServer(('127.0.0.1', 8081), H).serve_forever()
"""


def wait_for_port(url: str, headers: dict[str, str]) -> None:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        r = httpx.get(url, headers=headers)
        if r.status_code != 502:
            return
        time.sleep(0.2)
    raise AssertionError("the server inside the sandbox did not come up")


def test_http_to_a_port_inside_the_sandbox(sandbox: Sandbox, server: Server) -> None:
    sandbox.files.write("/home/user/site/hello.txt", "hello from inside")
    sandbox.commands.run("nohup python3 -m http.server 8000 --directory /home/user/site >/dev/null 2>&1 &")
    sandbox.files.write("/home/user/echo.py", ECHO_SERVER)
    sandbox.commands.run("nohup python3 /home/user/echo.py >/dev/null 2>&1 &")
    by_header = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8000"}
    wait_for_port(f"{server.url}/hello.txt", by_header)
    r = httpx.get(f"{server.url}/hello.txt", headers=by_header)
    assert (r.status_code, r.text) == (200, "hello from inside")
    # routing by host name, as get_host() hands it out
    host = sandbox.get_host(8000).split(".")[0] + ".localhost"
    r = httpx.get(f"{server.url}/hello.txt", headers={"Host": host})
    assert (r.status_code, r.text) == (200, "hello from inside")
    wait_for_port(f"{server.url}/", {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8081"})
    r = httpx.post(
        f"{server.url}/submit?x=1",
        content=b"payload",
        headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8081"},
    )
    assert r.status_code == 201 and r.json()["body"] == "payload" and r.json()["path"] == "/submit?x=1"


def test_proxy_errors_as_e2b_reports_them(sandbox: Sandbox, server: Server) -> None:
    r = httpx.get(f"{server.url}/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "9"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]
    r = httpx.get(f"{server.url}/", headers={"E2b-Sandbox-Id": "nosuchsandbox", "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    r = httpx.get(f"{server.url}/", headers={"E2b-Sandbox-Id": sandbox.sandbox_id})
    assert r.status_code == 400


ASYNCIO_SERVER = """
import asyncio
async def handle(reader, writer):
    await reader.readuntil(b"\\r\\n\\r\\n")
    writer.write(b"HTTP/1.1 200 OK\\r\\nContent-Length: 5\\r\\nConnection: close\\r\\n\\r\\nasync")
    await writer.drain(); writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", 8082)
    await server.serve_forever()
asyncio.run(main())
"""


SLOW_SERVER = """
import http.server, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header('Content-Length', str(200_000)); self.end_headers()
        self.wfile.write(b'a' * 100_000); self.wfile.flush()
        time.sleep(1.5)  # the pause comes meanwhile
        self.wfile.write(b'b' * 100_000)
http.server.ThreadingHTTPServer(('127.0.0.1', 8083), H).serve_forever()
"""


@pytest.mark.parametrize("memory", [True, False], ids=["pause", "filesystem-only"])
def test_a_pause_lets_a_proxied_request_in_flight_finish(
    sandbox: Sandbox, server: Server, api: httpx.Client, memory: bool
) -> None:
    """The answer a port is sending when a pause comes is passed on whole (it was cut short,
    shorter than its Content-Length), and the pause then happens."""
    import threading

    sandbox.files.write("/home/user/slow.py", SLOW_SERVER)
    sandbox.commands.run("python3 /home/user/slow.py", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8083"}
    wait_for_port(f"{server.url}/nothing", routed)
    got: list[bytes] = []
    started = threading.Event()

    def fetch() -> None:
        with httpx.stream("GET", f"{server.url}/slow", headers=routed, timeout=30) as r:
            assert r.status_code == 200
            body = b""
            for chunk in r.iter_bytes():
                body += chunk
                started.set()
            got.append(body)

    reader = threading.Thread(target=fetch)
    reader.start()
    assert started.wait(15)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/pause", json={} if memory else {"memory": False})
    reader.join(30)
    assert r.status_code == 204, r.text
    assert got and got[0] == b"a" * 100_000 + b"b" * 100_000
    assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"


def test_a_pause_lets_a_file_download_in_flight_finish(sandbox: Sandbox, api: httpx.Client) -> None:
    """A file the E2B SDK is downloading when a pause comes arrives whole, then the pause happens.
    Seen failing before envd's requests counted as exchanges: the download was reset ("killed or
    reached its end of life"), as an SDK client saw in a drain's move."""
    import hashlib
    import threading

    sandbox.commands.run("head -c 6000000 /dev/urandom > /home/user/big")
    want = sandbox.commands.run("sha256sum /home/user/big").stdout.split()[0]
    got: list[str] = []
    started = threading.Event()

    def download() -> None:
        digest, size = hashlib.sha256(), 0
        for chunk in sandbox.files.read("/home/user/big", format="stream"):
            digest.update(chunk)
            size += len(chunk)
            started.set()
            time.sleep(0.002)  # a slow reader: the pause comes while the file is on its way
        got.append(f"{digest.hexdigest()} {size}")

    reader = threading.Thread(target=download)
    reader.start()
    assert started.wait(15)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/pause")
    reader.join(30)
    assert r.status_code == 204, r.text
    assert got == [f"{want} 6000000"]
    assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"


@pytest.mark.runsc  # its server keeps running through pause
def test_traffic_that_meets_a_pause_wakes_the_sandbox_again(e2b_env: Server, api: httpx.Client) -> None:
    """Requests to the port of a sandbox with auto-resume (and calls of its envd), sent while it
    is being paused, one round after another: each is answered, never with a 502. One that came first is
    waited for by the pause; one that came while it was pausing waited for it and woke it."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    lifecycle = {"onTimeout": "pause", "autoResume": True}
    r = api.post("/sandboxes", json={"templateID": "base", "timeout": 300, "lifecycle": lifecycle})
    assert r.status_code == 201, r.text
    sandbox_id = r.json()["sandboxID"]
    try:
        sbx = Sandbox.connect(sandbox_id)
        sbx.files.write("/home/user/site/hello.txt", "awake")
        sbx.commands.run("python3 -m http.server 8000 --directory /home/user/site", background=True)
        routed = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": "8000"}
        wait_for_port(f"{e2b_env.url}/hello.txt", routed)
        answers: list[tuple[int, str]] = []

        def pause(pausing: threading.Event) -> int:
            pausing.set()
            return api.post(f"/sandboxes/{sandbox_id}/pause").status_code

        def fetch(pausing: threading.Event, delay: float, envd: bool) -> None:
            pausing.wait(10)
            time.sleep(delay)
            if envd:  # the sandbox's own API (E2B's envd) wakes it the same way
                answers.append((200, sbx.files.read("/home/user/site/hello.txt")))
                return
            got = httpx.get(f"{e2b_env.url}/hello.txt", headers=routed, timeout=60)
            answers.append((got.status_code, got.text[:200]))

        for _ in range(3):
            pausing = threading.Event()
            with ThreadPoolExecutor(8) as pool:
                paused = pool.submit(pause, pausing)
                for f in [pool.submit(fetch, pausing, 0.03 * i, i % 3 == 2) for i in range(7)]:
                    f.result()
                assert paused.result() in (204, 409), "the pause was neither done nor found done"
        assert answers and all(a == (200, "awake") for a in answers), answers
    finally:
        api.delete(f"/sandboxes/{sandbox_id}")


@pytest.mark.runsc  # its server keeps running through pause
def test_pause_with_a_proxied_connection_open(sandbox: Sandbox, server: Server) -> None:
    from websockets.sync.client import connect as ws_connect

    from tests.compat.servers import WEBSOCKET_SERVER

    sandbox.files.write("/home/user/ws.py", WEBSOCKET_SERVER)
    sandbox.commands.run("python3 /home/user/ws.py 8765", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8765"}
    wait_for_port(f"{server.url}/", routed)
    url = server.url.replace("http", "ws", 1) + "/"
    with ws_connect(url, additional_headers=routed) as ws:
        ws.send("before")
        assert ws.recv() == "before"
        # The agent's end of this connection is a plain blocking socket, so the checkpoint
        # takes it; the connection itself ends with the instance it belonged to.
        assert sandbox.pause() is True
    again = Sandbox.connect(sandbox.sandbox_id)
    with ws_connect(url, additional_headers=routed) as ws:
        ws.send("after")
        assert ws.recv() == "after"
    assert again.get_info().state.value == "running"


@pytest.mark.runsc  # runsc's checkpoint of sockets
def test_pausing_an_epoll_server(sandbox: Sandbox, server: Server, api: httpx.Client) -> None:
    """runsc 20221219 cannot checkpoint a TCP socket held in an epoll set (a failed save stops the
    sandbox), so on it the pause fails with a clear error and leaves the sandbox serving; the runsc
    a node is made for saves it: the pause succeeds and the server serves again after the resume."""
    sandbox.files.write("/home/user/aserver.py", ASYNCIO_SERVER)
    sandbox.commands.run("python3 /home/user/aserver.py", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8082"}
    wait_for_port(f"{server.url}/", routed)
    r = api.post(f"/sandboxes/{sandbox.sandbox_id}/pause")
    if not modern_runsc(api):
        assert r.status_code == 422 and "epoll" in r.json()["message"], r.text
        assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "running"
    else:
        assert r.status_code == 204, r.text
        assert api.get(f"/sandboxes/{sandbox.sandbox_id}").json()["state"] == "paused"
        Sandbox.connect(sandbox.sandbox_id)
    assert httpx.get(f"{server.url}/", headers=routed).text == "async"
    assert sandbox.commands.run("echo alive").stdout == "alive\n"


# Answers each request with its head as the port received it, and a Date and a Server of its own.
RAW_HEAD_SERVER = """
import socket, threading
def serve(conn):
    head = b""
    while b"\\r\\n\\r\\n" not in head:
        chunk = conn.recv(65536)
        if not chunk:
            break
        head += chunk
    conn.sendall(b"HTTP/1.1 200 OK\\r\\nDate: Thu, 01 Jan 1970 00:00:00 GMT\\r\\nServer: raw-head\\r\\n"
                 + b"Content-Length: %d\\r\\nConnection: close\\r\\n\\r\\n" % len(head) + head)
    conn.close()
listener = socket.create_server(("127.0.0.1", 8084))
while True:
    threading.Thread(target=serve, args=(listener.accept()[0],)).start()
"""


def raw_request(server: Server, head: bytes) -> tuple[list[str], bytes]:
    """``head`` sent as is on a socket: the answer's header lines as they came, and its body."""
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as conn:
        conn.sendall(head)
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    head_part, _, body = raw.partition(b"\r\n\r\n")
    return head_part.decode("latin-1").split("\r\n"), body


def serve_raw_heads(sandbox: Sandbox, server: Server) -> dict[str, str]:
    sandbox.files.write("/home/user/rawhead.py", RAW_HEAD_SERVER)
    sandbox.commands.run("python3 /home/user/rawhead.py", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8084"}
    wait_for_port(f"{server.url}/", routed)
    return routed


def test_a_port_sees_header_names_as_the_client_sent_them(sandbox: Sandbox, server: Server) -> None:
    """uvicorn lowercases header names; the port proxy passes on those the client wrote (a port's
    server that reads the raw request, as E2B's SDK tests do with netcat, sees `Host:`)."""
    serve_raw_heads(sandbox, server)
    routing = f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\nE2b-Sandbox-Port: 8084\r\n"
    head = f"POST /raw HTTP/1.1\r\nHost: example.test\r\n{routing}X-MiXeD-Case: a\r\nx-lower: b\r\n"
    _, body = raw_request(server, (head + "Content-Length: 2\r\nConnection: close\r\n\r\nhi").encode())
    seen = body.decode().split("\r\n")
    assert seen[0] == "POST /raw HTTP/1.1"
    for line in ("Host: example.test", "X-MiXeD-Case: a", "x-lower: b", "Content-Length: 2"):
        assert line in seen, seen
    # and the E2B SDK's own request, by host name (httpx writes Host, Accept, User-Agent so)
    host = sandbox.get_host(8084).split(".")[0] + ".localhost"
    echoed = httpx.get(f"{server.url}/sdk", headers={"Host": host, "X-Custom": "1"}).text.split("\r\n")
    assert f"Host: {host}" in echoed and "X-Custom: 1" in echoed and "User-Agent" in "\n".join(echoed), echoed


def test_a_masked_host_is_written_as_e2b_writes_it(e2b_env: Server) -> None:
    """E2B's maskRequestHost test reads the raw request with netcat and looks for `Host:`."""
    from e2b import SandboxNetworkOpts

    masked = Sandbox.create(
        timeout=120, network=SandboxNetworkOpts(mask_request_host="custom-host.example.com:${PORT}")
    )
    try:
        routed = serve_raw_heads(masked, e2b_env)
        seen = httpx.get(f"{e2b_env.url}/", headers=routed).text.split("\r\n")
        assert "Host: custom-host.example.com:8084" in seen, seen
        assert f"X-Forwarded-Host: {httpx.URL(e2b_env.url).netloc.decode()}" in seen, seen
    finally:
        masked.kill()


def test_a_ports_answer_has_one_date_and_one_server(sandbox: Sandbox, server: Server) -> None:
    """The port's own Date and Server, once each (uvicorn added its own before them: two of each)."""
    serve_raw_heads(sandbox, server)
    routing = f"E2b-Sandbox-Id: {sandbox.sandbox_id}\r\nE2b-Sandbox-Port: 8084\r\n"
    lines, _ = raw_request(server, f"GET / HTTP/1.1\r\nHost: x\r\n{routing}Connection: close\r\n\r\n".encode())
    assert lines[0] == "HTTP/1.1 200 OK"
    dates = [line for line in lines if line.lower().startswith("date:")]
    servers = [line for line in lines if line.lower().startswith("server:")]
    assert dates == ["date: Thu, 01 Jan 1970 00:00:00 GMT"] and servers == ["server: raw-head"], lines
    # the node's own answers, errors among them, have one of each too
    for path in ("/health", "/sandboxes", "/no/such/route"):
        lines, _ = raw_request(server, f"GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
        assert sum(line.lower().startswith("date:") for line in lines) == 1, lines
        assert sum(line.lower().startswith("server:") for line in lines) == 1, lines


GREETING_SERVER = """
import base64, hashlib, socket, sys
GUID = b'258EAFA5-E914-47DA-95CA-C5AB0DC85B11'
listener = socket.socket(); listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
listener.bind(('127.0.0.1', int(sys.argv[1]))); listener.listen(8)
while True:
    conn, _ = listener.accept()
    head = b''
    while b'\\r\\n\\r\\n' not in head:
        chunk = conn.recv(4096)
        if not chunk:
            break
        head += chunk
    lines = head.split(b'\\r\\n')
    key = next((x.split(b':', 1)[1].strip() for x in lines if x.lower().startswith(b'sec-websocket-key:')), None)
    if key is None:  # a plain HTTP probe
        conn.sendall(b'HTTP/1.1 200 OK\\r\\nContent-Length: 2\\r\\nConnection: close\\r\\n\\r\\nok')
        conn.close()
        continue
    accept = base64.b64encode(hashlib.sha1(key + GUID).digest())
    upgrade = b'HTTP/1.1 101 Switching Protocols\\r\\nUpgrade: websocket\\r\\nConnection: Upgrade\\r\\n'
    upgrade += b'Sec-WebSocket-Accept: ' + accept + b'\\r\\n\\r\\n'
    conn.sendall(upgrade + b'\\x81\\x05hello' + b'\\x81\\x05again')  # the greeting in the 101's own write
"""


def test_a_greeting_sent_with_the_upgrade_reaches_the_client(sandbox: Sandbox, server: Server) -> None:
    """A port that writes its first messages in the same packet as its 101: the proxy's handshake
    read took the 101 and dropped what came with it (seen failing before the fix)."""
    from websockets.sync.client import connect as ws_connect

    sandbox.files.write("/home/user/greet.py", GREETING_SERVER)
    sandbox.commands.run("python3 /home/user/greet.py 8766", background=True)
    routed = {"E2b-Sandbox-Id": sandbox.sandbox_id, "E2b-Sandbox-Port": "8766"}
    wait_for_port(f"{server.url}/", routed)
    with ws_connect(server.url.replace("http", "ws", 1) + "/", additional_headers=routed) as ws:
        assert ws.recv(timeout=10) == "hello"
        assert ws.recv(timeout=10) == "again"
