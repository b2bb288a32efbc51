"""The E2B Python SDK configured by E2B_DOMAIN and E2B_API_KEY alone (run by test_domain.py in a
namespace where the domain resolves to the gateway). Prints one JSON line of observations."""

from __future__ import annotations

import json
import os
import ssl
import time

import httpx
from e2b import Sandbox, SandboxQuery

# An HTTP server in the sandbox: answers with the path and the Host it was asked for.
PORT_SERVER = """
import http.server, json
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"path": self.path, "host": self.headers["host"]}).encode()
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
http.server.ThreadingHTTPServer(("0.0.0.0", 8000), H).serve_forever()
"""


def main() -> None:
    seen: dict[str, object] = {}
    sbx = Sandbox.create(timeout=120, metadata={"suite": "domain"})
    try:
        seen["sandboxId"] = sbx.sandbox_id
        run = sbx.commands.run("echo hello; echo oops >&2")
        seen["stdout"], seen["stderr"] = run.stdout, run.stderr
        payload = os.urandom(300_000)
        sbx.files.write("/home/user/blob.bin", payload)
        seen["fileRoundTrip"] = sbx.files.read("/home/user/blob.bin", format="bytes") == payload
        sbx.files.write("/home/user/server.py", PORT_SERVER)
        sbx.commands.run("python3 /home/user/server.py", background=True)
        host = sbx.get_host(8000)
        seen["host"] = host
        trust = ssl.create_default_context(cafile=os.environ["SSL_CERT_FILE"])
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(f"https://{host}/hello?q=1", verify=trust, timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        seen["port"] = [r.status_code, r.json() if r.status_code == 200 else r.text]
        seen["infoDomain"] = Sandbox.get_info(sbx.sandbox_id).sandbox_domain
        seen["listed"] = [
            s.sandbox_id for s in Sandbox.list(query=SandboxQuery(metadata={"suite": "domain"})).next_items()
        ]
        seen["connected"] = Sandbox.connect(sbx.sandbox_id).commands.run("echo again").stdout
    finally:
        seen["killed"] = sbx.kill()
    seen["runningAfterKill"] = sbx.is_running()
    print(json.dumps(seen))


if __name__ == "__main__":
    main()
