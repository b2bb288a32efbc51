"""sudo inside sandboxes, through the real e2b SDK as E2B's `user`: gVisor's no_new_privs makes a
setuid sudo useless, so the agent runs the commands (aenv.guest.sudo). It must behave as sudo
does, keep working across checkpoints, and refuse everyone the policy does not name."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from aenv.guest.sudo import Refused, parse
from tests.conftest import Server
from tests.images.oci import Registry, busybox_layer, start_registry
from tests.node.test_isolation import run

pytestmark = pytest.mark.sandbox


def test_sudo_runs_commands_as_root_for_user(sandbox: Sandbox) -> None:
    assert run(sandbox, "whoami; sudo whoami") == (0, "user\nroot\n")
    code, out = run(sandbox, "sudo apt-get --version")
    assert code == 0 and out.startswith("apt "), out
    assert run(sandbox, "sudo -u nobody id -u") == (0, "65534\n")
    assert run(sandbox, "sudo --user=nobody -- id -un") == (0, "nobody\n")
    assert run(sandbox, "sudo sh -c 'exit 7'")[0] == 7
    assert run(sandbox, "echo hi | sudo cat") == (0, "hi\n")
    assert run(sandbox, "sudo -n true && sudo -k && sudo -v && echo fine") == (0, "fine\n")
    assert run(sandbox, "sudo touch /etc/made-by-sudo && stat -c %U /etc/made-by-sudo") == (0, "root\n")
    assert run(sandbox, "cd /tmp && sudo pwd") == (0, "/tmp\n")
    assert run(sandbox, "sudo -i pwd") == (0, "/root\n")
    assert run(sandbox, "sudo -s id -u") == (0, "0\n")
    env = "sudo sh -c 'echo $SUDO_USER $SUDO_UID $HOME $FOO'"
    assert run(sandbox, f"FOO=kept {env}") == (0, "user 1000 /root\n")  # env_reset
    assert run(sandbox, f"FOO=kept {env.replace('sudo', 'sudo -E')}") == (0, "user 1000 /home/user kept\n")
    assert run(sandbox, "sudo FOO=set sh -c 'echo $FOO'") == (0, "set\n")
    code, out = run(sandbox, "sudo no-such-command")
    assert code == 1 and "no-such-command: command not found" in out
    code, out = run(sandbox, "sudo -u no-such-user true")
    assert code == 1 and "unknown user no-such-user" in out
    code, out = run(sandbox, "sudo -Z true")
    assert code == 1 and "invalid option" in out
    # root may sudo too, and a target user runs in a directory it could not enter, as with sudo
    assert run(sandbox, "cd /root && sudo -u user id -un", user="root") == (0, "user\n")


def test_sudo_dies_as_its_command_and_takes_it_down(sandbox: Sandbox) -> None:
    """Signals to the client reach the command; the client ends as the command ended; killing
    the client kills the command."""
    command = "sh -c 'trap \"echo caught; exit 3\" INT; sleep 60 >/dev/null 2>&1 & wait'"
    trap = f"sudo {command} & pid=$!; sleep 1; kill -INT $pid; wait $pid"
    assert sandbox.commands.run(f"{trap}; echo status $?", timeout=30).stdout == "caught\nstatus 3\n"
    term = "sudo sleep 60 & pid=$!; sleep 1; kill -TERM $pid; wait $pid; echo status $?"
    assert sandbox.commands.run(term, timeout=30).stdout == "status 143\n"  # died of SIGTERM, as its command
    handle = sandbox.commands.run("sudo sleep 300", background=True)
    time.sleep(1)
    running = "pgrep -u root -f 'sleep 300'"
    assert run(sandbox, running)[0] == 0
    handle.kill()  # the agent SIGKILLs the client's session; the client's death ends the command
    deadline = time.monotonic() + 10
    while run(sandbox, running)[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert run(sandbox, running)[0] == 1


def test_sudo_refuses_who_the_policy_does_not_name(sandbox: Sandbox) -> None:
    assert run(sandbox, "useradd -m intruder", user="root")[0] == 0
    code, out = run(sandbox, "sudo whoami", user="intruder")
    assert code == 1 and "intruder is not in the sudoers file" in out
    # A client cannot claim someone else's ids (the sentry checks SCM_CREDENTIALS), and a request
    # without them is refused.
    forge = (
        "import os, socket, struct\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(b'\\0aenv-sudo')\n"
        "creds = [(socket.SOL_SOCKET, socket.SCM_CREDENTIALS, struct.pack('3i', os.getpid(), 0, 0))]\n"
        "try:\n"
        "    s.sendmsg([b'x'], creds); print('forged')\n"
        "except PermissionError:\n"
        "    print('refused')\n"
        "s = socket.socket(socket.AF_UNIX); s.connect(b'\\0aenv-sudo')\n"
        "fds = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack('3i', 0, 1, 2))]\n"
        "body = b'aenv-sudo/1\\0/\\0' + b'2\\0sudo\\0id\\0'\n"
        "s.sendmsg([struct.pack('<I', len(body))], fds); s.sendall(body)\n"
        "print(s.recv(4096))\n"
    )
    sandbox.files.write("/tmp/forge.py", forge)
    code, out = run(sandbox, "python3 /tmp/forge.py", user="intruder")
    assert code == 0 and out.startswith("refused\n"), out
    # Refused (uncertified ids read as the overflow uid, nobody), and `id` never ran on its stdout
    assert "no credentials" in out or "is not in the sudoers file" in out, out
    assert "uid=" not in out, out


def test_the_sudo_socket_is_the_sandbox_s_own(sandbox: Sandbox, server: Server) -> None:
    """It is in the sandbox's kernel: the host has no such socket, and root through sudo is the
    sandbox's root, confined like any other."""
    probe = socket.socket(socket.AF_UNIX)
    with pytest.raises(OSError):
        probe.connect(b"\0aenv-sudo")
    probe.close()
    code, out = run(sandbox, f"sudo ls {server.data_dir}")
    assert code != 0 and "No such file" in out
    assert run(sandbox, "sudo cat /proc/version")[1].startswith("Linux version 4.4.0")  # gVisor's kernel


def test_sudo_after_resume_and_in_fork_children(e2b_env: Server, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=300)
    children: list[str] = []
    try:
        assert run(sbx, "sudo whoami") == (0, "root\n")
        assert sbx.pause()
        sbx = Sandbox.connect(sbx.sandbox_id)
        assert run(sbx, "sudo whoami; echo hi | sudo cat") == (0, "root\nhi\n")
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 2})
        assert r.status_code == 201, r.text
        children = [item["sandbox"]["sandboxID"] for item in r.json()]
        for child in children:
            assert run(Sandbox.connect(child), "sudo -u nobody id -u; sudo sh -c 'exit 5'") == (5, "65534\n")
        assert run(sbx, "sudo id -u") == (0, "0\n")
    finally:
        for child in children:
            api.delete(f"/sandboxes/{child}")
        sbx.kill()


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


def test_sudo_in_a_template_from_an_image(registry: Registry, api: httpx.Client, e2b_env: Server) -> None:
    """An image without sudo or glibc (busybox) gets the client too: it runs on the bundle's loader."""
    registry.push_image("tests/sudo-bb", "1", [(busybox_layer().bytes(), "gzip")], config={"User": "user"})
    r = api.post("/templates/from-image", json={"name": "sudo-bb", "image": f"{registry.host}/tests/sudo-bb:1"})
    assert r.status_code == 201, r.text
    sbx = Sandbox.create(template="sudo-bb", timeout=120)
    try:
        assert run(sbx, "id -u; /usr/bin/sudo id -u; /usr/bin/sudo -u user id -u") == (0, "1000\n0\n1000\n")
    finally:
        sbx.kill()
        api.delete("/templates/sudo-bb")


@pytest.mark.parametrize(
    ("argv", "flags", "user", "assignments", "command"),
    [
        (["-nEu", "nobody", "id"], {"n", "E"}, "nobody", {}, ["id"]),
        (["-unobody", "--", "-x"], set(), "nobody", {}, ["-x"]),
        (["--user=#65534", "--login"], {"i"}, "#65534", {}, []),
        (["--user", "nobody", "A=1", "B=x=y", "env", "C=2"], set(), "nobody", {"A": "1", "B": "x=y"}, ["env", "C=2"]),
        (["-k", "ls", "-l"], {"k"}, "root", {}, ["ls", "-l"]),
    ],
)
def test_sudo_options_parse_as_sudo_reads_them(
    argv: list[str], flags: set[str], user: str, assignments: dict[str, str], command: list[str]
) -> None:
    opts = parse(argv)
    assert (opts.flags, opts.user, opts.assignments, opts.command) == (flags, user, assignments, command)


@pytest.mark.parametrize("argv", [["-Z"], ["-u"], ["--frobnicate"], ["--user"]])
def test_sudo_refuses_bad_options(argv: list[str]) -> None:
    with pytest.raises(Refused) as refused:
        parse(argv)
    assert refused.value.code == 1 and "usage: sudo" in refused.value.err
