"""A template build's RUN steps have a network (apt-get, pip install: as docker build and E2B's
builds do) under a sandbox's egress checks: public addresses (AENV_BUILD_INTERNET, on by default),
what AENV_BUILD_ALLOW_OUT names (a private mirror), and nothing inside otherwise.

This machine's DNS answers public names with documentation-range addresses, which egress counts
as reserved, so the internet itself is not reached here: a mirror on this machine's own address
stands for it. Before build steps had egress, every RUN that downloaded anything failed.
"""

from __future__ import annotations

import http.server
import secrets
import socket
import threading
from collections.abc import Iterator

import pytest
from e2b import Sandbox, Template
from e2b.exceptions import BuildException

from aenv.node.egress import build_guest
from tests.conftest import Server, e2b_client, free_port, start_busybox_node

MIRRORED = "a package from the mirror\n"


def node_address() -> str:
    """An address of this machine other than loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent; the kernel picks the outgoing address
        return str(s.getsockname()[0])


@pytest.fixture(scope="module")
def mirror_port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    """A mirror on every address of this machine: reached by a build only where egress lets it."""
    root = tmp_path_factory.mktemp("mirror")
    (root / "pkg.txt").write_text(MIRRORED)
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(root))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("0.0.0.0", free_port()), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield httpd.server_address[1]
    httpd.shutdown()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    allow = f'["{node_address()}/32"]'
    srv = start_busybox_node(tmp_path_factory.mktemp("buildnet") / "data", {"AENV_BUILD_ALLOW_OUT": allow})
    yield srv
    srv.stop()


@pytest.fixture()
def e2b(node: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    for _ in e2b_client(node, monkeypatch):
        yield


def test_a_run_step_fetches_from_an_allowed_mirror(e2b: None, mirror_port: int) -> None:
    mirror = f"http://{node_address()}:{mirror_port}"
    alias = f"net-build-{secrets.token_hex(4)}"
    Template.build(
        Template().from_template("bb").set_user("root").run_cmd(f"/bin/busybox wget -q -O /pkg.txt {mirror}/pkg.txt"),
        alias=alias,
    )
    sbx = Sandbox.create(alias, timeout=60)
    try:
        assert sbx.files.read("/pkg.txt") == MIRRORED
    finally:
        sbx.kill()


@pytest.mark.parametrize("address", ["127.0.0.2", "169.254.169.254"])
def test_a_run_step_reaches_nothing_else_inside(e2b: None, mirror_port: int, address: str) -> None:
    """The mirror listens there too (loopback), or a cloud's metadata service would: refused."""
    step = f"/bin/busybox wget -q -T 20 -O /x http://{address}:{mirror_port}/pkg.txt"
    with pytest.raises(BuildException) as failed:
        Template.build(
            Template().from_template("bb").set_user("root").run_cmd(step), alias=f"net-in-{secrets.token_hex(4)}"
        )
    assert "failed to run command" in str(failed.value), failed.value  # (busybox's wget may crash on the refusal)


async def test_builds_without_internet_resolve_nothing() -> None:
    """AENV_BUILD_INTERNET=false: no name is looked up (nor any address reached) but what is allowed."""
    assert not build_guest("build", internet=False).policy_of().may_resolve("pypi.org")
    assert build_guest("build", internet=False, allow_out=["pypi.internal"]).policy_of().may_resolve("pypi.internal")
    assert build_guest("build", internet=True).policy_of().may_resolve("pypi.org")
