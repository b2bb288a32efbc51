"""Best-of-N on a SWE-style task: a small repository with failing tests, N attempts at a fix from
one prepared sandbox, each scored by the tests it passes; the best attempt is kept, the rest killed.

    AENV_URL=http://127.0.0.1:3000 AENV_API_KEY=... python examples/best_of_n_swe.py [--log best.jsonl]

The attempts are canned patches standing in for an agent's; the scoring is real: each child runs
the repository's tests (a scoring command: it may run in the grace period after a timeout).
"""

from __future__ import annotations

import argparse
import json
import uuid

from aenv.sdk import Client, Sandbox, best_of_n

REPO = "/home/user/repo"
CALC = """\
def add(a, b):
    return a - b


def mean(values):
    return sum(values) / (len(values) + 1)


def clamp(x, low, high):
    return max(low, min(x, high))
"""
TESTS = """\
import unittest

from calc import add, clamp, mean


class TestCalc(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_add_negative(self):
        self.assertEqual(add(-2, -3), -5)

    def test_mean(self):
        self.assertEqual(mean([1, 2, 3]), 2)

    def test_clamp_low(self):
        self.assertEqual(clamp(-5, 0, 10), 0)

    def test_clamp_high(self):
        self.assertEqual(clamp(50, 0, 10), 10)
"""
# Prints how many tests pass, as its last line: the score.
SCORE = """\
import sys, unittest
sys.path.insert(0, ".")
result = unittest.TextTestRunner(verbosity=0).run(unittest.defaultTestLoader.discover(".", "test_*.py"))
print(result.testsRun - len(result.failures) - len(result.errors))
"""
# What N attempts of an agent did (each a shell command run in its own child).
ATTEMPTS = [
    "true",  # gave up
    "sed -i 's/return a - b/return a + b/' calc.py",  # fixed add only
    "sed -i 's/return a - b/return a + b/; s/(len(values) + 1)/len(values)/' calc.py",  # fixed both
    "echo 'def add(a, b) return a + b' > calc.py",  # broke the module
]


def attempt(child: Sandbox) -> int:
    index = int(child.info().metadata["child"])
    return child.exec(ATTEMPTS[index % len(ATTEMPTS)], cwd=REPO).exit_code


def main(n: int, log: str | None) -> None:
    with Client() as client:
        task = client.create(timeout=300, grace=60, metadata={"example": "best-of-n", "run": uuid.uuid4().hex[:8]})
        try:
            task.write(f"{REPO}/calc.py", CALC)
            task.write(f"{REPO}/test_calc.py", TESTS)
            task.write(f"{REPO}/score.py", SCORE)
            # -B: no bytecode cache. CPython trusts a cached .pyc while its source keeps the same size
            # and whole-second mtime, so an attempt's same-size edit made within the second of this
            # run would be scored on the old code.
            before = task.exec(["python3", "-B", "score.py"], cwd=REPO).stdout.split()[-1]
            print(f"before: {before} of 5 tests pass")
            found = best_of_n(task, n, attempt, f"cd {REPO} && python3 -B score.py 2>/dev/null")
            with found.sandbox as best:  # killed at the end of the block
                for b in found.branches:
                    print(f"attempt {b.index}: {b.score:.0f} of 5 tests pass")
                print(f"best: attempt {found.best.index} with {found.score:.0f} of 5")
                print(best.read(f"{REPO}/calc.py").decode())
                if log:
                    with open(log, "w", encoding="utf-8") as out:
                        for entry in best.rollout_log():
                            out.write(json.dumps(entry) + "\n")
                    print(f"its rollout log: {log}")
        finally:
            task.kill()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=4, help="attempts")
    parser.add_argument("--log", help="write the best attempt's rollout log (JSON lines) here")
    args = parser.parse_args()
    main(args.n, args.log)
