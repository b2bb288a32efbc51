"""The runsc suite as two pytest processes at once: `./scripts/test --parallel [pytest args]`.

Most of the suite's time is spent waiting (sandboxes booting, etcd elections, leases running out,
deliberate outages), about half of one CPU: a second process on another half of the suite nearly
halves the wall time on two cores. Each half has its own session server and data dir, its own
slice of loopback ports (AENV_TEST_PORTS) and its own pytest temp dir; they share one snapshot
repository, the first half's, where `base` is committed before either starts (so it is built
once). The tests that look at the whole host (processes, mounts, loop devices) look under their
own paths only, so a half never sees the other's.

The second half's output goes to a file and is printed when both are done; the exit status is the
first failing half's. Arguments naming tests (paths, node ids) run one pytest as usual.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.conftest import DATA_DIR, prepare_base

# About half of the runsc tier's time: in a run of both halves at once the cluster's tests took
# 20.6 min and these others 4.5, against 25 min for everything else with tests/images (4.2);
# later 31.8 min against 49.6, so the desktop's (its template built: minutes) joined this half, and
# the microVM node's (~3 min); then 31.2 against 40.6 (the first half's time less a hang since
# fixed), so the E2B SDK's compatibility tests, the API's and the dashboard's (1.4, 1.0 and 0.4
# min) moved here. (The repository's stay: they collect and check the repository the halves share.)
SECOND_HALF = (
    "tests/cluster",
    "tests/teams",
    "tests/sdk",
    "tests/integrations",
    "tests/desktop",
    "tests/microvm",
    "tests/compat",
    "tests/api",
    "tests/dashboard",
)
# The fast tier's (`./scripts/test --fast --parallel`): on the fake runtime its time is CPU, not
# waiting, so the halves are even by time (CI's junit: 2.2 min of these, 2.9 of the rest) and each
# builds the fake `base` (the host's own files, seconds) on its own data dir.
FAST_SECOND_HALF = ("tests/security", "tests/node", "tests/cli", "tests/sdk")
NOTHING_COLLECTED = 5  # pytest's exit status
STOP_GRACE = 120  # seconds a half has to tear down its servers after an interrupt


def names_tests(args: list[str]) -> bool:
    return any(not a.startswith("-") and (a.startswith("tests") or "::" in a or a.endswith(".py")) for a in args)


def with_junit(args: list[str], suffix: str) -> list[str]:
    """``args`` with any ``--junitxml=PATH`` report renamed ``PATH-<suffix>.xml``."""
    out = []
    for a in args:
        if a.startswith("--junitxml=") and suffix:
            path = a.removeprefix("--junitxml=")
            stem = path.removesuffix(".xml")
            a = f"--junitxml={stem}-{suffix}.xml"
        out.append(a)
    return out


def pytest(args: list[str], env: dict[str, str], **kwargs: object) -> subprocess.Popen[bytes]:
    temp = tempfile.mkdtemp(prefix="aenv-pytest-")
    return subprocess.Popen([sys.executable, "-m", "pytest", f"--basetemp={temp}", *args], env=env, **kwargs)  # type: ignore[call-overload]


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)  # pytest tears its fixtures down: servers, etcd, sandboxes
        try:
            proc.wait(STOP_GRACE)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def one_process(args: list[str]) -> int:
    return subprocess.call([sys.executable, "-m", "pytest", *args])


def main(args: list[str]) -> int:
    if names_tests(args):
        return one_process(args)
    fast = os.environ.get("AENV_DRIVER") == "fake"  # the fast tier (scripts/test --fast)
    halves = FAST_SECOND_HALF if fast else SECOND_HALF
    given = os.environ.get("AENV_TEST_DATA_DIR", "/var/tmp/aenv-test")
    env_first = {**os.environ, "AENV_TEST_PORTS": "0/2"}
    env_second = {**os.environ, "AENV_TEST_PORTS": "1/2", "AENV_TEST_DATA_DIR": f"{given}-b"}
    if not fast:
        try:
            prepare_base(DATA_DIR)
        except RuntimeError as exc:
            print(f"`base` is not ready ({exc}); running the suite in one process", flush=True)
            return one_process(args)
        env_second["AENV_TEST_REPO"] = str(DATA_DIR / "repo")
    log = Path(f"{given}-b{'-fast' if fast else ''}-pytest.log")
    ignore = [f"--ignore={d}" for d in halves]
    print(f"second half ({', '.join(halves)}) in another process; its output: {log}", flush=True)
    with open(log, "wb") as out:
        second = pytest([*with_junit(args, "b"), *halves], env_second, stdout=out, stderr=subprocess.STDOUT)
        try:
            first = pytest([*args, *ignore], env_first)
            try:
                first_rc = first.wait()
            finally:
                stop(first)
            second_rc = second.wait()
        finally:
            stop(second)
    print(f"\n===== second half: {' '.join(halves)} =====", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    print(f"\nfirst half: exit {first_rc}; second half: exit {second_rc}", flush=True)
    return ran(first_rc) or ran(second_rc)


def ran(rc: int) -> int:
    return 0 if rc == NOTHING_COLLECTED else rc  # a half the -m expression left empty did no harm


def interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the halves are stopped (and their servers torn down) on the way out


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, interrupted)
    # A job started in the background (`cmd &` in a script) begins with SIGINT ignored, and an
    # ignored signal stays ignored across exec: the halves (and the tests that send themselves a
    # Ctrl-C) must get it, and stop() sends it.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.exit(main(sys.argv[1:]))
