"""A GRPO group by fork: one prepared task, G rollouts from its exact state, a reward for each
from a scoring command, and the group-relative advantages a GRPO update would use.

    AENV_URL=http://127.0.0.1:3000 AENV_API_KEY=... python examples/grpo_fork.py [--group 8]

The task is prepared once (its files written, its state built), then forked: every rollout starts
from the same memory, processes and files, so the group differs only by what the policy did. Here
the "policy" is a list of canned shell attempts standing in for a model's samples.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import uuid

from aenv.sdk import AsyncClient, AsyncSandbox, fork_group

NUMBERS = "\n".join(str(n) for n in (3, 14, 15, 92, 65, 35)) + "\n"
# The verifier: 1.0 for the right sum, 0.5 for a number off by one line's worth, else 0.0.
REWARD = """\
import pathlib
numbers = [int(x) for x in pathlib.Path("/home/user/numbers.txt").read_text().split()]
try:
    answer = int(pathlib.Path("/home/user/answer.txt").read_text().strip())
except (OSError, ValueError):
    answer = None
print(1.0 if answer == sum(numbers) else 0.5 if answer is not None and sum(numbers) - answer in numbers else 0.0)
"""
# What the policy's samples did (in training: a model's tool calls).
ATTEMPTS = [
    "python3 -c 'import sys; print(sum(map(int, open(\"/home/user/numbers.txt\").read().split())))' > answer.txt",
    "head -n 5 numbers.txt | python3 -c 'import sys; print(sum(map(int, sys.stdin.read().split())))' > answer.txt",
    "wc -l < numbers.txt > answer.txt",
    "awk '{s += $1} END {print s}' numbers.txt > answer.txt",
]


async def rollout(child: AsyncSandbox, attempt: str) -> float:
    await child.exec(attempt, cwd="/home/user")
    scored = await child.exec(["python3", "/home/user/reward.py"], scoring=True, check=True)
    return float(scored.stdout.strip())


async def main(group: int) -> None:
    run = uuid.uuid4().hex[:8]
    async with AsyncClient() as client:
        # grace: a rollout that runs out of time can still be scored (exec(..., scoring=True))
        task = await client.create(timeout=300, grace=30, metadata={"example": "grpo", "run": run})
        try:
            await task.write("/home/user/numbers.txt", NUMBERS)
            await task.write("/home/user/reward.py", REWARD)
            labels = [{"sample": str(i)} for i in range(group)]
            async with fork_group(task, group, metadata=labels) as rollouts:
                rewards = await asyncio.gather(
                    *(rollout(child, ATTEMPTS[i % len(ATTEMPTS)]) for i, child in enumerate(rollouts))
                )
                mean, std = statistics.fmean(rewards), statistics.pstdev(rewards)
                for i, reward in enumerate(rewards):
                    advantage = (reward - mean) / (std + 1e-6)
                    print(f"sample {i}: reward {reward:.1f} advantage {advantage:+.2f}")
                print(f"group of {group}: mean reward {mean:.3f}, std {std:.3f}")
                log = await rollouts[0].rollout_log()  # the trajectory: commands, output, exit codes
                print(f"sample 0's rollout log: {len(log)} commands, last exit code {log[-1]['exitCode']}")
        finally:
            await task.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8, help="rollouts per prompt (G)")
    asyncio.run(main(parser.parse_args().group))
