"""What `base`'s setup gives every sandbox's shell: a login shell's PATH for the user and for root,
set without a process of its own (E2B's SDKs run each command as `bash -l -c`)."""

from __future__ import annotations

import pytest
from e2b import Sandbox

pytestmark = pytest.mark.sandbox

USER_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/local/games:/usr/games"
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


def test_a_login_shell_sets_path_without_asking_id(sandbox: Sandbox) -> None:
    assert sandbox.commands.run("echo $PATH").stdout.strip() == USER_PATH
    assert sandbox.commands.run("echo $PATH", user="root").stdout.strip() == ROOT_PATH
    # sh (dash) has no $EUID: it still asks id, and gets the same PATH.
    assert sandbox.commands.run("env -i sh -c '. /etc/profile; echo $PATH'").stdout.strip() == USER_PATH
    assert sandbox.commands.run("env -i sh -c '. /etc/profile; echo $PATH'", user="root").stdout.strip() == ROOT_PATH
    # What a login shell runs: no `id` among it (each process costs ~25 ms under gVisor).
    traced = sandbox.commands.run("bash -l -x -c true 2>&1").stdout
    assert "id -u" not in traced and "-eq 0" in traced, traced[-2000:]
