"""The single flight of creates from image references (aenv/templates/image_sources.py), on its
own: the pull and the build are stand-ins that count their calls and take the time a test gives
them; the node is a stand-in with its catalogue. The real thing, end to end, is
test_create_from_image.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from aenv.errors import NotFound, OperationTimeout, TemplateNotFound
from aenv.node.store import TemplateRecord
from aenv.templates import image_sources

pytestmark = [pytest.mark.asyncio, pytest.mark.fast]  # the fast tier (./scripts/test --fast)
DIGEST = "sha256:" + "ab" * 32


@dataclass
class Node:
    templates: dict[str, TemplateRecord] = field(default_factory=dict)
    settings: Any = field(default_factory=lambda: SimpleNamespace(operation_timeout=5.0))
    tasks: set[asyncio.Task[Any]] = field(default_factory=set)
    artifacts: Any = None

    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        async def refresh_catalogue(ref: str = "") -> int:
            return 0

        async def get_meta(key: str) -> str | None:
            return self.meta.get(key)

        async def set_meta(key: str, value: str) -> None:
            self.meta[key] = value

        self.artifacts = SimpleNamespace(refresh_catalogue=refresh_catalogue)
        self.store = SimpleNamespace(get_meta=get_meta, set_meta=set_meta)

    async def collect_garbage(self, *, min_age: float = 0.0) -> None:
        pass

    def __hash__(self) -> int:
        return id(self)

    def find_template(self, ref: str) -> TemplateRecord:
        for t in self.templates.values():
            if ref in (t.id, t.name, *t.aliases):
                return t
        raise TemplateNotFound(ref)

    def find_snapshot(self, ref: str) -> Any:
        from aenv.errors import SnapshotNotFound

        raise SnapshotNotFound(ref)

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def save_template(self, rec: TemplateRecord) -> None:
        self.templates[rec.id] = rec


@dataclass
class Stand:
    """What the stand-in pull and build did, and how they behave."""

    digests: dict[str, str] = field(default_factory=dict)  # reference -> the digest it resolves to
    build_time: float = 0.05
    fail: Exception | None = None
    resolves: list[str] = field(default_factory=list)
    builds: list[str] = field(default_factory=list)
    running: int = 0
    most: int = 0  # builds that ran at once


@pytest.fixture()
def stand(monkeypatch: pytest.MonkeyPatch) -> Stand:
    stand = Stand()

    class Pull:
        def __init__(self, node: Node, reference: str, **_: Any) -> None:
            self.reference = reference

        async def __aenter__(self) -> Pull:
            return self

        async def __aexit__(self, *exc: object) -> None:
            pass

        async def resolve(self) -> Any:
            stand.resolves.append(self.reference)
            await asyncio.sleep(0.01)
            if self.reference not in stand.digests:
                raise NotFound(f"image '{self.reference}' not found")
            return SimpleNamespace(digest=stand.digests[self.reference])

    async def commit(
        node: Node,
        job: Pull,
        name: str,
        reference: str,
        *,
        aliases: tuple[str, ...] = (),
        template_id: str = "",
        **_: Any,
    ) -> Any:
        stand.builds.append(name)
        stand.running += 1
        stand.most = max(stand.most, stand.running)
        try:
            await asyncio.sleep(stand.build_time)
        finally:
            stand.running -= 1
        if stand.fail is not None:
            raise stand.fail
        rec = TemplateRecord(id=template_id or f"id-{name}", name=name, layers=[], image="i", created_at=time.time())
        rec.aliases, rec.image_ref, rec.image_digest = (
            sorted(set(aliases) - {name}),
            reference,
            stand.digests[job.reference],
        )
        node.templates[rec.id] = rec
        return rec

    monkeypatch.setattr(image_sources, "ImagePull", Pull)
    monkeypatch.setattr(image_sources, "commit_image", commit)
    return stand


async def test_creates_of_one_image_share_one_build(stand: Stand) -> None:
    node = Node()
    ref = "registry:5000/swebench/sweb.eval.x86_64.django__django-11099:latest"
    stand.digests[ref] = DIGEST
    got = await asyncio.gather(*(image_sources.source_for(node, ref) for _ in range(10)))  # type: ignore[arg-type]
    assert len(set(got)) == 1 and stand.resolves == [ref] and stand.builds == ["sha256-" + "ab" * 32]
    later = await image_sources.source_for(node, ref)  # type: ignore[arg-type]
    assert node.find_template(later).id == got[0] and stand.resolves == [ref]  # the registry is not asked


async def test_references_to_one_digest_share_one_build(stand: Stand) -> None:
    node = Node()
    refs = ["registry:5000/a/img:1", "registry:5000/a/img:latest", f"registry:5000/a/img@{DIGEST}"]
    for ref in refs:
        stand.digests[ref] = DIGEST
    got = await asyncio.gather(*(image_sources.source_for(node, r) for r in refs * 3))  # type: ignore[arg-type]
    assert len(set(got)) == 1 and len(stand.builds) == 1
    assert sorted(stand.resolves) == sorted(refs)  # one resolve per reference, not per create
    assert set(refs) <= set(node.templates[got[0]].aliases)


async def test_a_failed_build_fails_every_waiter_and_is_not_remembered(stand: Stand) -> None:
    node = Node()
    ref = "registry:5000/a/broken:1"
    stand.digests[ref], stand.fail = DIGEST, OperationTimeout("the conversion failed", status=500)
    results = await asyncio.gather(
        *(image_sources.source_for(node, ref) for _ in range(5)),  # type: ignore[arg-type]
        return_exceptions=True,
    )
    assert all(r is results[0] for r in results) and isinstance(results[0], OperationTimeout)
    assert len(stand.builds) == 1 and not node.templates
    stand.fail = None
    assert await image_sources.source_for(node, ref)  # type: ignore[arg-type]
    assert len(stand.builds) == 2


async def test_a_create_from_an_image_is_bounded_by_the_operation_deadline(stand: Stand) -> None:
    """A 504 at AENV_OPERATION_TIMEOUT, and nothing recorded of the build it stopped (seen failing
    with the deadlines taken out: the create waited the whole build)."""
    node = Node()
    node.settings.operation_timeout = 0.3
    ref = "registry:5000/a/slow:1"
    stand.digests[ref], stand.build_time = DIGEST, 0.2  # the build's own deadline holds it
    started = time.monotonic()
    assert await image_sources.source_for(node, ref)  # type: ignore[arg-type]
    stand.build_time = 1.0
    other = "registry:5000/a/slower:1"
    stand.digests[other] = "sha256:" + "cd" * 32
    with pytest.raises(OperationTimeout) as late:
        await image_sources.source_for(node, other)  # type: ignore[arg-type]
    assert late.value.status == 504 and "AENV_OPERATION_TIMEOUT" in late.value.message
    assert time.monotonic() - started < 1.0
    await asyncio.gather(*node.tasks)  # its build stops at its own deadline: nothing recorded
    assert [t.name for t in node.templates.values()] == ["sha256-" + "ab" * 32]


async def test_which_template_ids_are_image_references(stand: Stand) -> None:
    node = Node()
    base = TemplateRecord(id="t1", name="base", layers=[], image="i", created_at=0, aliases=["base:v1"])
    node.templates["t1"] = base
    older = TemplateRecord(id="t0", name="t0", layers=[], image="i", created_at=0, aliases=["app:v1"])
    node.templates["t0"] = older  # an older build named by its id, a tag of family `app` left
    for known in ("base", "t1", "base:v1", "never-made"):  # a template, or the create's own 404
        assert await image_sources.source_for(node, known) == known  # type: ignore[arg-type]
    for family in ("base", "app"):
        with pytest.raises(TemplateNotFound, match=f"tag 'v2' does not exist for template '{family}'"):
            await image_sources.source_for(node, f"{family}:v2")  # type: ignore[arg-type]
    with pytest.raises(NotFound, match="python:3.12"):
        await image_sources.source_for(node, "python:3.12")  # type: ignore[arg-type]
    assert stand.resolves == ["python:3.12"]
    with pytest.raises(NotFound):  # ``image``: a reference, whatever the templates are named
        await image_sources.source_for(node, "base", image=True)  # type: ignore[arg-type]


async def test_a_burst_of_new_images_builds_a_few_at_a_time(stand: Stand) -> None:
    node = Node()
    refs = [f"registry:5000/burst/img{i}:1" for i in range(10)]
    for i, ref in enumerate(refs):
        stand.digests[ref] = f"sha256:{i:064x}"
    got = await asyncio.gather(*(image_sources.source_for(node, r) for r in refs))  # type: ignore[arg-type]
    assert len(set(got)) == 10 and stand.most == image_sources.BUILDS_AT_ONCE


async def test_an_evicted_image_is_made_again_under_its_id_by_any_of_its_names(stand: Stand) -> None:
    """What the cache evicted whole (aenv/node/imagecache.py) is pulled again by its digest, whatever
    its tag names now, and keeps its template id and references; seen failing before: a 404."""
    from aenv.node.imagecache import Evicted, evicted_images

    node = Node()
    ref = "registry:5000/swe/task:latest"
    entry = Evicted(id="kept-id", name="sha256-" + "ab" * 32, digest=DIGEST, reference=ref, aliases=[ref, "task:1"])
    await evicted_images(node).remember(entry)  # type: ignore[arg-type]
    stand.digests[f"{ref}@{DIGEST}"] = DIGEST
    assert await image_sources.source_for(node, "kept-id") == "kept-id"  # type: ignore[arg-type]
    assert stand.resolves == [f"{ref}@{DIGEST}"]  # by digest: the tag may have moved since
    rec = node.templates["kept-id"]
    assert {ref, "task:1"} <= set(rec.aliases) and rec.name == entry.name
    assert await evicted_images(node).entries() == {}  # type: ignore[arg-type]  # a template again


async def test_a_prefetch_runs_a_few_at_a_time_and_says_what_failed(stand: Stand) -> None:
    from aenv.templates import prefetch

    node = Node()
    refs = [f"registry:5000/pre/img{i}:1" for i in range(10)]
    for i, ref in enumerate(refs):
        stand.digests[ref] = f"sha256:{i:064x}"
    job = prefetch.start(node, [*refs, "registry:5000/pre/missing:1", refs[0]])  # type: ignore[arg-type]
    assert [i.phase for i in job.items] == ["pending"] * 11  # the duplicate once
    await asyncio.gather(*node.tasks)
    body = job.as_json()
    assert body["state"] == "done" and body["counts"] == {"pending": 0, "pulling": 0, "ready": 10, "failed": 1}
    assert stand.most <= prefetch.AT_ONCE
    missing = body["images"][10]
    assert missing["error"] == {"code": 404, "message": "image 'registry:5000/pre/missing:1' not found"}
    assert prefetch.get(node, job.id) is job  # type: ignore[arg-type]
