"""A template made from an image keeps the image's config as Docker does: its WorkingDir is where
commands start (SWE-bench images set /testbed: commands started in /home/user), its User (root when
it names none) and Env apply where a request names none. A Dockerfile FROM such an image starts
there too; E2B's template builder keeps E2B's user and home (its SDK says USER user itself)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import Sandbox, Template

from aenv.sdk import Client
from tests.conftest import API_KEY, Server, start_busybox_node
from tests.images.oci import Registry, busybox_layer, start_registry

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    yield from start_registry(tmp_path_factory.mktemp("registry"))


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    srv = start_busybox_node(tmp_path_factory.mktemp("imageconfig") / "data")
    yield srv
    srv.stop()


@pytest.fixture()
def e2b(node: Server, monkeypatch: pytest.MonkeyPatch) -> Server:
    for key, value in {"E2B_API_KEY": API_KEY, "E2B_API_URL": node.url, "E2B_SANDBOX_URL": node.url}.items():
        monkeypatch.setenv(key, value)
    return node


def push(registry: Registry, config: dict[str, object]) -> str:
    repo = f"tests/config-{uuid.uuid4().hex[:8]}"
    layer = busybox_layer().dir("tmp", 0o1777).dir("testbed", 0o755).bytes()
    registry.push_image(repo, "1", [(layer, "gzip")], env=["PATH=/bin", "TASK=django-1234"], config=config)
    return f"{registry.host}/{repo}:1"


def run(sbx: Sandbox, command: str, **kwargs: object) -> str:
    return str(sbx.commands.run(command, **kwargs).stdout).strip()  # type: ignore[arg-type]


@pytest.mark.parametrize("how", ["create by reference", "from-image"])
def test_an_images_workdir_user_and_env_are_the_defaults(registry: Registry, e2b: Server, how: str) -> None:
    image = push(registry, {"WorkingDir": "/testbed"})
    template = image
    if how == "from-image":
        template = f"swe-{uuid.uuid4().hex[:8]}"
        with e2b.client() as api:
            made = api.post("/templates/from-image", json={"name": template, "image": image}, timeout=300)
            assert made.status_code == 201, made.text
    sbx = Sandbox.create(template=template, timeout=60)
    try:
        assert run(sbx, "pwd; id -un; echo $TASK").split() == ["/testbed", "root", "django-1234"]
        # a request's own user, directory and environment win
        assert run(sbx, "pwd", cwd="/tmp") == "/tmp"
        assert run(sbx, "id -un; pwd", user="user").split() == ["user", "/testbed"]
        assert run(sbx, "echo $TASK", envs={"TASK": "mine"}) == "mine"
        sbx.files.write("/testbed/notes.txt", "written")
        assert run(sbx, "cat notes.txt; echo; stat -c %U notes.txt").split() == ["written", "root"]
    finally:
        sbx.kill()


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"User": "user"}, ["user", "/"]),  # no WorkingDir: Docker's /
        ({"User": "1000:1000", "WorkingDir": "/tmp"}, ["1000", "/tmp"]),  # a uid and group, as Docker takes them
        ({"User": "4321", "WorkingDir": "/testbed"}, ["4321", "/testbed"]),  # a uid the image's passwd lacks
    ],
)
def test_an_images_user_in_other_forms(
    registry: Registry, e2b: Server, config: dict[str, object], expected: list[str]
) -> None:
    sbx = Sandbox.create(template=push(registry, config), timeout=60)
    try:
        assert run(sbx, "id -u; pwd").split()[1:] == expected[1:]
        uid = run(sbx, "id -u")
        assert uid == ("1000" if expected[0] in ("user", "1000") else expected[0])
    finally:
        sbx.kill()


def test_a_dockerfile_from_the_image_starts_there_and_e2bs_builder_keeps_e2bs_home(
    registry: Registry, e2b: Server, tmp_path: Path
) -> None:
    image = push(registry, {"WorkingDir": "/testbed"})
    (tmp_path / "Dockerfile").write_text(f"FROM {image}\nRUN echo built > /testbed/built\n")
    name = f"df-{uuid.uuid4().hex[:8]}"
    with Client(e2b.url, API_KEY) as client:
        client.build(name, tmp_path)
    sbx = Sandbox.create(template=name, timeout=60)
    try:
        assert run(sbx, "pwd; id -un; cat built").split() == ["/testbed", "root", "built"]
    finally:
        sbx.kill()
    e2b_name = f"e2b-{uuid.uuid4().hex[:8]}"
    Template.build(Template().from_image(image).run_cmd("true"), e2b_name)
    sbx = Sandbox.create(template=e2b_name, timeout=60)
    try:
        assert run(sbx, "pwd; id -un").split() == ["/home/user", "user"]
    finally:
        sbx.kill()
    with httpx.Client(base_url=e2b.url, headers={"X-API-Key": API_KEY}) as api:
        assert api.get(f"/templates/{name}").status_code == 200
