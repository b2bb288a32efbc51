"""Dockerfile builds: each step's result is a layer, cached by (parent, step, inputs).

FROM is an OCI image (pulled into the shared layer store) or an existing template. RUN boots a
build sandbox on the layers so far with a fresh upper, runs the command there and seals the
upper as the step's layer; COPY/ADD write their layer on the host, no sandbox needed; ENV, ARG,
WORKDIR and USER change what later steps see. A step's cache key chains its parent's key with
the step as written after substitution and, for COPY, the content of what it copies, so a
rebuild runs again only from the first step that changed. CMD/ENTRYPOINT become the template's
start command, running in every sandbox made from it.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import os
import posixpath
import re
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aenv.errors import AenvError, TemplateNotFound
from aenv.images.pull import Pulled, pull, release
from aenv.node.housekeeping import BUILD_CACHE
from aenv.node.service import BuildHost, TemplateRecord
from aenv.storage.confined import WILDCARDS, PathRefused, View, remove_tree
from aenv.storage.space import SpaceWatch, ensure_space, headroom
from aenv.templates import dockerfile as df
from aenv.templates.builder import BuildFailed, LogFn, StartCommand, build_instance, commit_template, run_process, seal
from aenv.templates.images import conventions_layer, image_user, layers_view

log = logging.getLogger("aenv.templates")

CACHE_KEY = BUILD_CACHE  # node meta: step key -> layer id ("" for a step that wrote nothing)
COMMITS_KEY = "build-commits"  # node meta: key of a whole build -> the template it committed
CONVENTIONS_VERSION = "conventions-2"
CHMOD = re.compile(r"[0-7]{1,4}")
MAX_ID = 2**32 - 2  # the largest uid/gid (-1 means "unchanged" to chown)


@dataclass
class State:
    key: str
    layers: list[str]
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = "root"
    # What sandboxes of the template default to: the recipe's last USER and WORKDIR ("" = the
    # `user` convention and that user's home), as E2B persists a template's last user and workdir.
    default_user: str = ""
    default_workdir: str = ""
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    labels: dict[str, str] = field(default_factory=dict)

    def chain(self, *parts: Any) -> str:
        self.key = hashlib.sha256(json.dumps([self.key, *parts], sort_keys=True).encode()).hexdigest()
        return self.key


async def load_cache(node: BuildHost) -> dict[str, str]:
    return dict(json.loads(await node.store.get_meta(CACHE_KEY) or "{}"))


async def build(
    node: BuildHost,
    *,
    name: str,
    dockerfile: str | list[df.Instruction],
    context: Path,
    build_args: dict[str, str] | None = None,
    start: tuple[str, str | None] | None = None,
    login: tuple[str, str] | None = None,
    on_log: LogFn | None = None,
) -> TemplateRecord:
    """Build template ``name``. ``dockerfile`` is its text or already parsed instructions;
    ``start`` is a (start command, ready command) pair of shell lines that replaces CMD."""
    log = on_log or (lambda line: None)
    instructions = df.parse(dockerfile) if isinstance(dockerfile, str) else dockerfile
    cache = await load_cache(node)
    build_args = dict(build_args or {})
    pre_args: dict[str, str] = {}
    pulled: Pulled | None = None
    made: set[str] = set()  # layers of this build: not garbage until the template names them
    pinned: list[str] = []  # a FROM template's layers: not evicted while the build reads them
    try:
        state: State | None = None
        total = len(instructions)
        for n, instr in enumerate(instructions, 1):
            where = f"[{n}/{total}] {instr}"
            if state is None:
                log(where)
                if instr.keyword == "ARG":
                    pre_args.update(_arg(instr, build_args, pre_args))
                    continue
                state, pulled = await _from(node, instr, pre_args, cache, log, login)
                if pulled is None:
                    pinned = list(state.layers)
                    node.artifacts.pin(pinned)
                continue
            before = list(state.layers)

            def announce(hit: bool, w: str = where) -> None:
                log(_say(w, hit))

            cached = await _step(node, state, instr, context, build_args, cache, log, announce)
            if not cached:
                await node.store.set_meta(CACHE_KEY, json.dumps(cache))
            for layer_id in state.layers[len(before) :]:
                if layer_id not in made:  # pinned once, unpinned once
                    node.artifacts.pin([layer_id])
                    made.add(layer_id)
        assert state is not None
        begin = None
        argv = state.entrypoint + state.cmd
        ready = None
        if start is not None:
            argv = ["/bin/sh", "-c", start[0]]
            ready = ["/bin/sh", "-c", start[1]] if start[1] else None
        if argv:
            begin = StartCommand(argv, {**state.args, **state.env}, state.workdir, state.user, ready=ready)
        commits = json.loads(await node.store.get_meta(COMMITS_KEY) or "{}")
        defaults = (state.default_user, state.default_workdir)
        key = state.chain("COMMIT", name, argv, ready, node.driver.guest_key(), node.driver.image_mark, *defaults)
        same = node.templates.get(commits.get(key, ""))
        if same is not None and same.name == name and same.layers == state.layers:
            log(f"template '{name}' is unchanged")
            return same
        rec = await commit_template(
            node,
            name=name,
            layers=state.layers,
            steps=[],
            env=state.env,
            start=begin,
            description=f"Dockerfile build, {len(state.layers)} layers",
            user=state.default_user,
            workdir=state.default_workdir,
            on_log=log,
        )
        commits = {k: v for k, v in commits.items() if v in node.templates}  # forget replaced templates
        commits[key] = rec.id
        await node.store.set_meta(COMMITS_KEY, json.dumps(commits))
        return rec
    finally:
        if pulled is not None:
            release(node, pulled)
        node.artifacts.unpin(list(made))
        node.files.release(made)  # the step layers' uppers: the cache or the template holds them now
        node.artifacts.unpin(pinned)
        await node.store.set_meta(CACHE_KEY, json.dumps(cache))


def _say(where: str, cached: bool) -> str:
    return f"{where}  (cached)" if cached else where


def _arg(instr: df.Instruction, build_args: dict[str, str], env: dict[str, str]) -> dict[str, str]:
    name, eq, default = instr.args.strip().partition("=")
    name = name.strip()
    return {name: build_args.get(name, df.substitute(default, env) if eq else "")}


async def _from(
    node: BuildHost,
    instr: df.Instruction,
    args: dict[str, str],
    cache: dict[str, str],
    log: LogFn,
    login: tuple[str, str] | None = None,
) -> tuple[State, Pulled | None]:
    ref = df.substitute(instr.args.split()[0], args)
    try:
        template = node.find_template(ref)
    except TemplateNotFound:
        template = None
    if template is not None:
        await node.artifacts.ensure_local(template, only=set(template.layers))
        state = State(key=f"template:{template.id}", layers=list(template.layers), env=dict(template.env_vars))
        state.user = "root"
        state.default_user, state.default_workdir = template.user, template.workdir  # inherited, as Docker's
        return state, None
    pulled = await pull(node, ref, login=login, on_log=log)
    config = pulled.config.get("config") or {}
    state = State(key=f"image:{pulled.digest}", layers=list(pulled.layers))
    state.env = dict(item.split("=", 1) for item in config.get("Env") or [] if "=" in item)
    state.workdir = config.get("WorkingDir") or "/"
    state.user = config.get("User") or "root"
    # Its sandboxes start as Docker's containers do: the image's user and working directory
    state.default_user, state.default_workdir = image_user(config), state.workdir
    state.entrypoint = list(config.get("Entrypoint") or [])
    state.cmd = list(config.get("Cmd") or [])
    key = state.chain(CONVENTIONS_VERSION)
    layer = cache.get(key)
    if not layer or not await _whole(node, layer):
        layer = await asyncio.to_thread(conventions_layer, node, state.layers)
        cache[key] = layer
    state.layers.append(layer)
    return state, pulled


async def _step(
    node: BuildHost,
    state: State,
    instr: df.Instruction,
    context: Path,
    build_args: dict[str, str],
    cache: dict[str, str],
    log: LogFn,
    announce: Callable[[bool], None],
) -> bool:
    """Carry out one instruction on ``state``; True if its result came from the cache.
    ``announce`` is told, before any work, whether the cache has the step."""
    scope = {**state.args, **state.env}
    kw = instr.keyword
    if kw not in ("WORKDIR", "COPY", "ADD", "RUN"):
        announce(False)
    if kw == "ARG":
        state.args.update(_arg(instr, build_args, scope))
        state.chain("ARG", state.args)
        return True
    if kw == "ENV":
        state.env.update(df.env_pairs(instr, scope))
        state.chain("ENV", state.env)
        return True
    if kw == "USER":
        state.user = state.default_user = df.substitute(instr.args.strip(), scope)
        state.chain("USER", state.user)
        return True
    if kw in ("CMD", "ENTRYPOINT"):
        form = instr.exec_form() or ["/bin/sh", "-c", instr.args]
        if kw == "CMD":
            state.cmd = form
        else:
            state.entrypoint, state.cmd = form, []
        return True
    if kw in df.METADATA:
        if kw == "LABEL":
            state.labels.update(df.env_pairs(instr, scope))
        return True
    if kw == "WORKDIR":
        state.workdir = posixpath.normpath(posixpath.join(state.workdir, df.substitute(instr.args.strip(), scope)))
        # E2B's implicit WORKDIR: its sandboxes start in the default user's home, as E2B's do
        state.default_workdir = "" if "implicit" in instr.flags else state.workdir
        key = state.chain("WORKDIR", state.workdir)
        workdir, layers = state.workdir, list(state.layers)
        async with node.artifacts.using_layers(layers):  # read on the host: each mounted, or fetched
            with _refusals(instr.line):
                if await asyncio.to_thread(layers_view(node, layers).is_dir, workdir):
                    return True  # there already: a layer would only hide its owner and mode
                user = state.user if state.user != "root" else None
                owner = await asyncio.to_thread(_owner, node, layers, user, instr.line)
                return await _layer(
                    node,
                    state,
                    key,
                    cache,
                    announce,
                    lambda root: layers_view(node, layers, root).make_dir(workdir, owner),
                )
    if kw in ("COPY", "ADD"):
        sources, dest = df.copy_args(instr, scope)
        chmod = _chmod(instr.flags.get("chmod"), instr.line)
        source = View([context])
        with _refusals(instr.line):
            files = await asyncio.to_thread(_collect, source, sources, instr.line)
            digest = await asyncio.to_thread(_content_digest, source, files)
        single = len(files) == 1 and files[0].named and not stat.S_ISDIR(files[0].stat.st_mode)
        into_dir = not single or dest.endswith("/") or posixpath.basename(dest) in (".", "..")
        dest = posixpath.normpath(posixpath.join(state.workdir, dest))
        if into_dir:
            dest = dest.rstrip("/") + "/"
        layers = list(state.layers)
        async with node.artifacts.using_layers(layers):  # read on the host: each mounted, or fetched
            owner = await asyncio.to_thread(_owner, node, layers, instr.flags.get("chown"), instr.line)
            key = state.chain(kw, digest, dest, owner, instr.flags.get("chmod"))
            room = SpaceWatch(headroom(node.settings), f"line {instr.line}: {kw}")
            with _refusals(instr.line):
                return await _layer(
                    node,
                    state,
                    key,
                    cache,
                    announce,
                    lambda root: _copy_into(layers_view(node, layers, root), source, files, dest, owner, chmod, room),
                )
    assert kw == "RUN", kw
    argv = instr.exec_form() or ["/bin/sh", "-c", instr.args]
    env = {**state.args, **state.env}
    key = state.chain("RUN", argv, env, state.user, state.workdir)
    hit = cache.get(key)
    if hit is not None and (hit == "" or await _whole(node, hit)):
        announce(True)
        if hit:
            node.files.touch(hit)
            state.layers.append(hit)
        return True
    announce(False)
    layer = await _run(node, state, argv, env, instr, log)
    cache[key] = layer or ""
    if layer:
        state.layers.append(layer)
    return False


async def _whole(node: BuildHost, layer_id: str) -> bool:
    """Whether a cached step's layer can be used now: on this node (mounted, if it was not) or
    fetched through a committed record naming it. A layer that is neither, or whose fetch fails, is
    a miss: the step runs again rather than the build failing on it."""
    if not node.artifacts.layer_available(layer_id):
        return False
    try:
        async with node.artifacts.using_layers([layer_id]):
            return node.files.is_local(layer_id)
    except AenvError as exc:
        log.warning("cached build layer %s is not usable (%s): its step runs again", layer_id, exc.message)
        return False


async def _layer(
    node: BuildHost, state: State, key: str, cache: dict[str, str], announce: Callable[[bool], None], write: Any
) -> bool:
    hit = cache.get(key)
    if hit and await _whole(node, hit):
        announce(True)
        node.files.touch(hit)
        state.layers.append(hit)
        return True
    announce(False)
    layer_id, root = node.files.new_layer_dir()
    node.artifacts.pin([layer_id])  # a collection spares unnamed layers for two minutes only
    try:
        await asyncio.to_thread(write, root)  # host file work of any size: never on the event loop
    except BaseException:
        remove_tree(root, ignore_errors=True)
        raise
    finally:
        node.artifacts.unpin([layer_id])
    cache[key] = layer_id
    state.layers.append(layer_id)
    return False


async def _run(
    node: BuildHost, state: State, argv: list[str], env: dict[str, str], instr: df.Instruction, log: LogFn
) -> str | None:
    # Each step's upper may take its disk quota of the host's disk: none starts at the headroom.
    ensure_space(node.files.root, headroom(node.settings), 0, f"line {instr.line}: RUN")
    async with build_instance(node, state.layers, f"build-step-{instr.line}") as (link, _, upper):
        ran = await run_process(link, argv, env=env, cwd=state.workdir, user=state.user, on_log=log)
        if ran.code != 0:  # as E2B's template builder words it
            message = f"line {instr.line}: failed to run command '{instr.args}': {ran.failure}"
            raise BuildFailed(message, step=instr.line, output=ran.output[-4000:])
    return await seal(node, upper)


def _fail(line: int, message: str) -> BuildFailed:
    return BuildFailed(f"line {line}: {message}", step=line, output="")


@contextmanager
def _refusals(line: int) -> Iterator[None]:
    """A path the recipe cannot use is a failed step (400, naming the line)."""
    try:
        yield
    except PathRefused as exc:
        raise _fail(line, exc.message) from exc


def _chmod(value: str | None, line: int) -> int | None:
    if value is None or value == "":
        return None
    if not CHMOD.fullmatch(value):
        raise _fail(line, f"--chmod={value}: an octal mode is expected")
    return int(value, 8)


@dataclass
class Source:
    """One thing a COPY copies: its path in the build context, where it goes relative to the
    destination, what it is, and whether a source named it (rather than being inside a directory)."""

    path: str
    rel: str
    stat: os.stat_result
    named: bool


def _collect(context: View, sources: list[str], line: int) -> list[Source]:
    """Everything the sources name in the build context. Links in the middle of a source path
    resolve inside the context; a link a source names is copied as a link (``link/`` names the
    directory it leads to)."""
    out: list[Source] = []
    for src in sources:
        matches = context.glob(src) if any(c in src for c in WILDCARDS) else [src]
        found = [(match, context.stat(match, follow=src.endswith("/"))) for match in matches]
        if not found or any(st is None for _, st in found):
            raise _fail(line, f"COPY source {src!r} not found in the build context")
        for match, st in found:
            assert st is not None
            if stat.S_ISDIR(st.st_mode):
                out += [Source(path, rel, item, False) for path, rel, item in context.walk_tree(match)]
            else:
                out.append(Source(match, posixpath.basename(context.canonical(match, follow=False)), st, True))
    return out


def _content_digest(context: View, files: list[Source]) -> str:
    h = hashlib.sha256()
    for item in files:
        st = item.stat
        h.update(f"{item.rel}\0{stat.S_IFMT(st.st_mode)}\0{stat.S_IMODE(st.st_mode)}\0".encode())
        if stat.S_ISREG(st.st_mode):
            with context.open(item.path) as f:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
        elif stat.S_ISLNK(st.st_mode):
            h.update(context.readlink(item.path).encode())
    return h.hexdigest()


def _owner(node: BuildHost, layers: list[str], chown: str | None, line: int) -> tuple[int, int]:
    if not chown:
        return 0, 0
    user, _, group = chown.partition(":")
    view = layers_view(node, layers)
    uid = _id_of(view, user, "/etc/passwd", line)
    gid = _id_of(view, group, "/etc/group", line) if group else uid
    return uid, gid


def _id_of(view: View, name: str, table: str, line: int) -> int:
    """The uid or gid ``name`` stands for: a number, or its entry in ``table`` as the sandbox sees it."""
    if name.isdigit() and int(name) <= MAX_ID:
        return int(name)
    with _refusals(line):
        rows = (view.read(table) or b"").decode(errors="replace").splitlines()
    for row in rows:
        fields = row.split(":")
        if fields[0] == name and len(fields) > 2 and fields[2].isdigit() and int(fields[2]) <= MAX_ID:
            return int(fields[2])
    raise _fail(line, f"--chown: no {table.split('/')[-1]} entry {name!r}")


def _copy_into(
    target: View,
    context: View,
    files: list[Source],
    dest: str,
    owner: tuple[int, int],
    chmod: int | None,
    room: SpaceWatch,
) -> None:
    """Write ``files`` at ``dest`` in the top layer of ``target``, resolving every path as the
    sandbox will (links in the destination and the layers below followed inside the view). Each
    COPY writes its sources again: ``room`` stops it (507) at the disk headroom."""
    assert target.top is not None
    if not dest.endswith("/"):
        path = target.canonical(dest)
        if target.is_dir(path):  # COPY file /existing-dir puts the file in it, as Docker does
            path = posixpath.join(path, files[0].rel)
        room.before(target.top, _size(files[0]))
        _put(target, context, files[0], path, owner, chmod)
        return
    base = target.make_dir(dest, owner)
    for item in files:
        room.before(target.top, _size(item))
        _put(target, context, item, posixpath.join(base, item.rel), owner, chmod)


def _size(item: Source) -> int:
    return item.stat.st_size if stat.S_ISREG(item.stat.st_mode) else 0


def _put(target: View, context: View, item: Source, path: str, owner: tuple[int, int], chmod: int | None) -> None:
    mode = chmod if chmod is not None else stat.S_IMODE(item.stat.st_mode)
    if stat.S_ISDIR(item.stat.st_mode):
        target.make_dir(path, owner, (mode, *owner))
    elif stat.S_ISLNK(item.stat.st_mode):
        target.symlink(path, context.readlink(item.path), owner)
    else:
        with context.open(item.path) as f:
            target.write_file(path, f, mode, owner)
