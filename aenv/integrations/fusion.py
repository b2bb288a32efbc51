"""A SandboxFusion-compatible service over aenv: ``POST /run_code`` and ``POST /run_jupyter``.

verl's reward functions and sandbox tools (and anything else written against SandboxFusion) post
code there; here each request runs in a sandbox of its own, created for it and killed after it
(a warm pool makes that a few milliseconds), so one rollout's code never sees another's files or
processes. ``aenv fusion --port 8080`` serves it; point ``SANDBOX_FUSION_URL`` at
``http://HOST:8080/run_code``.

The request and response shapes are SandboxFusion's (``RunCodeRequest``, ``RunCodeResponse``,
``CommandRunResult``); fields this service does not use (``memory_limit_MB``: the sandbox's own
limits apply) are accepted and ignored. A client mistake is a 400 ``{code, message}``; a failure
of aenv itself is SandboxFusion's ``status: SandboxError`` with a message.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import posixpath
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from aenv.errors import AenvError, InvalidRequest, LimitExceeded, OperationTimeout
from aenv.sdk import AsyncClient, AsyncSandbox

MAX_CODE = 1 << 20  # bytes of code, stdin, or one cell
MAX_FILES = 64
MAX_FILE_BYTES = 16 << 20  # all files of a request together, decoded
MAX_OUTPUT = 4 << 20  # characters kept of each stream
MAX_TIMEOUT = 600.0
MAX_BODY = 32 << 20  # a request's JSON: its files base64 (4/3 of MAX_FILE_BYTES), code and stdin
WORKDIR = "/tmp/fusion"  # in the request's own sandbox
FUSION_TAG = {"aenv-fusion": "run"}  # metadata of the sandboxes it makes
EXEC_GRACE = 2.0  # seconds past a command's timeout before it counts as timed out here


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


class FusionError(InvalidRequest):
    """A request the service cannot run: a 400 with this message."""


def command_result(
    status: str, elapsed: float | None, code: int | None, stdout: str | None, stderr: str | None
) -> dict[str, Any]:
    return {
        "status": status,
        "execution_time": elapsed,
        "return_code": code,
        "stdout": None if stdout is None else stdout[:MAX_OUTPUT],
        "stderr": None if stderr is None else stderr[:MAX_OUTPUT],
    }


def _relative(path: str) -> str:
    """A request's file path, relative to the run directory, or a FusionError."""
    if not path or "\0" in path or len(path) > 1024:
        raise FusionError(f"file path {path[:64]!r} is not usable")
    norm = posixpath.normpath(path.removeprefix(WORKDIR + "/"))
    if norm.startswith(("/", "../")) or norm in ("..", "."):
        raise FusionError(f"file path {path[:64]!r} is outside the run directory")
    return norm


def _decoded_files(files: Mapping[str, str | None]) -> dict[str, bytes]:
    out: dict[str, bytes] = {}
    total = 0
    for path, data in files.items():
        try:
            raw = base64.b64decode(data or "", validate=True)
        except (binascii.Error, ValueError):
            raise FusionError(f"file {path[:64]!r} is not base64") from None
        total += len(raw)
        if total > MAX_FILE_BYTES:
            raise FusionError(f"files exceed {MAX_FILE_BYTES >> 20} MiB")
        out[_relative(path)] = raw
    return out


class Runner:
    """Runs requests on an aenv node, each in a new sandbox of ``template``."""

    def __init__(self, client: AsyncClient, *, template: str = "base", max_concurrency: int = 16) -> None:
        self.client = client
        self.template = template
        self._slots = asyncio.Semaphore(max_concurrency)
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

    async def _exec(self, sbx: AsyncSandbox, cmd: str, timeout: float) -> dict[str, Any]:
        started = time.monotonic()
        try:
            # The agent kills the command at ``timeout``; the answer does not wait much past it
            # even when a loaded host is slow to say so (the sandbox is killed after anyway).
            r = await asyncio.wait_for(sbx.exec(f"cd {WORKDIR} && {cmd}", timeout=timeout), timeout + EXEC_GRACE)
        except (OperationTimeout, TimeoutError):
            return command_result("TimeLimitExceeded", time.monotonic() - started, None, None, None)
        return command_result("Finished", time.monotonic() - started, r.exit_code, r.stdout, r.stderr)

    async def _fetch(self, sbx: AsyncSandbox, paths: list[str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for path in paths:
            where = posixpath.join(WORKDIR, _relative(path))  # a path not of the run directory is a 400
            try:
                data = await sbx.read(where)
            except AenvError:
                continue  # SandboxFusion leaves out what is not there
            out[path] = base64.b64encode(data).decode()
        return out

    async def run_code(self, req: RunCodeRequest) -> dict[str, Any]:
        lang = LANGUAGES.get(req.language)
        if lang is None:
            raise FusionError(f"language {req.language[:32]!r} is not one of {', '.join(LANGUAGES)}")
        files = _decoded_files(req.files)
        for path in req.fetch_files:
            _relative(path)  # refused before anything runs
        files[lang.source] = req.code.encode()
        if req.stdin is not None:
            files[".stdin"] = req.stdin.encode()
        budget = req.compile_timeout + req.run_timeout
        async with self._slots:
            sbx = await self._sandbox(budget, time.monotonic() + budget + 30)
            try:
                for path, data in files.items():
                    await sbx.write(posixpath.join(WORKDIR, path), data)
                compiled = None
                if lang.compile:
                    compiled = await self._exec(sbx, lang.compile, req.compile_timeout)
                    if compiled["status"] != "Finished" or compiled["return_code"] != 0:
                        return _answer(compiled, None, await self._fetch(sbx, req.fetch_files))
                stdin = " < .stdin" if req.stdin is not None else " < /dev/null"
                ran = await self._exec(sbx, lang.run + stdin, req.run_timeout)
                return _answer(compiled, ran, await self._fetch(sbx, req.fetch_files))
            finally:
                self._dispose(sbx)

    async def run_jupyter(self, req: RunJupyterRequest) -> dict[str, Any]:
        for cell in req.cells:
            if len(cell) > MAX_CODE:
                raise FusionError(f"a cell is longer than {MAX_CODE} characters")
        files = _decoded_files(req.files)
        for path in req.fetch_files:
            _relative(path)
        files[".cells.json"] = json.dumps({"cells": req.cells, "cell_timeout": req.cell_timeout}).encode()
        files[".driver.py"] = JUPYTER_DRIVER.encode()
        async with self._slots:
            sbx = await self._sandbox(req.total_timeout, time.monotonic() + req.total_timeout + 30)
            try:
                for path, data in files.items():
                    await sbx.write(posixpath.join(WORKDIR, path), data)
                driver = await self._exec(sbx, "python3 .driver.py < /dev/null", req.total_timeout)
                try:
                    cells = json.loads(await sbx.read(posixpath.join(WORKDIR, ".cells.out.json")))
                except (AenvError, ValueError):
                    cells = []
                fetched = await self._fetch(sbx, req.fetch_files)
            finally:
                self._dispose(sbx)
        ok = driver["status"] == "Finished" and driver["return_code"] == 0 and len(cells) == len(req.cells)
        ok = ok and not any(c["error"] for c in cells)
        return {
            "status": "Success" if ok else "Failed",
            "message": "",
            "driver": driver,
            "cells": cells,
            "files": fetched,
        }


def _answer(compiled: dict[str, Any] | None, ran: dict[str, Any] | None, files: dict[str, str]) -> dict[str, Any]:
    good = all(r is None or (r["status"] == "Finished" and r["return_code"] == 0) for r in (compiled, ran))
    return {
        "status": "Success" if good and ran is not None else "Failed",
        "message": "",
        "compile_result": compiled,
        "run_result": ran,
        "executor_pod_name": None,
        "files": files,
    }


async def _kill(sbx: AsyncSandbox) -> None:
    try:
        await sbx.kill()
    except AenvError:
        pass  # gone already: its timeout is the backstop


# Runs a request's cells in one Python process, as a notebook kernel runs them: one namespace, a
# cell's last expression displayed, an exception recorded as the cell's error (later cells run).
JUPYTER_DRIVER = r"""
import ast, contextlib, io, json, signal, sys, traceback
spec = json.load(open(".cells.json"))
ns = {"__name__": "__main__"}
out = []
def alarm(*_):
    raise TimeoutError("cell timed out")
signal.signal(signal.SIGALRM, alarm)
def save():
    with open(".cells.out.json", "w") as f:
        json.dump(out, f)
for source in spec["cells"]:
    cell = {"stdout": "", "stderr": "", "display": [], "error": []}
    out.append(cell)
    stdout, stderr = io.StringIO(), io.StringIO()
    if spec["cell_timeout"]:
        signal.setitimer(signal.ITIMER_REAL, spec["cell_timeout"])
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            tree = ast.parse(source, "<cell>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, "<cell>", "exec"), ns)
            if last is not None:
                value = eval(compile(ast.Expression(last.value), "<cell>", "eval"), ns)
                if value is not None:
                    cell["display"].append({"text/plain": repr(value)})
    except BaseException as exc:
        cell["error"].append({"ename": type(exc).__name__, "evalue": str(exc),
                              "traceback": traceback.format_exception(type(exc), exc, exc.__traceback__)})
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    cell["stdout"], cell["stderr"] = stdout.getvalue(), stderr.getvalue()
    save()
save()
"""


def _bad(message: str) -> JSONResponse:
    return JSONResponse({"code": 400, "message": message}, status_code=400)


def create_app(client: AsyncClient, *, template: str = "base", max_concurrency: int = 16) -> FastAPI:
    """The service's ASGI app, running requests on ``client``'s node (a node or a gateway)."""
    runner = Runner(client, template=template, max_concurrency=max_concurrency)
    app = FastAPI(title="aenv SandboxFusion", docs_url=None, redoc_url=None)

    async def handle(request: Request, model: type[_Request], run: Any) -> JSONResponse:
        chunks, size = [], 0
        async for chunk in request.stream():  # bounded while it arrives, not after
            size += len(chunk)
            if size > MAX_BODY:
                return JSONResponse({"code": 413, "message": f"body over {MAX_BODY >> 20} MiB"}, status_code=413)
            chunks.append(chunk)
        raw = b"".join(chunks)
        try:
            req = model.model_validate_json(raw)
        except ValidationError as exc:
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "body"
            return _bad(f"invalid request: {where}: {first['msg']}")
        try:
            return JSONResponse(await run(req))
        except FusionError as exc:
            return _bad(str(exc))
        except AenvError as exc:
            return JSONResponse({"status": "SandboxError", "message": exc.message})

    @app.post("/run_code")
    async def run_code(request: Request) -> JSONResponse:
        return await handle(request, RunCodeRequest, runner.run_code)

    @app.post("/run_jupyter")
    async def run_jupyter(request: Request) -> JSONResponse:
        return await handle(request, RunJupyterRequest, runner.run_jupyter)

    @app.get("/v1/ping")
    async def ping() -> Any:
        return JSONResponse("pong")

    return app
