"""Stopping a fork bomb before the host stops the whole sandbox, and every process before a pause
that keeps no memory.

RLIMIT_NPROC caps the tasks of each user inside the sandbox, but under runsc's ptrace platform
what a process costs on the host is not bounded by it: every guest process has a stub process on
the host, which gets a thread for each sentry thread that ever ran it, and runsc keeps the stubs
of exited processes for reuse. A bomb that holds a user at its limit therefore keeps growing the
sandbox's host task count (measured: a bomb at 256 tasks added ~200 host tasks a second, at 512
~600) until the host pids cgroup refuses a thread and the sentry dies. The node watches that
count; near the limit it asks the agent to contain the sandbox, and the agent kills every process
of each user that is at its process limit, as the OOM killer would: that user's processes can no
longer fork anyway. Root is never killed here (the agent is root): a root bomb may cost its own
sandbox, never the host (aenv.runtime.gvisor.host_tasks_limit).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from aenv.guest.processes import others_alive

AT_LIMIT = 0.9  # a user holding this share of its task limit is the runaway
# Each kill(-1) reaches the processes that existed when it began, and a signalled process may
# still finish a fork in flight: a few rounds, a moment apart. Stopped processes cannot fork, so
# the stop rounds leave nothing running for the kill rounds to miss.
STOP_ROUNDS = 10
KILL_ROUNDS = 3
ROUND_PAUSE = 0.02


def processes_by_user() -> dict[int, int]:
    """How many processes each user has (a fork bomb's are processes: threads are cheap)."""
    owners: dict[int, int] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                uid = os.stat(f"/proc/{name}").st_uid
            except OSError:
                continue  # gone meanwhile
            owners[uid] = owners.get(uid, 0) + 1
    return owners


def contain(nproc: int) -> dict[str, int]:
    """Kill the processes of every non-root user at its process limit; {uid: processes it had}."""
    runaways = {uid: n for uid, n in processes_by_user().items() if uid != 0 and n >= nproc * AT_LIMIT}
    for uid in runaways:
        worker = threading.Thread(target=_kill_all_of, args=(uid,), name="contain", daemon=True)
        worker.start()
        worker.join()
    return {str(uid): n for uid, n in runaways.items()}


def _kill_all_of(uid: int) -> None:
    """kill(-1) as ``uid``: the kernel signals every process of that user (never the agent, which
    is PID 1 and the caller) in one call, however fast they fork. Stopped first, as stopped
    processes cannot fork. Only this thread takes the user's ids (a raw setresuid: glibc's would
    change every thread of the agent), on a thread of its own that ends right after."""
    import ctypes  # the agent's spawner has loaded it already

    setresuid = SYS_SETRESUID.get(os.uname().machine)
    libc = ctypes.CDLL(None, use_errno=True)
    if setresuid is None or libc.syscall(setresuid, uid, uid, 0) != 0:
        return
    try:
        for sig, rounds in ((signal.SIGSTOP, STOP_ROUNDS), (signal.SIGKILL, KILL_ROUNDS)):
            for _ in range(rounds):
                if not _kill_every(sig):
                    break
                time.sleep(ROUND_PAUSE)
    finally:
        if libc.syscall(setresuid, 0, 0, 0) != 0:  # back to root (the saved id), or else
            os._exit(70)  # never leave a thread of the agent with another user's ids


def _kill_every(sig: int) -> bool:
    """Whether any process was there to signal."""
    try:
        os.kill(-1, sig)
    except ProcessLookupError:
        return False
    return True


def end_every_process(wait_s: float) -> None:
    """Kill every process but the agent (PID 1, the caller) and wait, at most ``wait_s``, until each
    has exited: a pause that keeps no memory syncs the file system after this, so nothing writes
    to it any more. An exited child is a zombie until the agent reaps it; its files are closed."""
    for sig, rounds in ((signal.SIGSTOP, STOP_ROUNDS), (signal.SIGKILL, KILL_ROUNDS)):
        for _ in range(rounds):
            if not _kill_every(sig):
                break
            time.sleep(ROUND_PAUSE)
    deadline = time.monotonic() + wait_s
    while others_alive() and time.monotonic() < deadline:
        _kill_every(signal.SIGKILL)
        time.sleep(ROUND_PAUSE)


SYS_SETRESUID = {"x86_64": 117, "aarch64": 147}
