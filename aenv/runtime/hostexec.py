"""Running host binaries from async code: argv lists, deadlines, captured stderr, one error type."""

from __future__ import annotations

import asyncio
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

from aenv.errors import OperationTimeout, RuntimeFailure

STDERR_KEPT = 64 * 1024  # enough for a Go panic and its stack
# A tool run in namespaces of its own: setpriv makes the kernel kill unshare when this process dies
# (even by SIGKILL), unshare then kills the namespace's first process, and with it the kernel ends
# every other; the mount namespace, and what the tool mounted in it, goes with its last process.
CONTAINED = (
    "setpriv",
    "--pdeathsig",
    "KILL",
    "unshare",
    "--mount",
    "--propagation",
    "private",
    "--pid",
    "--kill-child=KILL",
    "--",
)


async def run(
    argv: Sequence[str],
    *,
    timeout: float = 30.0,
    cwd: Path | None = None,
    stdin: int | None = asyncio.subprocess.DEVNULL,
    stdout: int | None = asyncio.subprocess.PIPE,
    check: bool = True,
    stderr_file: Path | None = None,
    umask: int = -1,
    contained: bool = False,
) -> str:
    """Run ``argv``; return stdout. Failures raise RuntimeFailure carrying argv and stderr.

    ``stderr_file`` sends stderr to a file instead of a pipe: `runsc run --detach` hands its
    stdio to the sandbox, so a pipe would never reach EOF. ``umask`` replaces the node's (077)
    for a tool that makes files sandboxes see (debootstrap). ``contained`` runs it in mount and
    PID namespaces of its own that die with this process (CONTAINED): what it mounts is never in
    the host's mount table, and nothing of it outlives a node killed without a chance to clean up.
    """
    err_fd = os.open(stderr_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if stderr_file else None
    start = stderr_file.stat().st_size if stderr_file else 0
    try:
        proc = await asyncio.create_subprocess_exec(
            *(CONTAINED if contained else ()),
            *argv,
            cwd=cwd,
            stdin=stdin,
            stdout=stdout,
            stderr=err_fd if err_fd is not None else asyncio.subprocess.PIPE,
            start_new_session=True,
            umask=umask,
        )
    except OSError as exc:
        raise RuntimeFailure(f"cannot run {argv[0]}: {exc}", argv=list(argv)) from exc
    finally:
        if err_fd is not None:
            os.close(err_fd)
    try:
        out, err = await asyncio.wait_for(proc.communicate(), timeout)
        if stderr_file is not None:
            with open(stderr_file, "rb") as f:
                f.seek(start)
                err = f.read()
    except TimeoutError as exc:
        await _kill(proc)
        raise OperationTimeout(
            f"{argv[0]} {argv[1] if len(argv) > 1 else ''} timed out after {timeout}s", argv=list(argv)
        ) from exc
    except BaseException:
        if proc.returncode is None:  # cancelled (a kill overtook the operation): it must not go on alone
            await _kill(proc)
        raise
    if check and proc.returncode != 0:
        text = (err or b"").decode(errors="replace").strip()
        raise RuntimeFailure(
            f"{Path(argv[0]).name} failed (exit {proc.returncode}): {text.splitlines()[-1] if text else ''}",
            argv=list(argv),
            stderr=text[-STDERR_KEPT:],
        )
    return (out or b"").decode(errors="replace")


async def _kill(proc: asyncio.subprocess.Process) -> None:
    try:
        os.killpg(proc.pid, 9)
    except ProcessLookupError:
        pass
    await proc.wait()


_libc = ctypes.CDLL(None, use_errno=True)  # the process's own libc: nothing is loaded

# What a sandbox or an image wrote is mounted on the host without setuid or device files, so a
# setuid-root binary or a device node that sandbox root made in its upper is inert on the host.
# Uppers' disk images are also noexec. A sandbox's root overlay cannot be: the sentry maps the
# files the gofer opens for it, executables included, and mmap(PROT_EXEC) fails on a noexec mount.
NOSUID_NODEV = ("nosuid", "nodev")
UNTRUSTED_FLAGS = (*NOSUID_NODEV, "noexec")
_MS_FLAGS = {"nosuid": 0x2, "nodev": 0x4, "noexec": 0x8}


async def mount(source: str, target: Path, fstype: str, options: str, *, flags: tuple[str, ...]) -> None:
    """mount(2) directly: a fork's N+1 overlay mounts each cost a `mount` process otherwise,
    on cores that the concurrent restores need."""
    bits = sum(_MS_FLAGS[f] for f in flags)

    def call() -> None:
        if _libc.mount(source.encode(), os.fsencode(target), fstype.encode(), bits, options.encode()) != 0:
            err = ctypes.get_errno()
            argv = ["mount", "-t", fstype, source, "-o", ",".join((*flags, options)), str(target)]
            raise RuntimeFailure(f"mount {target}: {os.strerror(err)}", argv=argv, stderr=os.strerror(err))

    await asyncio.to_thread(call)
