"""Helpers of the durable-pause tests (one node and across a cluster)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from e2b import Sandbox

# A counter held in a Python process's memory, written out for the test to read.
COUNTER = (
    "python3 -c 'import time\n"
    "i = 0\n"
    "while True:\n"
    "    i += 1\n"
    '    open("/home/user/count", "w").write(str(i))\n'
    "    time.sleep(0.2)'"
)


def count(sbx: Sandbox) -> int:
    """What the sandbox's counter process last wrote to /home/user/count."""
    for _ in range(50):
        out = sbx.commands.run("cat /home/user/count").stdout.strip()
        if out:
            return int(out)
        time.sleep(0.1)
    raise AssertionError("the counter wrote nothing")


def wait_for(check: Callable[[], Any], seconds: float = 60) -> Any:
    """The first truthy result of ``check``, polled until ``seconds`` have passed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        time.sleep(0.3)
    raise AssertionError(f"not within {seconds}s")
