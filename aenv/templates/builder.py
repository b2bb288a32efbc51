"""Template builds: boot layers, run steps as root inside a sandbox, commit a template snapshot.

The committed template is (layers, checkpoint image): creating a sandbox from it is a restore.
The built-in `base` template starts from a Debian root filesystem made by debootstrap from
Debian's own packages.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import os
import re
import stat
import time
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from aenv.channel import END, MSG, end_error
from aenv.errors import AenvError, OperationTimeout, RuntimeFailure
from aenv.node.service import AgentLink, BuildHost, LiveSandbox, TemplateRecord, build_guest
from aenv.runtime import hostexec
from aenv.runtime.base import OWN_BASE, Instance, Limits, OwnBase
from aenv.runtime.guestbundle import COMPAT_LIB, SUDO
from aenv.storage.datadir import sandbox_dir
from aenv.storage.layers import new_id
from aenv.storage.mounts import unmount_under
from aenv.teams.model import team_of_new
from aenv.templates.catalog import retire_builds

LogFn = Callable[[str], None]
T = TypeVar("T")
OUTPUT_TAIL = 64 * 1024  # characters of a command's output kept for its error message
BUILD_LIMITS = Limits(cpu_count=2.0, memory_mb=4096, nproc=8192, disk_mb=16384)
DEBOOTSTRAP_TIMEOUT = 1800.0
DEBOOTSTRAP_ATTEMPTS = 3  # a mirror's fetch fails now and then: the whole debootstrap again, on an empty target
DEBOOTSTRAP_RETRY_AFTER = 10.0  # seconds before the second attempt, doubled for each further one
KEPT_TARGET_LOG = 1 << 20  # bytes of a failed target's own debootstrap.log kept in the build's log
OUTPUT_TAIL_LINES, OWN_TAIL_LINES = 10, 15  # of a failed attempt's output and its own log, quoted by the error
OWN_LOG_HEADER = "== its debootstrap/debootstrap.log"
BASE_PACKAGES = [
    "bash",
    "coreutils",
    "procps",
    "python3",
    "python3-pip",
    "python3-venv",
    "git",
    "curl",
    "ca-certificates",
    "build-essential",
    "sudo",
    "less",
    "iproute2",
]
BASE_SETUP = f"""
set -eu
echo {COMPAT_LIB} > /etc/ld.so.preload
id -u user >/dev/null 2>&1 || useradd --create-home --uid 1000 --shell /bin/bash user
echo 'user ALL=(ALL) NOPASSWD:ALL' > /etc/sudoers.d/user && chmod 0440 /etc/sudoers.d/user
# setuid never works under gVisor (no_new_privs): the agent runs sudo's commands (aenv.guest.sudo)
dpkg-divert --quiet --local --rename --divert /usr/bin/sudo.setuid --add /usr/bin/sudo
ln -s {SUDO} /usr/bin/sudo
mkdir -p /run/e2b /home/user && chown user:user /home/user
ln -sf python3 /usr/bin/python  # E2B's base has both, as Debian's python-is-python3 makes it
# E2B's SDKs run every command as `bash -l -c`: the login shell's /etc/profile asks `id -u` (a
# process per command, ~25 ms of its ~65 under gVisor) what bash has in $EUID already; sh asks still.
sed -i 's/"$(id -u)"/"${{EUID:-$(id -u)}}"/g' /etc/profile
echo sandbox > /etc/hostname
echo '127.0.0.1 localhost sandbox' > /etc/hosts
echo '::1 localhost ip6-localhost' >> /etc/hosts
apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
"""
# Names the setup `base` was committed with: a node whose setup steps changed recommits it.
BASE_DESCRIPTION = f"Debian with aenv's setup {hashlib.sha256(BASE_SETUP.encode()).hexdigest()[:12]}"


@dataclass
class StartCommand:
    """A template's start command (CMD/ENTRYPOINT): running when the template is committed."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    user: str
    settle_s: float = 1.0  # how long it gets to come up before the checkpoint, without a ready check
    ready: list[str] | None = None  # run until it exits 0 before the checkpoint (E2B's readyCmd)
    ready_timeout_s: float = 120.0

    def record(self) -> dict[str, Any]:
        """What a template keeps of it: a sandbox that boots fresh (resumed after a pause that kept
        no memory) starts it again (see aenv.node.instances.start_command)."""
        return {"argv": list(self.argv), "env": dict(self.env), "cwd": self.cwd, "user": self.user}

    async def launch(self, link: AgentLink, log: LogFn) -> None:
        log(f"start command: {' '.join(self.argv)}")
        failure = await link.start_detached(self.argv, self.env, self.cwd, self.user)
        if failure:
            raise BuildFailed(f"start command failed: {failure}", step=0, output="")
        if self.ready is None:
            await asyncio.sleep(self.settle_s)
            return
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            ran = await run_process(link, self.ready, env=self.env, cwd=self.cwd, user=self.user)
            if ran.code == 0:
                log("ready check passed")
                return
            if time.monotonic() > deadline:
                raise BuildFailed(f"ready check did not pass in {self.ready_timeout_s:.0f}s", step=0, output=ran.output)
            await asyncio.sleep(0.5)


class BuildFailed(AenvError):
    def __init__(self, message: str, *, step: int, output: str) -> None:
        super().__init__(message, status=400)  # the recipe failed, not the node
        self.step = step
        self.output = output


def host_debian_mirror() -> str:
    """The Debian mirror this host's apt uses (package registries are all we can reach)."""
    candidates: list[str] = []
    for path in sorted(Path("/etc/apt/sources.list.d").glob("*.sources")):
        text = path.read_text(errors="replace")
        for block in text.split("\n\n"):
            if re.search(r"^Suites:.*\b(bookworm|trixie|bullseye|stable)\b(?!-)", block, re.M):
                m = re.search(r"^URIs:\s*(\S+)", block, re.M)
                if m and "security" not in m.group(1):
                    candidates.append(m.group(1))
    sources = Path("/etc/apt/sources.list")
    if sources.exists():
        for line in sources.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) >= 3 and parts[0] == "deb" and "security" not in parts[1]:
                candidates.append(parts[1] if not parts[1].startswith("[") else parts[2])
    return candidates[0] if candidates else "http://deb.debian.org/debian"


async def run_in(link: AgentLink, script: str, *, user: str = "root", on_log: LogFn | None = None) -> Ran:
    """Run a bash script through the agent, streaming its output."""
    return await run_process(
        link, ["/bin/bash", "-c", script], env={"DEBIAN_FRONTEND": "noninteractive"}, user=user, on_log=on_log
    )


class Ran(NamedTuple):
    """How a command run through the agent went."""

    code: int  # its exit code; -1 when it did not exit (a signal, or it never started)
    output: str  # the tail of its output (all of it went to on_log)
    failure: str  # why it failed in envd's words ("exit status 9", "command failed: <code>: <why>"); "" if it did not


async def run_process(
    link: AgentLink,
    argv: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    user: str = "root",
    on_log: LogFn | None = None,
) -> Ran:
    """Run ``argv`` through the agent, streaming its output."""
    process: dict[str, Any] = {"cmd": argv[0], "args": argv[1:], "envs": dict(env or {})}
    if cwd:
        process["cwd"] = cwd
    stream = await link.open("process.start", {"process": process, "user": user})
    output: deque[str] = deque()  # the tail a failure reports; all of it went to on_log
    kept = 0
    code, status = -1, ""
    while True:
        item = await stream.recv()
        if item.kind == END:
            error = end_error(item.msg)
            if error is not None:  # refused (an unknown user) or cut short: as E2B's builder words it
                output.append(error.message)
                status = f"command failed: {error}"
            break
        text, ended = _process_event(item.msg if item.kind == MSG else None)
        if ended is not None:
            code, status = ended
        if text:
            output.append(text)
            kept += len(text)
            while kept - len(output[0]) >= OUTPUT_TAIL:
                kept -= len(output.popleft())
            if on_log:
                for line in text.splitlines():
                    on_log(line)
    return Ran(code, "".join(output), status if code != 0 else "")


def _process_event(msg: Any) -> tuple[str, tuple[int, str] | None]:
    """(output text, (exit code, status) if it ended) of one process.start event, as far as the
    agent's message is one."""
    event = msg.get("event") if isinstance(msg, dict) else None
    if not isinstance(event, dict):
        return "", None
    text = ""
    data = event.get("data")
    if isinstance(data, dict) and data:
        try:
            text = base64.b64decode(next(iter(data.values()))).decode(errors="replace")
        except (TypeError, ValueError):
            text = ""
    end = event.get("end")
    if not isinstance(end, dict):
        return text, None
    code = end.get("exitCode", -1)
    if isinstance(code, bool) or not isinstance(code, int):
        code = -1
    status = end.get("status")
    return text, (code, status[:200] if isinstance(status, str) and status else f"exit status {code}")


@asynccontextmanager
async def build_instance(
    node: BuildHost,
    layers: list[str],
    label: str,
    *,
    before_boot: Callable[[Path], Awaitable[None]] | None = None,
    limits: Limits = BUILD_LIMITS,
) -> AsyncIterator[tuple[AgentLink, Instance, str]]:
    """A build sandbox booted fresh on ``layers`` with a new upper: (link, instance, upper id).
    ``before_boot`` gets the new upper's root directory (the sandbox's "/", empty: nothing a
    sandbox wrote) to put files there first.

    It is killed on the way out; on an error its upper is removed too."""
    async with node.artifacts.using_layers(layers):  # a template's layers may be in the repository only
        upper = await node.files.new_upper(BUILD_LIMITS.disk_mb)
        await node.files.mount_lowers(layers)
        rootfs = node.rootfs(layers, upper)
        if before_boot is not None:
            try:
                await before_boot(sandbox_dir(rootfs.upper / "upper"))
            except BaseException:
                await node.files.remove(upper)
                raise
        instance = await node.driver.boot(instance_id=new_id(), rootfs=rootfs, limits=limits)
        egress = build_guest(label, node.settings.build_internet, node.settings.build_allow_out)
        link = AgentLink(label, serve=egress, ready_timeout=node.driver.boot_timeout)
        try:
            await link.booted(instance)
            yield link, instance, upper
        except BaseException:
            await _stop(node, instance)
            link.close(f"{label} failed")
            await node.files.remove(upper)
            raise
        await _stop(node, instance)
        link.close(f"{label} finished")


async def _stop(node: BuildHost, instance: Instance) -> None:
    """Stop a build sandbox so its upper can be sealed or removed now; runsc's own teardown (over
    a second on a host whose init reaps orphans late) goes on in the background."""
    try:
        await node.driver.halt(instance)
    finally:
        node.kill_later(instance)


async def seal(node: BuildHost, upper: str) -> str | None:
    """A build upper whose instance is gone becomes a read-only layer; None if nothing was written."""
    if node.files.is_empty(upper):
        await node.files.remove(upper)
        return None
    await node.files.make_read_only(upper)
    return upper


async def commit_template(
    node: BuildHost,
    *,
    name: str,
    layers: list[str],
    steps: list[str],
    env: dict[str, str] | None = None,
    start: StartCommand | None = None,
    description: str = "",
    user: str = "",
    workdir: str = "",
    on_log: LogFn | None = None,
    template_id: str = "",
    keep_first: bool = False,
    limits: dict[str, Any] | None = None,
) -> TemplateRecord:
    """Boot ``layers``, run ``steps`` as root, start ``start`` (it runs on in every sandbox made
    from the template: it is in the snapshot), checkpoint and commit a template named ``name``
    (with the id ``template_id``: an evicted image's template made again keeps its id).

    ``keep_first`` (an image's template, made for a create that waits): with no steps nor start
    command, and a runtime that checkpoints leaving an instance running, the template is
    snapshotted from the sandbox that create then takes (``BuildHost.first_sandboxes``) instead
    of a build sandbox that is stopped and restored."""
    log = on_log or (lambda line: None)
    firsts = node.first_sandboxes if keep_first and not steps and start is None else None
    first: LiveSandbox | None = None
    if firsts is not None:
        async with node.artifacts.using_layers(layers):
            first = await firsts.boot_first(layers)
        try:
            image, top = await firsts.snapshot_first(first)
        except BaseException:
            firsts.drop_first(first, "its template's snapshot failed")
            raise
    else:
        image, top = await _checkpoint_build(node, name, layers, steps, start, log, snapshot_limits(node, limits))
    try:
        rec = TemplateRecord(
            id=template_id or new_id(16),
            name=name,
            layers=[*layers, *([top] if top else [])],
            image=image,
            created_at=time.time(),
            env_vars=dict(env or {}),
            limits=dict(limits or {}),
            description=description,
            guest=node.driver.guest_key(),
            user=user,
            workdir=workdir,
            start=start.record() if start is not None else {},
            team=team_of_new(),
        )
        await retire_builds(node, name)
        await node.add_template(rec)
    except BaseException:
        if firsts is not None and first is not None:
            firsts.drop_first(first, "its template could not be committed")
        raise
    finally:
        node.files.release([top] if top else [])  # its record holds it now (or, failed, it is garbage)
    if firsts is not None and first is not None:
        firsts.offer_first(first, rec)
    log(f"template '{name}' committed ({len(rec.layers)} layers)")
    return rec


def snapshot_limits(node: BuildHost, template_limits: dict[str, Any] | None) -> Limits:
    """The size of the build sandbox a template's snapshot is taken of. Where the driver's image
    fixes the machine's size (a VM's RAM and vCPUs), every sandbox of the template has the size
    the build had, so it is the template's (its own limits over the node's defaults), as E2B's
    templates are; elsewhere the sandbox's limits are set at each restore: room to build."""
    if not node.driver.sized_by_image:
        return BUILD_LIMITS
    s, own = node.settings, template_limits or {}
    cpus, memory = own.get("cpu_count") or s.cpu_count, own.get("memory_mb") or s.memory_mb
    return dataclasses.replace(BUILD_LIMITS, cpu_count=float(cpus), memory_mb=int(memory))


async def _checkpoint_build(
    node: BuildHost,
    name: str,
    layers: list[str],
    steps: list[str],
    start: StartCommand | None,
    log: LogFn,
    limits: Limits = BUILD_LIMITS,
) -> tuple[str, str | None]:
    """Run a build sandbox of size ``limits`` through ``steps`` and ``start``, checkpoint it and
    stop it: (its image, its sealed upper, None if nothing was written)."""
    async with build_instance(node, layers, f"build-{name}", limits=limits) as (link, instance, upper):
        for i, step in enumerate(steps, 1):
            log(f"step {i}/{len(steps)}")
            ran = await run_in(link, step, on_log=log)
            if ran.code != 0:
                raise BuildFailed(f"step {i} failed: {ran.failure}", step=i, output=ran.output[-4000:])
        if start is not None:
            await start.launch(link, log)
        await link.freeze()
        image = new_id()
        try:
            await node.driver.checkpoint(instance, image_dir=node.files.image(image), leave_running=False)
        except BaseException:
            node.files.remove_image(image)
            raise
    return image, await seal(node, upper)


async def build_base(node: BuildHost, *, on_log: LogFn | None = None) -> TemplateRecord:
    """debootstrap a Debian root filesystem and commit it as the `base` template."""
    log = on_log or (lambda line: None)
    own = _own_base(node)
    if own is not None:  # the driver's own (the fake runtime: the host's system, bound read-only)
        layer_id, path = node.files.new_layer_dir()
        await asyncio.to_thread(own.write, path)
        return await commit_template(
            node, name="base", layers=[layer_id], steps=[], description=own.description, on_log=log
        )
    started = time.monotonic()
    layer_id = await debootstrap(node, log)
    log(f"root filesystem ready in {time.monotonic() - started:.0f}s")
    try:
        return await _commit_base(node, layer_id, log)
    except BaseException:  # no template holds it: the next start debootstraps anew
        await _unstoppable(node.files.remove(layer_id))
        raise


def _own_base(node: BuildHost) -> OwnBase | None:
    """The `base` the node's driver makes itself, if it does (then no debootstrap)."""
    driver = getattr(node, "driver", None)  # (a build host without a driver: only debootstrap)
    own: OwnBase | None = getattr(driver, "own_base", None)
    return own


async def debootstrap(node: BuildHost, log: LogFn) -> str:
    """A Debian root filesystem in a new layer; its id. A failed attempt (a mirror's fetch fails
    now and then) is made again from an empty target. Whatever way it ends (a failure, a
    timeout, a cancellation: a kill of the build or a stopping server), nothing it mounted stays
    mounted and a failed target is removed; its output and its own log are kept in
    ``<data-dir>/logs/debootstrap.log``, and the error quotes their last lines."""
    settings = node.settings
    mirror = settings.debian_mirror or host_debian_mirror()
    logs = settings.data_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    log_path = logs / "debootstrap.log"
    log_path.write_bytes(b"")  # this build's attempts only
    for attempt in range(1, DEBOOTSTRAP_ATTEMPTS + 1):
        layer_id, path = node.files.new_layer_dir()
        argv = [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(BASE_PACKAGES)}",
            settings.debian_suite,
            str(path),
            mirror,
        ]
        log(f"debootstrap {settings.debian_suite} from {mirror} (attempt {attempt} of {DEBOOTSTRAP_ATTEMPTS})")
        with open(log_path, "ab") as f:
            f.write(f"== attempt {attempt} of {DEBOOTSTRAP_ATTEMPTS}: {' '.join(argv)}\n".encode())
        out = os.open(log_path, os.O_WRONLY | os.O_APPEND)
        try:
            await hostexec.run(
                argv,
                timeout=DEBOOTSTRAP_TIMEOUT,
                stdout=out,
                stderr_file=log_path,
                umask=0o022,  # a root filesystem: its files are for every user of the sandbox
                contained=True,  # its proc, sys and devices never in the host's table, nor it past a kill
            )
            await _unstoppable(unmount_under(path))  # it unmounts what it mounted; sure is sure
            return layer_id
        except BaseException as exc:
            await _unstoppable(_discard_target(node, layer_id, path, log_path))
            if not isinstance(exc, RuntimeFailure | OperationTimeout):
                raise  # cancelled, or the node's own fault: not the mirror's
            tail = _log_tail(log_path)
            if isinstance(exc, OperationTimeout) or attempt == DEBOOTSTRAP_ATTEMPTS:
                kind = type(exc)
                raise kind(
                    f"{_headline(exc)} (attempt {attempt} of {DEBOOTSTRAP_ATTEMPTS}); "
                    f"the last lines of its output and its log ({log_path}):\n{tail}",
                    argv=argv,
                    stderr=tail,
                ) from exc
            delay = DEBOOTSTRAP_RETRY_AFTER * 2 ** (attempt - 1)
            log(f"{_headline(exc)}: trying again in {delay:.0f}s; its last lines:")
            for line in tail.splitlines()[-5:]:
                log(f"  {line}")
            await asyncio.sleep(delay)
        finally:
            os.close(out)
    raise AssertionError("unreachable")


async def _discard_target(node: BuildHost, layer_id: str, path: Path, log_path: Path) -> None:
    """Keep the end of a failed target's own log, unmount what was mounted in it, remove it."""
    kept = b""
    try:  # a regular file, no link followed: the target holds what Debian's packages made
        folder = os.open(path / "debootstrap", os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        try:
            fd = os.open("debootstrap.log", os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        finally:
            os.close(folder)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISREG(st.st_mode):
                f.seek(max(0, st.st_size - KEPT_TARGET_LOG))
                kept = f.read(KEPT_TARGET_LOG)
    except OSError:
        pass
    if kept:
        with open(log_path, "ab") as out:
            out.write(f"{OWN_LOG_HEADER}\n".encode() + kept + (b"" if kept.endswith(b"\n") else b"\n"))
    await unmount_under(path)
    await node.files.remove(layer_id)


def _log_tail(log_path: Path) -> str:
    """The last lines of the last attempt's output and of its own log, from the build's log."""
    with open(log_path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - 256 * 1024))
        text = f.read().decode(errors="replace")
    attempt = text.rsplit("\n== attempt ", 1)[-1]
    output, _, own = attempt.partition(f"\n{OWN_LOG_HEADER}\n")
    lines = [line[:300] for line in output.splitlines()[1:][-OUTPUT_TAIL_LINES:]] or ["(no output)"]
    if own:
        lines += ["-- its debootstrap/debootstrap.log:", *(line[:300] for line in own.splitlines()[-OWN_TAIL_LINES:])]
    return "\n".join(lines)


def _headline(exc: AenvError) -> str:
    """ "debootstrap failed (exit 1)", "debootstrap ... timed out after 1800.0s": what hostexec
    said, without the stderr line it appends."""
    return exc.message.split(": ", 1)[0]


async def _unstoppable(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` to its end even when cancelled meanwhile (cleanup that must not be cut
    short: mounts left behind); the cancellation is raised once it is done."""
    task = asyncio.ensure_future(coro)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                if task.cancelled():
                    raise
                result = task.result()
                break
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result


async def _commit_base(node: BuildHost, debian_layer: str, log: LogFn | None) -> TemplateRecord:
    return await commit_template(
        node, name="base", layers=[debian_layer], steps=[BASE_SETUP], description=BASE_DESCRIPTION, on_log=log
    )


async def image_runs_here(node: BuildHost, rec: TemplateRecord) -> bool:
    """Whether this node runs the template's memory image as it runs new sandboxes: an upgraded
    runsc does not restore what an older one wrote, and one written on another runsc platform
    restores there, not on the one this node chose. An image that cannot be had is as good as
    incompatible."""
    try:
        await node.artifacts.ensure_local(rec, only={rec.image})
    except AenvError:
        return False
    return node.driver.image_preferred(node.files.image(rec.image))


async def ensure_base(node: BuildHost, *, on_log: LogFn | None = None) -> TemplateRecord:
    """`base`, built on first use and recommitted when the guest agent or the setup steps changed.

    The agent inside a template's image is the one that was running at commit time; a new agent
    reaches sandboxes only through a new image. A recommit reruns the setup on the Debian root
    filesystem (the first layer) in seconds: no new debootstrap."""
    try:
        current = node.find_template("base")
    except AenvError:
        return await build_base(node, on_log=on_log)
    runs_here = await image_runs_here(node, current)
    own = _own_base(node)
    wanted = own.description if own is not None else BASE_DESCRIPTION
    if runs_here and current.guest == node.driver.guest_key() and current.description == wanted:
        return current
    if own is not None or current.description.endswith(OWN_BASE):  # a driver's own is made anew
        return await build_base(node, on_log=on_log)
    if not runs_here:
        changed = "runtime (runsc or its platform)"
    else:
        changed = "guest agent" if current.guest != node.driver.guest_key() else "setup of `base`"
    (on_log or (lambda line: None))(f"the {changed} changed: recommitting `base` on its existing root filesystem")
    return await _commit_base(node, current.layers[0], on_log)
