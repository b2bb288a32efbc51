"""A SandboxFusion-compatible service over aenv: ``POST /run_code`` and ``POST /run_jupyter``.

verl's reward functions and sandbox tools (and anything else written against SandboxFusion) post
code there; here each request runs in a sandbox of its own, created for it and killed after it
(a warm pool makes that a few milliseconds), so one rollout's code never sees another's files or
processes. ``aenv fusion --port 8080`` serves it; point ``SANDBOX_FUSION_URL`` at
``http://HOST:8080/run_code``.

The request and response shapes are SandboxFusion's (``RunCodeRequest``, ``RunCodeResponse``,
``CommandRunResult``, ``RunJupyterResponse``); fields this service does not use are accepted and
ignored. ``memory_limit_MB`` is applied as SandboxFusion applies it: to the program's address
space (RLIMIT_AS, ``ulimit -v``) in the run step (a compile is not limited), under the sandbox's
own memory limit; past it the program gets a memory error (Python's ``MemoryError``), answered as
any failed run. A client mistake is an HTTP error ``{code, message}`` (400, 404, 405, 408, 413,
431, 503); a failure of the sandbox or of aenv is SandboxFusion's ``status: SandboxError`` with a
message (a program that takes all of its sandbox's memory ends the sandbox: that too); nothing
answers a bare 500.

Whoever reaches the port may send anything (the service has no key, as SandboxFusion has none),
so what a request costs the service's own process is bounded, as a node bounds its clients:

- Connections and heads: served with the node's HTTP protocol (aenv/api/connections.py) and its
  ``AENV_HTTP_*`` bounds: a head's bytes, header lines and deadline (431: 1M header lines are
  refused at the 257th), the connections waiting for a head and those idle between requests.
- Requests: ``concurrency`` run at once (each in a sandbox), ``queue`` more wait for a turn;
  past both a request is a 503 at once, before its body is read.
- Bodies: a declared ``Content-Length`` over MAX_BODY is a 413 before a byte is read, a streamed
  body the moment it passes; a body has ``body_timeout`` seconds to arrive (408). The bodies held
  at once are bounded in bytes (``body_budget``, each counting BODY_WEIGHT times its size: its
  bytes, the parser's copy, what they parse into; a body of unsaid length, chunked, counts as
  MAX_BODY): a request waits for its share before its body
  is read (unread bytes stay in the client's socket), and gives it back once its files are in its
  sandbox.
- Output: a command's stdout and stderr are kept to MAX_OUTPUT bytes each (SandboxFusion's own
  bound) while it runs; past it the command is killed and the answer is ``Failed`` with a message
  saying where it was cut. /run_jupyter's cells keep MAX_CELLS_TEXT characters of output together
  (cut past it), and their results are read back bounded (MAX_CELLS_OUT).
- ``fetch_files``: MAX_FETCH_FILE bytes a file, MAX_FETCH_BYTES a request, read with that bound
  (a larger file is refused by its size, never read whole first): it is left out, and the answer
  is ``Failed`` saying so. The fetched files held at once are bounded too (``fetch_budget``: a
  request takes its caps whole before it reads any).
- Answers: handed to the connection in pieces of SEND_PIECE bytes (the files' base64 never copied
  into one string with the rest) while the request still holds its turn; a client that has not
  read its answer within ``send_timeout`` seconds has its connection reset.
"""

from __future__ import annotations

import asyncio
import binascii
import contextlib
import ctypes
import json
import logging
import math
import posixpath
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.types import Message, Receive, Scope, Send

from aenv.api import connections
from aenv.errors import (
    AenvError,
    InvalidRequest,
    LimitExceeded,
    OperationTimeout,
    PayloadTooLarge,
    SandboxGone,
)
from aenv.sdk import AsyncClient, AsyncSandbox

log = logging.getLogger("aenv.fusion")

MAX_CODE = 1 << 20  # bytes of code, stdin, or one cell
MAX_FILES = 64
MAX_FILE_BYTES = 16 << 20  # all files of a request together, decoded
MAX_BODY = 32 << 20  # a request's JSON: its files base64 (4/3 of MAX_FILE_BYTES), code and stdin
MAX_OUTPUT = 1 << 20  # bytes kept of each of a command's stdout and stderr (SandboxFusion keeps 1 MiB)
MAX_CELLS_TEXT = 1 << 20  # characters of /run_jupyter's cell output kept, all cells together
MAX_CELLS_OUT = 8 << 20  # bytes of the cells' results read back (that text as JSON, escapes included)
MAX_FETCH_FILE = 8 << 20  # bytes of one fetched file
MAX_FETCH_BYTES = 16 << 20  # bytes of a request's fetched files together
MAX_MEMORY_MB = 1 << 20
MAX_TIMEOUT = 600.0
BODY_BUDGET = 96 << 20  # bytes of request bodies held at once, each counted BODY_WEIGHT times
BODY_WEIGHT = 3  # a body costs its bytes, the parser's copy of its strings and what they become
FETCH_BUDGET = 64 << 20  # bytes of fetched files held at once (a request takes its caps)
SEND_PIECE = 256 << 10  # bytes of an answer handed to the connection at a time
WORKDIR = "/tmp/fusion"  # in the request's own sandbox
FUSION_TAG = {"aenv-fusion": "run"}  # metadata of the sandboxes it makes
EXEC_GRACE = 2.0  # seconds past a command's timeout before it counts as timed out here
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
JSON_HEAD = [(b"content-type", b"application/json")]


@dataclass(frozen=True, slots=True)
class FusionLimits:
    """What the service's clients may hold of it at once (``aenv fusion``'s options)."""

    concurrency: int = 16  # requests running at once, each in a sandbox of its own
    queue: int = 1024  # requests waiting for a turn beyond those; past both, 503 at once
    body_timeout: float = 60.0  # seconds a request's body may take to arrive (408): AENV_HTTP_BODY_TIMEOUT
    send_timeout: float = 60.0  # seconds an answer may take to be read, then its connection is dropped: the same
    body_budget: int = BODY_BUDGET
    fetch_budget: int = FETCH_BUDGET


class Lease:
    """A share of a Budget, given back once whatever happens."""

    def __init__(self, budget: Budget, size: int) -> None:
        self.budget = budget
        self.size = size

    def give_back(self) -> None:
        size, self.size = self.size, 0
        if size:
            self.budget.give(size)


class Budget:
    """Units (bytes, or running slots) requests may hold at once, handed out first come first
    served. A request takes its whole share at once or waits for it holding none of it: no two
    requests can each hold a part and wait on the other."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.free = total
        self._waiting: deque[tuple[int, asyncio.Future[None]]] = deque()

    def waiting(self) -> int:
        return len(self._waiting)

    async def take(self, size: int) -> Lease:
        size = min(size, self.total)
        if size <= 0:
            return Lease(self, 0)
        if not self._waiting and size <= self.free:
            self.free -= size
            return Lease(self, size)
        entry = (size, asyncio.get_running_loop().create_future())
        self._waiting.append(entry)
        try:
            await entry[1]
        except asyncio.CancelledError:
            if entry[1].done() and not entry[1].cancelled():
                self.give(size)  # granted as it was cancelled
            elif entry in self._waiting:
                self._waiting.remove(entry)
                self._wake()  # the next one may fit now
            raise
        return Lease(self, size)

    def give(self, size: int) -> None:
        self.free += size
        self._wake()

    def _wake(self) -> None:
        while self._waiting and self._waiting[0][0] <= self.free:
            size, granted = self._waiting.popleft()
            if not granted.done():  # (one cancelled meanwhile is skipped)
                self.free -= size
                granted.set_result(None)


@dataclass(frozen=True)
class Language:
    source: str
    run: str
    compile: str | None = None


# What SandboxFusion's languages run as here. A toolchain the template lacks fails as SandboxFusion
# reports a missing one: a compile or run that exits 127 with the shell's message.
LANGUAGES: dict[str, Language] = {
    "python": Language("main.py", "python3 main.py"),
    "python3": Language("main.py", "python3 main.py"),
    "bash": Language("main.sh", "bash main.sh"),
    "cpp": Language("main.cpp", "./main", "g++ -O2 -std=c++17 -o main main.cpp"),
    "c": Language("main.c", "./main", "gcc -O2 -o main main.c -lm"),
    "nodejs": Language("main.js", "node main.js"),
    "typescript": Language("main.ts", "tsx main.ts"),
    "go": Language("main.go", "./main", "go build -o main main.go"),
    "java": Language("Main.java", "java Main", "javac Main.java"),
    "rust": Language("main.rs", "./main", "rustc -O -o main main.rs"),
    "ruby": Language("main.rb", "ruby main.rb"),
    "perl": Language("main.pl", "perl main.pl"),
    "php": Language("main.php", "php main.php"),
    "lua": Language("main.lua", "lua main.lua"),
    "R": Language("main.R", "Rscript main.R"),
    "julia": Language("main.jl", "julia main.jl"),
    "pytest": Language("test_main.py", "python3 -m pytest -q test_main.py"),
}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    files: dict[str, str | None] = Field(default_factory=dict, max_length=MAX_FILES)
    fetch_files: list[str] = Field(default_factory=list, max_length=MAX_FILES)
    memory_limit_MB: int = Field(-1, le=MAX_MEMORY_MB)  # 0 or less: no limit (SandboxFusion's -1)


class RunCodeRequest(_Request):
    code: str = Field(..., max_length=MAX_CODE)
    language: str = "python"
    compile_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT)
    run_timeout: float = Field(10, gt=0, le=MAX_TIMEOUT)
    stdin: str | None = Field(None, max_length=MAX_CODE)


class RunJupyterRequest(_Request):
    cells: list[str] = Field(..., max_length=256)
    cell_timeout: float = Field(0, ge=0, le=MAX_TIMEOUT)
    total_timeout: float = Field(45, gt=0, le=MAX_TIMEOUT)
    kernel: Literal["python3"] = "python3"


ROUTES: dict[str, type[_Request]] = {"/run_code": RunCodeRequest, "/run_jupyter": RunJupyterRequest}


class FusionError(InvalidRequest):
    """A request the service cannot run: a 400 with this message."""


@dataclass
class Job:
    """A request ready to run: its files decoded, nothing else of its body kept."""

    files: dict[str, bytes]
    fetch: list[str]
    run: str  # the command, in the run directory, its stdin given
    run_timeout: float
    memory_mb: int  # the run's address space (0: not limited)
    compile: str | None = None
    compile_timeout: float = 0.0
    cells: int | None = None  # /run_jupyter: how many cells it runs

    @property
    def seconds(self) -> float:
        return self.compile_timeout + self.run_timeout


@dataclass
class Answer:
    """What a run answers: SandboxFusion's response without ``files``, and the fetched files as base64."""

    result: dict[str, Any]
    files: dict[str, bytes] = field(default_factory=dict)


def command_result(
    status: str, elapsed: float | None, code: int | None, stdout: str | None, stderr: str | None
) -> dict[str, Any]:
    return {"status": status, "execution_time": elapsed, "return_code": code, "stdout": stdout, "stderr": stderr}


def _ok(result: dict[str, Any]) -> bool:
    return bool(result["status"] == "Finished" and result["return_code"] == 0)


def _relative(path: str) -> str:
    """A request's file path, relative to the run directory, or a FusionError."""
    if not path or "\0" in path or len(path) > 1024:
        raise FusionError(f"file path {path[:64]!r} is not usable")
    norm = posixpath.normpath(path.removeprefix(WORKDIR + "/"))
    if norm.startswith(("/", "../")) or norm in ("..", "."):
        raise FusionError(f"file path {path[:64]!r} is outside the run directory")
    return norm


def _decoded_files(req: _Request) -> dict[str, bytes]:
    """The request's files decoded, each one's base64 dropped as soon as it is (not both held whole)."""
    out: dict[str, bytes] = {}
    total = 0
    while req.files:
        path, data = req.files.popitem()
        try:
            raw = binascii.a2b_base64(data or "", strict_mode=True)
        except (binascii.Error, ValueError):
            raise FusionError(f"file {path[:64]!r} is not base64") from None
        del data
        total += len(raw)
        if total > MAX_FILE_BYTES:
            raise FusionError(f"files exceed {MAX_FILE_BYTES >> 20} MiB")
        out[_relative(path)] = raw
    return out


def _limited(cmd: str, memory_mb: int) -> str:
    """``cmd`` with its address space bounded (as SandboxFusion bounds it: RLIMIT_AS)."""
    return f"ulimit -v {memory_mb * 1024} && {cmd}" if memory_mb > 0 else cmd


def code_job(req: RunCodeRequest) -> Job:
    lang = LANGUAGES.get(req.language)
    if lang is None:
        raise FusionError(f"language {req.language[:32]!r} is not one of {', '.join(LANGUAGES)}")
    for path in req.fetch_files:
        _relative(path)  # refused before anything runs
    files = _decoded_files(req)
    files[lang.source] = req.code.encode()
    if req.stdin is not None:
        files[".stdin"] = req.stdin.encode()
    stdin = " < .stdin" if req.stdin is not None else " < /dev/null"
    return Job(
        files=files,
        fetch=list(req.fetch_files),
        run=lang.run + stdin,
        run_timeout=req.run_timeout,
        memory_mb=max(req.memory_limit_MB, 0),
        compile=lang.compile,
        compile_timeout=req.compile_timeout if lang.compile else 0.0,
    )


def jupyter_job(req: RunJupyterRequest) -> Job:
    for cell in req.cells:
        if len(cell) > MAX_CODE:
            raise FusionError(f"a cell is longer than {MAX_CODE} characters")
    for path in req.fetch_files:
        _relative(path)
    files = _decoded_files(req)
    spec = {"cells": req.cells, "cell_timeout": req.cell_timeout, "max_text": MAX_CELLS_TEXT}
    files[".cells.json"] = json.dumps(spec).encode()
    files[".driver.py"] = JUPYTER_DRIVER.encode()
    return Job(
        files=files,
        fetch=list(req.fetch_files),
        run="python3 .driver.py < /dev/null",
        run_timeout=req.total_timeout,
        memory_mb=max(req.memory_limit_MB, 0),
        cells=len(req.cells),
    )


class Runner:
    """Runs jobs on an aenv node, each in a new sandbox of ``template``."""

    def __init__(self, client: AsyncClient, *, template: str = "base", fetch_budget: int = FETCH_BUDGET) -> None:
        self.client = client
        self.template = template
        self.fetched = Budget(fetch_budget)
        self._killing: set[asyncio.Task[None]] = set()

    def _dispose(self, sbx: AsyncSandbox) -> None:
        """Kill ``sbx`` after the answer has gone: its kill is not the client's wait."""
        task = asyncio.ensure_future(_kill(sbx))
        self._killing.add(task)
        task.add_done_callback(self._killing.discard)

    async def _sandbox(self, seconds: float, deadline: float) -> AsyncSandbox:
        """A new sandbox; a full node (429) is asked again until ``deadline``."""
        delay = 0.2
        while True:
            try:
                return await self.client.create(self.template, timeout=math.ceil(seconds) + 60, metadata=FUSION_TAG)
            except LimitExceeded:
                if time.monotonic() + delay > deadline:
                    raise
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def run(self, job: Job, written: Callable[[], None], held: list[Lease]) -> Answer:
        """Run ``job`` in a sandbox of its own: ``written()`` once its files are in it (what the
        request held of its body can go), the fetched files' share of the budget put in ``held``."""
        sbx = await self._sandbox(job.seconds, time.monotonic() + job.seconds + 30)
        try:
            while job.files:
                path, data = job.files.popitem()
                await sbx.write(posixpath.join(WORKDIR, path), data)
                del data
            written()
            if job.cells is None:
                return await self._code(sbx, job, held)
            return await self._jupyter(sbx, job, held)
        finally:
            self._dispose(sbx)

    async def _exec(
        self, sbx: AsyncSandbox, cmd: str, timeout: float, memory_mb: int, notes: list[str]
    ) -> dict[str, Any]:
        started = time.monotonic()
        try:
            # The agent kills the command at ``timeout``; the answer does not wait much past it
            # even when a loaded host is slow to say so (the sandbox is killed after anyway).
            r = await asyncio.wait_for(
                sbx.exec(f"cd {WORKDIR} && {_limited(cmd, memory_mb)}", timeout=timeout, max_output=MAX_OUTPUT),
                timeout + EXEC_GRACE,
            )
        except (OperationTimeout, TimeoutError):
            return command_result("TimeLimitExceeded", time.monotonic() - started, None, None, None)
        if r.truncated:
            notes.append(f"output cut at {MAX_OUTPUT} bytes: the command wrote more and was stopped")
        return command_result("Finished", time.monotonic() - started, r.exit_code, r.stdout, r.stderr)

    async def _fetch(
        self, sbx: AsyncSandbox, paths: list[str], notes: list[str], held: list[Lease]
    ) -> dict[str, bytes]:
        if not paths:
            return {}
        held.append(await self.fetched.take(min(MAX_FETCH_BYTES, len(paths) * MAX_FETCH_FILE)))
        out: dict[str, bytes] = {}
        total = 0
        for path in paths:
            where = posixpath.join(WORKDIR, _relative(path))
            room = min(MAX_FETCH_FILE, MAX_FETCH_BYTES - total)
            try:
                data = await sbx.read(where, max_bytes=room)
            except PayloadTooLarge:
                if room == MAX_FETCH_FILE:
                    notes.append(f"fetch_files: {path[:64]!r} is larger than {MAX_FETCH_FILE} bytes, a file's cap")
                else:
                    notes.append(f"fetch_files: {path[:64]!r} passes {MAX_FETCH_BYTES} bytes, the files' cap together")
                continue  # left out
            except AenvError:
                continue  # SandboxFusion leaves out what is not there
            total += len(data)
            out[path] = binascii.b2a_base64(data, newline=False)
        return out

    async def _code(self, sbx: AsyncSandbox, job: Job, held: list[Lease]) -> Answer:
        notes: list[str] = []
        compiled = ran = None
        if job.compile:
            compiled = await self._exec(sbx, job.compile, job.compile_timeout, 0, notes)
        if compiled is None or _ok(compiled):
            ran = await self._exec(sbx, job.run, job.run_timeout, job.memory_mb, notes)
        files = await self._fetch(sbx, job.fetch, notes, held)
        good = ran is not None and _ok(ran) and not notes
        result = {
            "status": "Success" if good else "Failed",
            "message": "; ".join(notes),
            "compile_result": compiled,
            "run_result": ran,
            "executor_pod_name": None,
        }
        return Answer(result, files)

    async def _jupyter(self, sbx: AsyncSandbox, job: Job, held: list[Lease]) -> Answer:
        notes: list[str] = []
        driver = await self._exec(sbx, job.run, job.run_timeout, job.memory_mb, notes)
        if driver["status"] == "TimeLimitExceeded":
            notes.append(f"the cells ran past total_timeout ({job.run_timeout:g} s): the kernel was stopped")
        cells: list[Any] = []
        try:
            saved = json.loads(await sbx.read(posixpath.join(WORKDIR, ".cells.out.json"), max_bytes=MAX_CELLS_OUT))
        except PayloadTooLarge:
            notes.append(f"the cells' results are larger than {MAX_CELLS_OUT} bytes: left out")
        except (AenvError, ValueError):
            pass  # none saved: the driver did not get to its first cell's end
        else:
            if isinstance(saved, dict) and isinstance(saved.get("cells"), list):
                cells = [c for c in saved["cells"] if isinstance(c, dict)]
                if saved.get("cut"):
                    notes.append(f"cell output cut at {MAX_CELLS_TEXT} characters (all cells together)")
        files = await self._fetch(sbx, job.fetch, notes, held)
        good = _ok(driver) and len(cells) == job.cells and not any(c.get("error") for c in cells) and not notes
        result = {
            "status": "Success" if good else "Failed",
            "message": "; ".join(notes),
            "driver": driver,
            "cells": cells,
            "executor_pod_name": None,
        }
        return Answer(result, files)


async def _kill(sbx: AsyncSandbox) -> None:
    try:
        await sbx.kill()
    except (AenvError, httpx.HTTPError):
        pass  # gone already: its timeout is the backstop


# Runs a request's cells in one Python process, as a notebook kernel runs them: one namespace, a
# cell's last expression displayed, an exception recorded as the cell's error (later cells run).
# What the cells print, display and raise is kept to spec["max_text"] characters together.
JUPYTER_DRIVER = r"""
import ast, io, json, signal, sys, traceback
spec = json.load(open(".cells.json"))
ns = {"__name__": "__main__"}
out = []
room = [spec["max_text"]]
cut = [False]
def keep(text):
    text = str(text)
    if len(text) > room[0]:
        text, cut[0] = text[:room[0]], True
    room[0] -= len(text)
    return text
class Kept(io.TextIOBase):
    def __init__(self):
        self.parts = []
    def writable(self):
        return True
    def write(self, s):
        if not isinstance(s, str):
            raise TypeError("write() argument must be str, not " + type(s).__name__)
        kept = keep(s)
        if kept:
            self.parts.append(kept)
        return len(s)
    def getvalue(self):
        return "".join(self.parts)
def alarm(*_):
    raise TimeoutError("cell timed out")
signal.signal(signal.SIGALRM, alarm)
def save():
    with open(".cells.out.json", "w", encoding="utf-8") as f:
        json.dump({"cells": out, "cut": cut[0]}, f, ensure_ascii=False)
real = sys.stdout, sys.stderr
for source in spec["cells"]:
    cell = {"stdout": "", "stderr": "", "display": [], "error": []}
    out.append(cell)
    stdout, stderr = Kept(), Kept()
    if spec["cell_timeout"]:
        signal.setitimer(signal.ITIMER_REAL, spec["cell_timeout"])
    try:
        sys.stdout, sys.stderr = stdout, stderr
        tree = ast.parse(source, "<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, "<cell>", "exec"), ns)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
            if value is not None:
                cell["display"].append({"text/plain": keep(repr(value))})
    except BaseException as exc:
        lines = traceback.format_exception(type(exc), exc, exc.__traceback__)
        cell["error"].append({"ename": type(exc).__name__, "evalue": keep(exc), "traceback": [keep(t) for t in lines]})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        sys.stdout, sys.stderr = real
    cell["stdout"], cell["stderr"] = stdout.getvalue(), stderr.getvalue()
    save()
save()
"""


STOPPED = (
    "the sandbox stopped while it ran the request: a program that takes all of the sandbox's memory"
    " ends it (memory_limit_MB makes that the program's own memory error instead)"
)


def _sandbox_error(kind: type[_Request], message: str) -> Answer:
    """SandboxFusion's answer for a failure of the sandbox (or of aenv), all its fields there."""
    if kind is RunJupyterRequest:
        return Answer(
            {"status": "SandboxError", "message": message, "driver": None, "cells": [], "executor_pod_name": None}
        )
    result = {"status": "SandboxError", "message": message, "compile_result": None, "run_result": None}
    return Answer({**result, "executor_pod_name": None})


class _Refusal(AenvError):
    """A request answered with an HTTP error ``{code, message}`` before it runs."""

    def __init__(self, status: int, message: str, headers: list[tuple[bytes, bytes]] | None = None) -> None:
        super().__init__(message, status=status)
        self.headers = headers or []


class _Gone(AenvError):
    """The client went away before its request ran."""

    def __init__(self) -> None:
        super().__init__("the client went away before its request ran")


def _rendered(result: dict[str, Any], files: dict[str, bytes]) -> list[bytes]:
    """SandboxFusion's JSON answer in pieces: ``result`` and then ``files``, whose base64 goes out
    as it is (never copied into one string with the rest)."""
    head = json.dumps(result, ensure_ascii=False, separators=(",", ":"))
    parts = [head[:-1].encode(), b',"files":{']
    for i, (name, data) in enumerate(files.items()):
        parts += [b"," if i else b"", json.dumps(name).encode(), b':"', data, b'"']
    parts.append(b"}}")
    return parts


def _pieces(parts: list[bytes]) -> Iterator[memoryview]:
    for part in parts:
        view = memoryview(part)
        for at in range(0, len(view), SEND_PIECE):
            yield view[at : at + SEND_PIECE]


async def _disconnected(receive: Receive) -> None:
    """Returns once the client has gone (its body read whole already)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class FusionApp:
    """The service's ASGI app: its routes, and what a request may hold of it while it arrives,
    waits, runs and is answered. A request takes its shares in one order (its body's bytes, a
    turn, its fetched files' bytes) and gives the first back before it asks for the last: no
    request waits for a share while holding one that the request it waits on needs."""

    def __init__(self, client: AsyncClient, *, template: str = "base", limits: FusionLimits | None = None) -> None:
        self.limits = limits or FusionLimits()
        self.runner = Runner(client, template=template, fetch_budget=self.limits.fetch_budget)
        self.slots = Budget(self.limits.concurrency)
        self.bodies = Budget(self.limits.body_budget)
        self.admitted = 0  # requests arrived and not yet answered

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            await send({"type": "websocket.close", "code": 1003})
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self._route(scope, receive, tracked)
        except Exception as exc:  # nothing answers a bare 500: this is the service's own fault
            log.exception("fusion: %s %s failed", scope.get("method"), scope.get("path"))
            if not started:
                await self._error(receive, tracked, 500, f"the service failed: {type(exc).__name__}: {str(exc)[:200]}")

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        path, method = scope["path"], scope["method"]
        if path == "/v1/ping" and method in ("GET", "HEAD"):
            await self._send(receive, send, 200, [b'"pong"'])
            return
        kind = ROUTES.get(path)
        if kind is None:
            await self._error(receive, send, 404, f"no route {path[:200]}: POST /run_code or /run_jupyter")
        elif method != "POST":
            await self._error(receive, send, 405, f"{path} takes POST", [(b"allow", b"POST")])
        else:
            await self._request(kind, scope, receive, send)

    async def _request(self, kind: type[_Request], scope: Scope, receive: Receive, send: Send) -> None:
        limits = self.limits
        if self.admitted >= limits.concurrency + limits.queue:
            busy = f"busy: {limits.concurrency} requests running and {limits.queue} waiting; try again"
            await self._error(receive, send, 503, busy, [(b"retry-after", b"1")])
            return
        self.admitted += 1
        held: list[Lease] = []
        try:
            try:
                job = await self._job(kind, scope, receive, held)
                held.append(await self._turn(receive))
            except _Refusal as refusal:
                await self._error(receive, send, refusal.status, refusal.message, refusal.headers)
                return
            except _Gone:
                return
            try:
                answer = await self.runner.run(job, held[0].give_back, held)
            except SandboxGone as exc:
                answer = _sandbox_error(kind, f"{STOPPED} ({exc.message})")
            except AenvError as exc:
                answer = _sandbox_error(kind, exc.message)
            except httpx.HTTPError as exc:
                answer = _sandbox_error(kind, f"{STOPPED} ({type(exc).__name__}: {str(exc)[:200]})")
            del job
            await self._send(receive, send, 200, _rendered(answer.result, answer.files))
        finally:
            for lease in held:
                lease.give_back()
            self.admitted -= 1

    async def _job(self, kind: type[_Request], scope: Scope, receive: Receive, held: list[Lease]) -> Job:
        """The request's body read, within its bounds, and made a Job (its body's share of the
        budget put in ``held``, first)."""
        declared = None
        for name, value in scope["headers"]:
            if name == b"content-length":
                if not value.isdigit():
                    raise _Refusal(400, "the Content-Length header is not a number")
                declared = int(value)
        if declared is not None and declared > MAX_BODY:
            raise _Refusal(413, f"the body is larger than {MAX_BODY >> 20} MiB")
        held.append(await self.bodies.take(BODY_WEIGHT * (MAX_BODY if declared is None else declared)))
        body = bytearray()
        try:
            async with asyncio.timeout(self.limits.body_timeout):
                more = True
                while more:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        raise _Gone
                    chunk = message.get("body", b"")
                    if len(body) + len(chunk) > MAX_BODY:
                        raise _Refusal(413, f"the body is larger than {MAX_BODY >> 20} MiB")
                    body += chunk
                    more = message.get("more_body", False)
        except TimeoutError:
            raise _Refusal(408, f"the body did not arrive within {self.limits.body_timeout:g} s") from None
        try:
            req = kind.model_validate_json(body)
        except ValidationError as exc:
            first = exc.errors(include_input=False)[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            raise _Refusal(400, f"invalid request: {where}: {first['msg']}") from None
        finally:
            body.clear()
        try:
            if isinstance(req, RunCodeRequest):
                return code_job(req)
            assert isinstance(req, RunJupyterRequest)
            return jupyter_job(req)
        except FusionError as exc:
            raise _Refusal(400, exc.message) from None

    async def _turn(self, receive: Receive) -> Lease:
        """A running slot, once one is free; _Gone if the client goes away first (not run then)."""
        turn = asyncio.ensure_future(self.slots.take(1))
        gone = asyncio.ensure_future(_disconnected(receive))
        try:
            await asyncio.wait({turn, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            turn.cancel()
        try:
            return turn.result()
        except asyncio.CancelledError:
            raise _Gone from None

    async def _error(
        self,
        receive: Receive,
        send: Send,
        status: int,
        message: str,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        await self._send(receive, send, status, [json.dumps({"code": status, "message": message}).encode()], headers)

    async def _send(
        self,
        receive: Receive,
        send: Send,
        status: int,
        parts: list[bytes],
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """Answer in pieces, each handed over once the connection took the last; a client that
        does not take it all within send_timeout loses its connection (what it left unread goes)."""
        length = str(sum(len(p) for p in parts)).encode()
        try:
            async with asyncio.timeout(self.limits.send_timeout):
                start = {"type": "http.response.start", "status": status}
                await send({**start, "headers": [*JSON_HEAD, (b"content-length", length), *(headers or [])]})
                last = None
                for piece in _pieces(parts):
                    if last is not None:
                        await send({"type": "http.response.body", "body": last, "more_body": True})
                    last = piece
                await send({"type": "http.response.body", "body": last if last is not None else b""})
                await connections.drained()
        except TimeoutError:
            connections.drop_connection()
            with contextlib.suppress(TimeoutError):  # its loss heard before this returns (uvicorn then
                async with asyncio.timeout(1):  # takes the unfinished answer for what it is, no error)
                    await _disconnected(receive)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return


def create_app(
    client: AsyncClient, *, template: str = "base", max_concurrency: int = 16, limits: FusionLimits | None = None
) -> FusionApp:
    """The service's ASGI app, running requests on ``client``'s node (a node or a gateway)."""
    return FusionApp(client, template=template, limits=limits or FusionLimits(concurrency=max_concurrency))


def _large_allocations_apart() -> None:
    """Have glibc map each allocation past 128 KiB apart and unmap it when freed. By default it
    raises that threshold after the first large free (up to 32 MiB) and then serves bodies of that
    size from its heap, which it keeps: after a burst of 20 MiB bodies the process stayed at its
    peak. Nothing where the C library is not glibc."""
    try:
        ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, 128 << 10)
    except (OSError, AttributeError):
        pass


def serve(client: AsyncClient, *, host: str, port: int, template: str, limits: FusionLimits) -> None:
    """Serve the app as a node serves its API: its HTTP protocol, with the node's AENV_HTTP_* bounds
    on heads and connections (AENV_HTTP_BODY_TIMEOUT for a body to arrive and for an answer to be
    read, AENV_HTTP_KEEPALIVE for idle connections)."""
    import uvicorn

    from aenv.config import Settings

    settings = Settings()
    _large_allocations_apart()
    slow = settings.http_body_timeout  # a client's bytes, either way
    app = create_app(client, template=template, limits=replace(limits, body_timeout=slow, send_timeout=slow))
    connections.raise_open_files_limit()  # every connection is a file descriptor
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        http=connections.protocol_with(connections.HttpLimits.of(settings)),
        timeout_keep_alive=settings.http_keepalive,
        lifespan="on",
        log_level="warning",
    )
    uvicorn.Server(config).run()
