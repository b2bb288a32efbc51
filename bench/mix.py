"""A SWE-style step mix, timed phase by phase: the program `bench.workload` runs natively (chrooted
into the `base` template's root filesystem) and inside a sandbox. Stdlib only, Python >= 3.9: it
runs with whatever python3 the image has. Prints one JSON object: phase -> seconds.

`python3 mix.py WORKDIR [--wheels DIR] [--scale F]`: WORKDIR is made fresh; --wheels is a
directory of wheels (pytest and its dependencies) for the pytest and pip phases, which are left
out without it; --scale multiplies every phase's size (0.1 for a quick calibration).
"""

import json
import os
import shutil
import subprocess
import sys
import time

PHASES = []


def phase(fn):
    PHASES.append(fn)
    return fn


def n(base, scale):
    return max(1, int(base * scale))


@phase
def spawn(work, scale, wheels):
    """Tools spawned one after another, as an agent's shell steps do."""
    for _ in range(n(300, scale)):
        subprocess.run(["/bin/true"], check=True)


@phase
def python_start(work, scale, wheels):
    for _ in range(n(15, scale)):
        subprocess.run([sys.executable, "-c", "import json, asyncio, subprocess"], check=True)


@phase
def write(work, scale, wheels):
    """A repository's worth of small files, written in nested directories."""
    for i in range(n(3000, scale)):
        d = os.path.join(work, "repo", f"pkg{i % 30}", f"sub{i % 7}")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, f"mod{i}.py"), "w") as f:
            f.write(f"def f{i}(x):\n    return x + {i}  # needle {i % 10}\n" * 8)


@phase
def scan(work, scale, wheels):
    repo = os.path.join(work, "repo")
    subprocess.run(["find", repo, "-name", "*.py", "-newer", "/etc/hostname"], stdout=subprocess.DEVNULL)
    subprocess.run(["grep", "-rl", "needle 3", repo], stdout=subprocess.DEVNULL, check=True)
    subprocess.run(["du", "-s", repo], stdout=subprocess.DEVNULL, check=True)


@phase
def tar(work, scale, wheels):
    out = os.path.join(work, "repo.tar.gz")
    subprocess.run(["tar", "-czf", out, "-C", work, "repo"], check=True)
    dest = os.path.join(work, "untar")
    os.makedirs(dest)
    subprocess.run(["tar", "-xzf", out, "-C", dest], check=True)


@phase
def compileall(work, scale, wheels):
    subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(work, "repo")], check=True)


@phase
def git(work, scale, wheels):
    repo = os.path.join(work, "repo")
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="a",
        GIT_AUTHOR_EMAIL="a@b",
        GIT_COMMITTER_NAME="a",
        GIT_COMMITTER_EMAIL="a@b",
        HOME=work,
    )
    for argv in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "one"], ["status", "--short"]):
        subprocess.run(["git", "-C", repo, *argv], check=True, env=env, stdout=subprocess.DEVNULL)
    with open(os.path.join(repo, "pkg1", "sub1", "mod1.py"), "a") as f:
        f.write("# changed\n")
    for argv in (["diff", "--stat"], ["commit", "-qam", "two"], ["log", "--oneline"]):
        subprocess.run(["git", "-C", repo, *argv], check=True, env=env, stdout=subprocess.DEVNULL)


@phase
def cpu(work, scale, wheels):
    total = 0
    for i in range(n(3_000_000, scale)):
        total += i * i % 7
    return total


@phase
def stat(work, scale, wheels):
    paths = [os.path.join(work, "repo", f"pkg{i}") for i in range(30)]
    for i in range(n(150_000, scale)):
        os.stat(paths[i % 30])


@phase
def pip_install(work, scale, wheels):
    if not wheels:
        return "skipped"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-index",
            "--find-links",
            wheels,
            "--target",
            os.path.join(work, "site"),
            "--disable-pip-version-check",
            "--no-compile",
            "pytest",
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )


@phase
def pytest(work, scale, wheels):
    if not wheels:
        return "skipped"
    tests = os.path.join(work, "tests")
    os.makedirs(tests)
    for i in range(n(20, scale)):
        with open(os.path.join(tests, f"test_m{i}.py"), "w") as f:
            f.write("import pytest\n\n@pytest.mark.parametrize('k', range(15))\n")
            f.write("def test_sum(k):\n    assert sum(range(k)) == k * (k - 1) // 2\n\n")
            f.write(
                "def test_text(tmp_path):\n    (tmp_path / 'f').write_text('x')\n"
                "    assert (tmp_path / 'f').read_text() == 'x'\n"
            )
    env = dict(os.environ, PYTHONPATH=os.path.join(work, "site"))
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", os.path.join(work, "pt"), tests],
        check=True,
        env=env,
        stdout=subprocess.DEVNULL,
    )


def main(argv):
    work = argv[1]
    wheels = argv[argv.index("--wheels") + 1] if "--wheels" in argv else ""
    scale = float(argv[argv.index("--scale") + 1]) if "--scale" in argv else 1.0
    only = argv[argv.index("--only") + 1].split(",") if "--only" in argv else None
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    times = {}
    for fn in PHASES:
        if only and fn.__name__ not in only:
            continue
        start = time.perf_counter()
        if fn(work, scale, wheels) != "skipped":
            times[fn.__name__] = time.perf_counter() - start
    shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(times))


if __name__ == "__main__":
    main(sys.argv)
