"""`aenv fusion` (the SandboxFusion service, aenv/integrations/fusion.py) against clients that send
what they like: it has no key, so whoever reaches its port may. Each attack runs against the service
started as users start it (`aenv fusion --port P`, a process of its own on the suite's node) and
its memory is read from outside (/proc/<pid>/status), as the probe that found these read it.

Seen failing before the bounds, on a fresh service: 1M header lines were refused but left the
process 123-218 MiB larger; 24 concurrent 20 MiB bodies grew it by 1.7-1.9 GiB (every body
buffered while it waited); fetch_files of a 400 MiB file answered all of it (+533 MiB); `yes` for
20 s was buffered whole (+491 MiB) and then answered as a timeout without any output; a cell's
300 MiB of output was answered whole; a declared 33 MiB body and a body that stopped were waited
for without end; a runaway cell that took the sandbox's memory ended in a bare 500;
memory_limit_MB was accepted and ignored (256 MiB allocated under 128 MB); an unknown route was
FastAPI's `{"detail": ...}`; and no request was ever refused for being one too many.
"""

from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import SLOW_CLIENT_DEADLINES, Server, free_port

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

MIB = 1 << 20
MAX_OUTPUT = 1 << 20  # bytes kept of each of a command's streams (aenv.integrations.fusion.MAX_OUTPUT)
MAX_CELLS_TEXT = 1 << 20  # characters of cell output kept, all cells together
MAX_FETCH_FILE = 8 << 20
MAX_FETCH_BYTES = 16 << 20
MAX_BODY = 32 << 20
MAX_HEADERS = 256  # AENV_HTTP_MAX_HEADERS's default
BODY_TIMEOUT = float(SLOW_CLIENT_DEADLINES["AENV_HTTP_BODY_TIMEOUT"])
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Fusion:
    url: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    def rss(self) -> float:
        """The service's resident memory now, in MiB."""
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS")

    def settled_rss(self) -> float:
        """Its resident memory once a moment has passed with nothing running (the smallest of a few)."""
        return min(self._sampled(0.1) for _ in range(5))

    def _sampled(self, pause: float) -> float:
        time.sleep(pause)
        return self.rss()

    def post(self, path: str, body: dict[str, Any], timeout: float = 120) -> httpx.Response:
        return httpx.post(f"{self.url}{path}", json=body, timeout=timeout)


def start_fusion(server: Server, log: Path, *args: str) -> Fusion:
    """`aenv fusion` on a free port for ``server``, ready once it answers its ping."""
    port = free_port()
    env = {**os.environ, "AENV_URL": server.url, "AENV_API_KEY": server.env["AENV_API_KEY"], **SLOW_CLIENT_DEADLINES}
    argv = [sys.executable, "-m", "aenv.cli.main", "fusion", "--port", str(port), *args]
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"aenv fusion exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/v1/ping", timeout=2).json() == "pong":
                return Fusion(url, port, proc, log)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise AssertionError(f"aenv fusion did not answer:\n{log.read_text()[-3000:]}")


def stop(fusion: Fusion) -> None:
    fusion.proc.terminate()
    try:
        fusion.proc.wait(15)
    except subprocess.TimeoutExpired:
        fusion.proc.kill()
        fusion.proc.wait()


@pytest.fixture(scope="module")
def fusion(server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fusion]:
    service = start_fusion(server, tmp_path_factory.mktemp("fusion") / "fusion.log", "--concurrency", "4")
    yield service
    stop(service)


class Peak:
    """The service's highest resident memory while the block runs (sampled every 20 ms)."""

    def __init__(self, fusion: Fusion) -> None:
        self.fusion = fusion
        self.highest = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while not self._done.is_set():
            self.highest = max(self.highest, self.fusion.rss())
            self._done.wait(0.02)

    def __enter__(self) -> Peak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.highest = max(self.highest, self.fusion.rss())


def all_at_once(count: int, call: Callable[[], Any]) -> list[Any]:
    """``call`` from ``count`` threads at once; what each returned (or raised)."""
    results: list[Any] = [None] * count
    start = threading.Barrier(count)

    def one(i: int) -> None:
        start.wait()
        try:
            results[i] = call()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=one, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    return results


def raw_request(fusion: Fusion, head: bytes, body: bytes = b"", wait: float = 30) -> bytes:
    """Send ``head`` and ``body`` as they are and read the answer until the service closes or ``wait`` passes."""
    with socket.create_connection(("127.0.0.1", fusion.port), timeout=wait) as conn:
        try:
            conn.sendall(head + body)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return read_answer(conn, wait)


def read_answer(conn: socket.socket, wait: float) -> bytes:
    """What comes until one whole answer (by its Content-Length) is in, the peer closes, or ``wait`` passes."""
    got = b""
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        conn.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = conn.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            break
        if not chunk:
            break
        got += chunk
        head, sep, rest = got.partition(b"\r\n\r\n")
        for line in head.split(b"\r\n")[1:] if sep else []:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length" and len(rest) >= int(value):
                return got
    return got


def status_and_json(answer: bytes) -> tuple[int, Any]:
    assert answer.startswith(b"HTTP/1.1 "), answer[:200]
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


# -- the HTTP layer --------------------------------------------------------------------------------
def test_a_million_header_lines_are_refused_at_the_bound_without_growing(fusion: Fusion) -> None:
    before = fusion.settled_rss()
    with socket.create_connection(("127.0.0.1", fusion.port), timeout=30) as conn:
        conn.sendall(b"POST /run_code HTTP/1.1\r\nHost: fusion\r\n")
        try:
            for block in range(1000):  # 1M header lines, as the probe sent them
                conn.sendall(b"".join(b"X-%d: a\r\n" % (block * 1000 + i) for i in range(1000)))
            conn.sendall(b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused and closed while they arrived
        answer = read_answer(conn, 30)
    status, body = status_and_json(answer)
    assert status == 431 and body["code"] == 431 and str(MAX_HEADERS) in body["message"]
    grown = fusion.settled_rss() - before
    assert grown < 30, f"1M header lines left the service {grown:.0f} MiB larger"
    assert httpx.get(f"{fusion.url}/v1/ping", timeout=10).json() == "pong"


def test_unknown_routes_and_methods_are_json(fusion: Fusion) -> None:
    missing = httpx.post(f"{fusion.url}/run_cobol", json={}, timeout=10)
    assert missing.status_code == 404 and missing.json()["code"] == 404 and "/run_code" in missing.json()["message"]
    wrong = httpx.get(f"{fusion.url}/run_code", timeout=10)
    assert wrong.status_code == 405 and wrong.json() == {"code": 405, "message": "/run_code takes POST"}
    assert wrong.headers["allow"] == "POST"
    bad_length = raw_request(
        fusion, b"POST /run_code HTTP/1.1\r\nHost: f\r\nContent-Length: 12\r\n\r\n", b"{not json!!}"
    )
    status, body = status_and_json(bad_length)
    assert status == 400 and body["code"] == 400 and "invalid request" in body["message"]


# -- bodies ----------------------------------------------------------------------------------------
def test_a_declared_body_past_the_bound_is_refused_before_it_is_sent(fusion: Fusion) -> None:
    started = time.monotonic()
    head = b"POST /run_code HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    answer = raw_request(fusion, head % (MAX_BODY + 1), b'{"code": "', wait=20)
    status, body = status_and_json(answer)
    assert status == 413 and body == {"code": 413, "message": "the body is larger than 32 MiB"}
    assert time.monotonic() - started < 10  # without waiting for the 32 MiB it declared
    # a chunked body (no length said) is refused the moment it passes the bound
    jupyter = httpx.post(f"{fusion.url}/run_jupyter", content=iter([b"x" * MIB] * 40), timeout=60)
    assert jupyter.status_code == 413 and jupyter.json()["code"] == 413


def test_a_body_that_stops_is_a_408_within_the_body_deadline(fusion: Fusion) -> None:
    started = time.monotonic()
    head = b"POST /run_jupyter HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    answer = raw_request(fusion, head, b'{"cells": ["1', wait=BODY_TIMEOUT + 20)
    status, body = status_and_json(answer)
    assert status == 408 and body["code"] == 408 and f"{BODY_TIMEOUT:g} s" in body["message"]
    assert BODY_TIMEOUT - 1 < time.monotonic() - started < BODY_TIMEOUT + 10


def test_concurrent_large_bodies_are_held_within_a_bound(fusion: Fusion) -> None:
    """24 bodies of 20 MiB at once (a 15 MiB file each): every one runs with its file whole, and
    the bodies waiting their turn are not held in the service's memory meanwhile."""
    blob = os.urandom(15 * MIB)
    code = "import hashlib; print(hashlib.sha256(open('blob.bin', 'rb').read()).hexdigest())"
    body = json.dumps({"code": code, "files": {"blob.bin": base64.b64encode(blob).decode()}}).encode()
    assert len(body) > 20 * MIB
    before = fusion.settled_rss()
    with Peak(fusion) as peak:
        answers = all_at_once(
            24, lambda: httpx.post(f"{fusion.url}/run_code", content=body, timeout=httpx.Timeout(600, connect=30))
        )
    import hashlib

    digest = hashlib.sha256(blob).hexdigest() + "\n"
    for answer in answers:
        assert isinstance(answer, httpx.Response), answer
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["status"] == "Success" and answer.json()["run_result"]["stdout"] == digest
    grown = peak.highest - before
    assert grown < 200, f"24 concurrent 20 MiB bodies grew the service by {grown:.0f} MiB at their peak"
    assert fusion.settled_rss() - before < 60


def test_concurrent_large_jupyter_bodies_are_held_within_a_bound(fusion: Fusion) -> None:
    cells = ["x = 6", "# " + "c" * (MIB - 4), "x * 7"] + ["# " + "d" * (MIB - 4)] * 17
    body = json.dumps({"cells": cells, "total_timeout": 120}).encode()
    assert len(body) > 18 * MIB
    before = fusion.settled_rss()
    with Peak(fusion) as peak:
        answers = all_at_once(
            12, lambda: httpx.post(f"{fusion.url}/run_jupyter", content=body, timeout=httpx.Timeout(600, connect=30))
        )
    for answer in answers:
        assert isinstance(answer, httpx.Response), answer
        result = answer.json()
        assert result["status"] == "Success", str(result)[:500]
        assert len(result["cells"]) == 20 and result["cells"][2]["display"] == [{"text/plain": "42"}]
    grown = peak.highest - before
    assert grown < 200, f"12 concurrent 19 MiB jupyter bodies grew the service by {grown:.0f} MiB at their peak"
    # a cell past 1 MiB is a 400, and 256 cells of 1 MiB a 413 before they are read
    big = httpx.post(f"{fusion.url}/run_jupyter", json={"cells": ["#" * (MIB + 1)]}, timeout=60)
    assert big.status_code == 400 and big.json()["code"] == 400
    head = b"POST /run_jupyter HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    status, refused = status_and_json(raw_request(fusion, head % (256 * MIB), b'{"cells": [', wait=20))
    assert status == 413 and refused["code"] == 413


# -- output, files, memory -------------------------------------------------------------------------
@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_runaway_output_is_cut_while_it_runs(fusion: Fusion, stream: str) -> None:
    redirect = "" if stream == "stdout" else " >&2"
    before = fusion.settled_rss()
    started = time.monotonic()
    with Peak(fusion) as peak:
        r = fusion.post("/run_code", {"code": f"yes{redirect}", "language": "bash", "run_timeout": 20})
    assert r.status_code == 200
    result = r.json()
    assert result["status"] == "Failed" and f"output cut at {MAX_OUTPUT} bytes" in result["message"]
    run = result["run_result"]
    assert run["status"] == "Finished" and run["return_code"] != 0  # stopped, not left to its timeout
    assert run[stream] == "y\n" * (MAX_OUTPUT // 2)  # what it wrote, up to the cut
    assert time.monotonic() - started < 15  # stopped at the cut, not at its 20 s timeout
    grown = peak.highest - before
    assert grown < 60, f"a runaway {stream} grew the service by {grown:.0f} MiB"


def test_concurrent_runaway_outputs_stay_within_a_bound(fusion: Fusion) -> None:
    code = "import sys\nwhile True:\n    sys.stdout.write('o' * 65536)\n    sys.stderr.write('e' * 65536)"
    before = fusion.settled_rss()
    with Peak(fusion) as peak:
        answers = all_at_once(8, lambda: fusion.post("/run_code", {"code": code, "run_timeout": 30}).json())
    for result in answers:
        assert isinstance(result, dict) and result["status"] == "Failed", result
        run = result["run_result"]
        assert len(run["stdout"]) <= MAX_OUTPUT and len(run["stderr"]) <= MAX_OUTPUT
        assert len(run["stdout"]) == MAX_OUTPUT or len(run["stderr"]) == MAX_OUTPUT
        assert set(run["stdout"]) <= {"o"} and set(run["stderr"]) <= {"e"}
    grown = peak.highest - before
    assert grown < 100, f"8 runaway programs grew the service by {grown:.0f} MiB"


def test_a_cells_runaway_output_is_cut(fusion: Fusion) -> None:
    before = fusion.settled_rss()
    with Peak(fusion) as peak:
        r = fusion.post("/run_jupyter", {"cells": ["print('x' * (300 << 20))", "print('after')"], "total_timeout": 60})
    result = r.json()
    assert r.status_code == 200 and result["status"] == "Failed"
    assert f"cell output cut at {MAX_CELLS_TEXT} characters" in result["message"]
    assert result["cells"][0]["stdout"] == "x" * MAX_CELLS_TEXT and result["cells"][1]["stdout"] == ""  # room all used
    assert peak.highest - before < 60, f"a cell's 300 MiB of output grew the service by {peak.highest - before:.0f} MiB"


def test_a_runaway_cell_is_a_timeout_status(fusion: Fusion) -> None:
    started = time.monotonic()
    cells = ["x = 1", "while True:\n    print('x' * 1000)"]
    r = fusion.post("/run_jupyter", {"cells": cells, "total_timeout": 8})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    result = r.json()
    assert result["status"] == "Failed" and result["driver"]["status"] == "TimeLimitExceeded"
    assert "total_timeout (8 s)" in result["message"]
    assert result["cells"][0] == {"stdout": "", "stderr": "", "display": [], "error": []}  # the cell before it
    assert time.monotonic() - started < 30


def test_fetched_files_are_capped(fusion: Fusion) -> None:
    code = (
        "open('big', 'wb').truncate(400 << 20)\n"  # 400 MiB (sparse: the sandbox's disk is not filled)
        "open('small.txt', 'w').write('kept')\n"
        "for i in range(3):\n"
        "    open(f'part{i}', 'wb').write(bytes([65 + i]) * (7 << 20))\n"
    )
    fetch = ["big", "small.txt", "part0", "part1", "part2"]
    before = fusion.settled_rss()
    started = time.monotonic()
    with Peak(fusion) as peak:
        r = fusion.post("/run_code", {"code": code, "fetch_files": fetch, "run_timeout": 60})
    result = r.json()
    assert r.status_code == 200 and result["status"] == "Failed", str(result)[:500]
    assert result["run_result"]["status"] == "Finished" and result["run_result"]["return_code"] == 0
    assert f"'big' is larger than {MAX_FETCH_FILE} bytes" in result["message"]
    assert f"'part2' passes {MAX_FETCH_BYTES} bytes" in result["message"]
    files = result["files"]
    assert sorted(files) == ["part0", "part1", "small.txt"]  # what fits, each whole
    assert base64.b64decode(files["small.txt"]) == b"kept"
    assert base64.b64decode(files["part1"]) == b"B" * (7 << 20)
    assert time.monotonic() - started < 60
    grown = peak.highest - before
    assert grown < 120, f"fetching a 400 MiB file grew the service by {grown:.0f} MiB"


def test_clients_that_do_not_read_their_answers_are_dropped(fusion: Fusion) -> None:
    """Four clients each ask for 14 MiB of files and read nothing: their answers are not held for
    them past the deadline (AENV_HTTP_BODY_TIMEOUT, both ways), and the next client is served."""
    code = "for i in range(2):\n    open(f'part{i}', 'wb').write(bytes([65 + i]) * (7 << 20))"
    body = json.dumps({"code": code, "fetch_files": ["part0", "part1"]}).encode()
    head = b"POST /run_code HTTP/1.1\r\nHost: f\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    before = fusion.settled_rss()
    stalled = []
    for _ in range(4):
        conn = socket.create_connection(("127.0.0.1", fusion.port), timeout=30)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel takes little of the answer
        conn.sendall(head % len(body) + body)
        stalled.append(conn)
    try:
        time.sleep(BODY_TIMEOUT + 8)  # their runs, then the deadline
        held = fusion.settled_rss() - before
        assert held < 40, f"4 answers nobody reads held {held:.0f} MiB of the service past the deadline"
        r = fusion.post("/run_code", {"code": code, "fetch_files": ["part1"]}, timeout=60)
        assert r.json()["status"] == "Success" and base64.b64decode(r.json()["files"]["part1"]) == b"B" * (7 << 20)
        started = time.monotonic()
        for conn in stalled:  # each was reset: what it still reads ends at once, the answer cut short
            assert len(read_answer(conn, 20)) < 19 * MIB
        assert time.monotonic() - started < 10
    finally:
        for conn in stalled:
            conn.close()


@pytest.mark.runsc  # gVisor's enforcement of the program's address space
def test_memory_limit_is_applied(fusion: Fusion) -> None:
    code = "b = bytearray(256 << 20)\nprint('allocated', len(b))"
    limited = fusion.post("/run_code", {"code": code, "memory_limit_MB": 128}).json()
    assert limited["status"] == "Failed" and limited["run_result"]["status"] == "Finished"
    assert limited["run_result"]["return_code"] != 0 and "MemoryError" in limited["run_result"]["stderr"]
    assert limited["run_result"]["stdout"] == ""
    roomy = fusion.post("/run_code", {"code": code, "memory_limit_MB": 1024}).json()
    assert roomy["status"] == "Success" and roomy["run_result"]["stdout"] == f"allocated {256 << 20}\n"
    cells = ["b = bytearray(256 << 20)", "len(b)"]
    jupyter = fusion.post("/run_jupyter", {"cells": cells, "memory_limit_MB": 128}).json()
    assert jupyter["status"] == "Failed" and jupyter["cells"][0]["error"][0]["ename"] == "MemoryError"


@pytest.mark.runsc  # the sandbox's memory limit is runsc's
def test_a_cell_that_takes_all_the_sandbox_memory_fails_and_the_service_answers(fusion: Fusion) -> None:
    """Under ptrace the memory cgroup ends the whole sandbox: SandboxError, saying what
    memory_limit_MB would do. Under systrap gVisor's own accounting kills the program first: the
    run Failed, with the program's failure in `driver`. Either way a structured answer, and the
    service runs the next request."""
    cells = ["x = []", "while True:\n    x.append(bytearray(1 << 20))"]
    r = fusion.post("/run_jupyter", {"cells": cells, "total_timeout": 60})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    result = r.json()
    if result["status"] == "SandboxError":
        assert "memory_limit_MB" in result["message"] and result["cells"] == [], result
    else:
        assert result["status"] == "Failed" and result["driver"]["return_code"] != 0, result
        assert len(result["cells"]) < len(cells), result  # the hungry cell never finished
    assert result["files"] == {}
    after = fusion.post("/run_code", {"code": "print('next')", "language": "python"}).json()
    assert after["status"] == "Success" and after["run_result"]["stdout"] == "next\n", after


def test_past_its_queue_a_request_is_a_503_at_once(server: Server, tmp_path: Path) -> None:
    busy = start_fusion(server, tmp_path / "fusion.log", "--concurrency", "1", "--queue", "1")
    try:
        slow = {"code": "import time; time.sleep(8); print('done')", "run_timeout": 30}
        answers: list[Any] = []
        threads = [threading.Thread(target=lambda: answers.append(busy.post("/run_code", slow))) for _ in range(2)]
        for t in threads:
            t.start()
            time.sleep(1.0)  # the first runs, the second waits its turn
        started = time.monotonic()
        refused = busy.post("/run_code", {"code": "print(1)"})
        assert time.monotonic() - started < 3
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json() == {"code": 503, "message": "busy: 1 requests running and 1 waiting; try again"}
        for t in threads:
            t.join(120)
        assert [a.json()["run_result"]["stdout"] for a in answers] == ["done\n", "done\n"]  # both ran, in turn
    finally:
        stop(busy)
