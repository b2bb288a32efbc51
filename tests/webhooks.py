"""A webhook receiver on the host for the tests of lifecycle events (tests/api, tests/cluster)."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Delivery:
    headers: dict[str, str]
    raw: bytes

    @property
    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.raw)
        return body


@dataclass
class Receiver:
    """A webhook receiver on the host: keeps every request; fails the first ``fail`` of them."""

    fail: int = 0
    status: int = 500
    got: list[Delivery] = field(default_factory=list)
    url: str = ""

    def of(self, sandbox_id: str) -> list[dict[str, Any]]:
        ok = [d.body for d in self.got if d.headers.get("x-answered") == "200"]
        return [b for b in ok if b["sandbox_id"] == sandbox_id]

    def wait(self, sandbox_id: str, count: int, timeout: float = 60) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if len(self.of(sandbox_id)) >= count:
                return self.of(sandbox_id)
            time.sleep(0.1)
        raise AssertionError(f"{len(self.of(sandbox_id))} of {count} deliveries for {sandbox_id}: {self.got}")


@contextmanager
def receiving() -> Iterator[Receiver]:
    """A receiver on 127.0.0.1 while the block runs."""
    state = Receiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            raw = self.rfile.read(int(self.headers.get("content-length", 0)))
            status = state.status if state.fail > 0 else 200
            state.fail -= 1
            headers = {k.lower(): v for k, v in self.headers.items()} | {"x-answered": str(status)}
            state.got.append(Delivery(headers, raw))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    state.url = f"http://127.0.0.1:{httpd.server_address[1]}/hook"
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield state
    finally:
        httpd.shutdown()


def e2b_signature(secret: str, raw: bytes) -> str:
    """As E2B's documentation verifies one."""
    digest = hashlib.sha256(secret.encode() + raw).digest()
    return base64.b64encode(digest).decode().replace("+", "-").replace("/", "_").rstrip("=")
