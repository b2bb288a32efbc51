"""A node on the qemu driver (AENV_DRIVER=qemu, TCG here): the node's whole lifecycle with each
sandbox in a microVM of its own kernel, driven by the official E2B SDK and aenv's, as users would.
Same tests as for gVisor where the driver-neutral contract is concerned (create from a template's
image, pause keeping a process, snapshot leaving the source running, fork children diverging), and
what only a VM gives (its own kernel; a memory hog or a fork bomb ends inside its VM).

The template is busybox from a local OCI layout (nothing to debootstrap): its build boots one VM and
checkpoints it; every create restores that image. Marked `sandbox` (root, QEMU, a Debian kernel from
scripts/install); in the runsc tier's second half."""

from __future__ import annotations

import http.server
import os
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from aenv.runtime import guestbundle, qemu, vmboot
from tests.conftest import Server, e2b_client, start_busybox_node
from tests.node.test_egress import host_address

TEMPLATE = "bb"


pytestmark = [pytest.mark.sandbox, *([pytest.mark.skip(reason=why)] if (why := qemu.unmet()) else [])]


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    env = {"AENV_DRIVER": "qemu", "AENV_QEMU_ACCEL": "tcg", "AENV_WARM_POOL": "0"}
    srv = start_busybox_node(tmp_path_factory.mktemp("qemu-node") / "data", env)
    yield srv
    srv.stop()


@pytest.fixture()
def api(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    yield from e2b_client(node, monkeypatch, empty_after=True)


COUNTER = "(i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done) >/dev/null 2>&1 &"


def counting(sbx: object) -> int:
    for _ in range(50):
        out = sbx.commands.run("cat /tmp/count").stdout  # type: ignore[attr-defined]
        if out.strip():  # (read between the shell's truncation and its write: again)
            return int(out)
    raise AssertionError("the counting process stopped writing")


def rises(sbx: object, above: int) -> int:
    for _ in range(100):
        now = counting(sbx)
        if now > above:
            return now
        time.sleep(0.1)
    raise AssertionError(f"the counting process is stuck at {above}")


def test_health_says_microvm_and_its_accelerator(api: httpx.Client) -> None:
    runtime = api.get("/health").json()["runtime"]
    assert runtime["driver"] == "qemu"
    assert runtime["platform"] == "qemu microvm (tcg)"


def test_a_sandbox_is_a_vm_restored_from_its_template(api: httpx.Client) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(TEMPLATE)
    try:
        ran = sbx.commands.run("uname -r; busybox tr '\\0' ' ' < /proc/1/cmdline; echo; echo hi > /tmp/x; cat /tmp/x")
        lines = ran.stdout.splitlines()
        assert lines[0] == vmboot.find_kernel().release != os.uname().release  # its own kernel
        assert "aenv.guest" in lines[1]
        assert lines[2] == "hi"
        sbx.files.write("/tmp/note.txt", "through envd's files API")
        assert sbx.files.read("/tmp/note.txt") == "through envd's files API"
        info = api.get(f"/sandboxes/{sbx.sandbox_id}").json()
        assert info["state"] == "running"
    finally:
        sbx.kill()


def test_pause_and_resume_keep_a_running_process_and_the_disk(api: httpx.Client) -> None:
    from e2b import Sandbox

    sbx = Sandbox.create(TEMPLATE)
    try:
        sbx.commands.run(f"echo kept > /home/disk-note 2>/dev/null || echo kept > /tmp/disk-note; {COUNTER}")
        before = rises(sbx, 0)
        sbx.pause()
        assert api.get(f"/sandboxes/{sbx.sandbox_id}").json()["state"] == "paused"
        again = Sandbox.connect(sbx.sandbox_id)
        assert counting(again) >= before  # the same memory: /tmp and the process in it
        assert rises(again, before) > before
        assert again.commands.run("cat /tmp/disk-note").stdout == "kept\n"
    finally:
        sbx.kill()


def test_a_snapshot_leaves_the_source_running_and_creates_from_it(api: httpx.Client) -> None:
    from aenv.sdk import Client

    with Client(url=api.base_url.__str__().rstrip("/"), api_key=os.environ["E2B_API_KEY"]) as client:
        source = client.create(TEMPLATE)
        try:
            source.exec(f"echo at-the-snapshot > /tmp/state; {COUNTER}")
            seen = rises(_E2b(source), 0)
            snap = source.snapshot()
            assert rises(_E2b(source), seen) > seen  # the source was never stopped for long
            source.exec("echo after > /tmp/state")
            copy = client.create(snap)
            try:
                assert copy.exec("cat /tmp/state").stdout == "at-the-snapshot\n"
                assert rises(_E2b(copy), seen) > seen  # its process came along
            finally:
                copy.kill()
        finally:
            source.kill()


def test_fork_children_start_as_the_parent_and_diverge(api: httpx.Client) -> None:
    from aenv.sdk import Client

    with Client(url=str(api.base_url).rstrip("/"), api_key=os.environ["E2B_API_KEY"]) as client:
        parent = client.create(TEMPLATE)
        children = []
        try:
            parent.exec(f"echo parent > /tmp/who; {COUNTER}")
            seen = rises(_E2b(parent), 0)
            children = parent.fork(3)
            assert len({c.sandbox_id for c in children}) == 3
            for i, child in enumerate(children):
                assert child.exec("cat /tmp/who").stdout == "parent\n"
                assert rises(_E2b(child), seen) > seen
                child.exec(f"echo child-{i} > /tmp/who")
            assert [c.exec("cat /tmp/who").stdout for c in children] == [f"child-{i}\n" for i in range(3)]
            assert parent.exec("cat /tmp/who").stdout == "parent\n"
        finally:
            for sbx in [parent, *children]:
                sbx.kill()


def test_a_memory_hog_and_a_fork_bomb_end_inside_their_vm(api: httpx.Client) -> None:
    """The guest's kernel answers them (its OOM killer, its own process table); the node, QEMU and
    the other sandbox go on."""
    from e2b import Sandbox

    bystander, sbx = Sandbox.create(TEMPLATE), Sandbox.create(TEMPLATE)
    try:
        bystander.commands.run(COUNTER)
        seen = rises(bystander, 0)
        # 64 MiB at a time into a VM of 1 GiB (the guest bundle's Python: busybox has none), until
        # the guest's OOM killer ends it; QEMU, the agent and the VM go on.
        python = " ".join(guestbundle.agent_argv()[:4])
        hog = f"{python} -c 'l = []\nwhile True: l.append(b\"x\" * (64 << 20))'; echo ended $?"
        assert sbx.commands.run(hog, timeout=300).stdout == "ended 137\n"
        # A fork bomb, cut off by the sandbox's own timeout; the VM still answers afterwards.
        sbx.commands.run("b() { b | b & }; b", timeout=20, background=True)
        time.sleep(10)
        assert sbx.commands.run("echo still here", timeout=120).stdout == "still here\n"
        assert rises(bystander, seen) > seen
        assert api.get("/health").status_code == 200
    finally:
        sbx.kill()
        bystander.kill()


def test_the_vm_has_the_template_s_size(api: httpx.Client) -> None:
    """The template was built at the node's default sandbox size (1 CPU, 1024 MiB): its image fixes
    the VM's, so every sandbox of it has that much RAM and that many vCPUs, not the build's room."""
    from e2b import Sandbox

    sbx = Sandbox.create(TEMPLATE)
    try:
        ran = sbx.commands.run("busybox awk '/MemTotal/ {print $2}' /proc/meminfo; busybox nproc")
        mem_kib, cpus = (int(x) for x in ran.stdout.split())
        assert 768 * 1024 < mem_kib <= 1024 * 1024, mem_kib
        assert cpus == 1
    finally:
        sbx.kill()


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The base URL of a file server on this host's own address: outside every sandbox."""
    root = tmp_path_factory.mktemp("outside")
    (root / "hello.txt").write_text("hello from outside")
    handler = lambda *a: _Quiet(*a, directory=str(root))  # noqa: E731
    server = http.server.ThreadingHTTPServer((host_address(), 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://{host_address()}:{server.server_address[1]}"
    server.shutdown()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def test_egress_rules_and_the_port_proxy_reach_through_the_vm(api: httpx.Client, node: Server, outside: str) -> None:
    """A VM has no NIC: as under gVisor, its outbound connections go through the agent's proxy to
    the node, which applies the sandbox's rules, and the port proxy reaches its ports through the
    agent. Both hold across a pause and a fork."""
    from e2b import Sandbox

    ip = outside.split("//")[1].split(":")[0]
    shut = Sandbox.create(TEMPLATE)
    sbx = Sandbox.create(TEMPLATE, network={"allow_out": [f"{ip}/32"]})
    children: list[str] = []
    try:
        refused = shut.commands.run(_fetch(f"{outside}/hello.txt")).stdout
        assert refused.startswith("refused: HTTP Error 403") and "private address" in refused, refused
        for target in (f"http://127.0.0.1:{node.port}/health", "http://169.254.169.254/latest/meta-data/"):
            out = shut.commands.run(_fetch(target)).stdout
            assert out.startswith("refused: HTTP Error 403") and "never reachable" in out, (target, out)
        assert sbx.commands.run(_fetch(f"{outside}/hello.txt")).stdout == "hello from outside"

        sbx.commands.run("mkdir -p /tmp/www && echo served-from-the-vm > /tmp/www/index.html")
        sbx.commands.run("busybox httpd -p 8000 -h /tmp/www")
        assert _through_proxy(node, sbx.sandbox_id, 8000) == "served-from-the-vm\n"
        assert sbx.pause() is True
        again = Sandbox.connect(sbx.sandbox_id)
        assert again.commands.run(_fetch(f"{outside}/hello.txt")).stdout == "hello from outside"
        assert _through_proxy(node, sbx.sandbox_id, 8000) == "served-from-the-vm\n"  # httpd came along
        r = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
        assert r.status_code == 201, r.text
        children.append(r.json()[0]["sandbox"]["sandboxID"])
        child = Sandbox.connect(children[0])
        assert child.commands.run(_fetch(f"{outside}/hello.txt")).stdout == "hello from outside"
        child.commands.run("echo the-child > /tmp/www/index.html")
        assert _through_proxy(node, children[0], 8000) == "the-child\n"
        assert _through_proxy(node, sbx.sandbox_id, 8000) == "served-from-the-vm\n"
    finally:
        for sandbox_id in [shut.sandbox_id, sbx.sandbox_id, *children]:
            Sandbox.kill(sandbox_id)


def _fetch(url: str) -> str:
    """A command that prints ``url``'s body, fetched through the sandbox's proxy (its http_proxy),
    or why not. busybox's wget, a static glibc, cannot resolve names without NSS libraries: the
    guest bundle's Python does."""
    python = " ".join(guestbundle.agent_argv()[:4])
    code = (
        "import sys, urllib.request\n"
        "try: sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=30).read().decode())\n"
        "except Exception as e: print('refused:', e, getattr(e, 'read', lambda: b'')().decode())"
    )
    return f'no_proxy= NO_PROXY= {python} -c "{code}" {url}'  # the proxy even for loopback


def _through_proxy(node: Server, sandbox_id: str, port: int) -> str:
    """The body the node's port proxy answers for ``port`` of the sandbox (E2B's routing headers),
    once the server in it listens."""
    headers = {"E2b-Sandbox-Id": sandbox_id, "E2b-Sandbox-Port": str(port)}
    deadline = time.monotonic() + 60
    while True:
        r = httpx.get(f"{node.url}/index.html", headers=headers, timeout=60)
        if r.status_code == 200 or time.monotonic() > deadline:
            assert r.status_code == 200, r.text
            return r.text
        time.sleep(0.5)


class _E2b:
    """aenv's SDK sandbox seen through the helpers above (which call ``commands.run``)."""

    def __init__(self, sbx: object) -> None:
        self.commands = self
        self._sbx = sbx

    def run(self, cmd: str) -> object:
        return self._sbx.exec(cmd)  # type: ignore[attr-defined]
