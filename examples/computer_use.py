"""A computer-use rollout group: one desktop prepared, forked into G rollouts that each look at the
screen, act with mouse and keyboard, and are scored by what the desktop then holds.

    AENV_URL=http://127.0.0.1:3000 AENV_API_KEY=... python examples/computer_use.py [--group 4]

E2B's Desktop SDK (``pip install e2b-desktop``) drives the desktops unchanged: it is pointed at
the aenv node (E2B_API_URL, E2B_SANDBOX_URL, E2B_API_KEY are set from AENV_URL and AENV_API_KEY).
aenv's own SDK forks the prepared desktop: every child starts with the terminal already open and
focused, as the source had it. The "policy" is a list of canned action plans standing in for a
model's samples; in training each step would send the screenshot to the model and act on its answer.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import time

from aenv.sdk import AsyncClient

TASK = "write the sum of 17 and 25 into /home/user/answer.txt using the terminal"
# What the policy's samples did: (keys typed, then keys pressed) per step.
PLANS = [
    [("echo $((17 + 25)) > answer.txt", "enter")],
    [("echo 42 > answer.txt", "enter")],
    [("echo 17+25 > answer.txt", "enter")],
    [("python3 -c 'print(17 + 25)' > answer.txt", "enter")],
]
REWARD = 'test "$(cat /home/user/answer.txt 2>/dev/null)" = 42 && echo 1.0 || echo 0.0'


def use_aenv_for_e2b() -> None:
    """E2B's SDKs find the node through their own environment variables."""
    url = os.environ.get("AENV_URL", "http://127.0.0.1:3000")
    os.environ.setdefault("E2B_API_URL", url)
    os.environ.setdefault("E2B_SANDBOX_URL", url)
    if "AENV_API_KEY" in os.environ:
        os.environ.setdefault("E2B_API_KEY", os.environ["AENV_API_KEY"])


def prepare() -> str:
    """A desktop with a terminal open and focused, in the user's home: the task's start."""
    from e2b_desktop import Sandbox

    desktop = Sandbox.create(timeout=600, metadata={"example": "computer-use"})
    desktop.commands.run(
        "xfce4-terminal --disable-server --title task --geometry 100x30+50+50", background=True, cwd="/home/user"
    )
    for _ in range(60):
        windows = desktop.commands.run("xdotool search --onlyvisible --name task || true").stdout.split()
        if windows:
            desktop.commands.run(f"xdotool windowactivate --sync {windows[0]}")
            return desktop.sandbox_id
        time.sleep(0.5)
    raise RuntimeError("the terminal did not open")


def rollout(sandbox_id: str, plan: list[tuple[str, str]]) -> tuple[float, int]:
    """Act on one child as a policy would (look, act), then score it: (reward, screenshot bytes)."""
    from e2b_desktop import Sandbox
    from PIL import Image

    desktop = Sandbox.connect(sandbox_id)
    seen = 0
    for text, key in plan:
        screen = desktop.screenshot()  # what the model would be shown
        seen += len(screen)
        Image.open(io.BytesIO(screen)).verify()
        desktop.write(text)
        desktop.press(key)
    time.sleep(1)
    reward = float(desktop.commands.run(REWARD).stdout.strip())
    return reward, seen


async def main(group: int) -> None:
    use_aenv_for_e2b()
    source = await asyncio.to_thread(prepare)
    async with AsyncClient() as client:
        task = await client.connect(source)
        try:
            children = await task.fork(group, metadata=[{"sample": str(i)} for i in range(group)])
            try:
                results = await asyncio.gather(
                    *(asyncio.to_thread(rollout, c.sandbox_id, PLANS[i % len(PLANS)]) for i, c in enumerate(children))
                )
            finally:
                await asyncio.gather(*(c.kill() for c in children))
        finally:
            await task.kill()
    print(f"task: {TASK}")
    for i, (reward, seen) in enumerate(results):
        typed = PLANS[i % len(PLANS)][0][0]
        print(f"rollout {i}: reward {reward:.1f} ({seen // 1024} KiB of screenshots seen): {typed}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=4)
    asyncio.run(main(parser.parse_args().group))
