"""Creates straight from an image reference: a create's template may name an OCI image.

``Sandbox.create(template="python:3.12-slim")``, a native create with ``image``, ``aenv create
--image``: the first create of an image pulls it, converts it (the sandbox conventions) and boots
and snapshots it once as a template named by its manifest digest (``sha256-<hex>``, the reference
an alias of it); creates of the same image that arrive meanwhile wait for that one build, and later
ones restore its snapshot. The template is an ordinary one: listed, deletable, evictable.

Which ``templateID`` is an image reference: one that names no template (id, name, alias or
``name:tag``) nor snapshot, and has a ``/``, ``:`` or ``@`` in it (``python`` alone is a template
name; ``python:latest`` is the image). A ``name:tag`` whose name is a template's is that template's
missing tag, never an image (E2B's 404). A reference is matched with what the node made before as
pulled (Docker's if-not-present): a tag that moved is pulled again once its template is deleted.

One build per image: creates of one reference share one pull (keyed by the canonical reference,
before the registry is asked), and references that resolve to one manifest digest share one
conversion and boot (keyed by the digest, once the manifest is in). A build has the node's
operation deadline (``AENV_OPERATION_TIMEOUT``), and so does each create waiting for it (504 past
it, the build going on). A failed build fails every create waiting with the same error and leaves
no template record; nothing is remembered of it, so the next create tries again.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aenv.errors import ImageNotFound, InvalidRequest, OperationTimeout, SnapshotNotFound, TemplateNotFound
from aenv.images.local import is_local
from aenv.images.pull import ImagePull
from aenv.images.reference import ImageRef
from aenv.node.imagecache import Evicted, digest_name, evicted_images
from aenv.node.service import BuildHost, TemplateRecord
from aenv.templates.images import canonical_reference, commit_image

log = logging.getLogger("aenv.images")
REFERENCE_MARKS = ("/", ":", "@")
BUILDS_AT_ONCE = 4  # image builds (pull, conversion, boot) a node runs at once; the others queue


__all__ = ["digest_name", "held_source", "pull_progress", "source_for"]
SOURCE_ATTEMPTS = 3  # a template evicted between its build and the create's pin is made again, this often


@dataclass
class PullMeter:
    """Bytes of an image build's layers downloaded so far, and of its layers in all (as they are known)."""

    done: dict[int, int] = field(default_factory=dict)  # layer index -> bytes
    total: dict[int, int] = field(default_factory=dict)

    def seen(self, layer: int, layers: int, done: int, total: int) -> None:
        self.done[layer], self.total[layer] = done, total

    @property
    def bytes_done(self) -> int:
        return sum(self.done.values())

    @property
    def bytes_total(self) -> int:
        return sum(self.total.values())


@dataclass
class _Builds:
    """Image builds under way on one node."""

    by_reference: dict[str, asyncio.Future[TemplateRecord]] = field(default_factory=dict)
    by_digest: dict[str, asyncio.Future[TemplateRecord]] = field(default_factory=dict)
    meters: dict[str, PullMeter] = field(default_factory=dict)  # by canonical reference, while it pulls
    # a burst of creates naming new images must not boot as many build sandboxes at once
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(BUILDS_AT_ONCE))


_BUILDS: weakref.WeakKeyDictionary[Any, _Builds] = weakref.WeakKeyDictionary()


async def source_for(node: BuildHost, ref: str, *, image: bool = False, create: bool = False) -> str:
    """What a create naming ``ref`` restores: ``ref`` itself when it names a template or a
    snapshot (or is nothing an image could be: the create's own 404), else the id of the template
    made from the image ``ref`` names, pulled and built first if this node has none. ``image``:
    ``ref`` is an image reference whatever templates there are (the native API's ``image``).
    ``create``: a create waits (not a prefetch): a build it starts keeps the sandbox its template
    is snapshotted from for a create to take (aenv/node/warmpool.py)."""
    if not image:
        if _known(node, ref):
            return ref
        evicted = await evicted_images(node).find(ref.strip())
        if evicted is not None:  # its template was evicted: made again from the same image, same id
            try:
                return await source_for(node, _pinned(evicted), image=True, create=create)
            except ImageNotFound:
                if not _names_a_tag(ref.strip(), evicted):
                    raise  # that very image (its id, name or digest) is gone from the registry
                # Its digest left the registry: the tag names what it names now, as a pull of
                # it would find (the evicted image is forgotten: it cannot come back).
                log.info("image %s: evicted, and its digest %s is gone; pulling the tag again", ref, evicted.digest)
                await evicted_images(node).forget(evicted.digest)
        elif not any(mark in ref for mark in REFERENCE_MARKS):
            return ref
        else:
            _not_a_missing_tag(node, ref)
    reference = ref.strip()
    canonical = canonical_reference(reference)  # a malformed one: 400
    builds = _BUILDS.setdefault(node, _Builds())
    found = made_from(node, reference, canonical)
    if found is None and canonical not in builds.by_reference:
        # another node of the cluster may have made it and committed it to the repository
        if await node.artifacts.refresh_catalogue(reference):
            found = made_from(node, reference, canonical)
    if found is not None:
        return found.id
    build = builds.by_reference.get(canonical)
    if build is None:
        build = _start(node, builds, reference, canonical, keep_first=create)
    return (await _wait(build, node.settings.operation_timeout, reference)).id


@asynccontextmanager
async def held_source(node: BuildHost, ref: str, *, image: bool = False) -> AsyncIterator[str]:
    """:func:`source_for`, with the template or snapshot it names pinned until the block ends
    (the create's restore): the cache never evicts it meanwhile. One evicted between its build
    and this pin is made again."""
    for _ in range(SOURCE_ATTEMPTS):
        source = await source_for(node, ref, image=image, create=True)
        found = _record(node, source)
        if found is not None or not (image or source != ref):
            break
    held = [*found.layers, found.image] if found is not None else []
    node.artifacts.pin(held)  # no await between the lookup and the pin
    try:
        yield source
    finally:
        node.artifacts.unpin(held)


def _record(node: BuildHost, ref: str) -> Any:
    try:
        return node.find_template(ref)
    except TemplateNotFound:
        pass
    try:
        return node.find_snapshot(ref)
    except SnapshotNotFound:
        return None


def pull_progress(node: BuildHost, reference: str) -> PullMeter | None:
    """The bytes the build of ``reference`` (canonical) has pulled so far, while it runs."""
    builds = _BUILDS.get(node)
    return builds.meters.get(reference) if builds is not None else None


def _names_a_tag(ref: str, evicted: Evicted) -> bool:
    """Whether a create naming ``ref`` asked for an evicted image by a tag (a reference without a
    digest), not by the image itself (its template's id or name, its digest)."""
    return ref not in (evicted.id, evicted.name, evicted.digest) and "@" not in ref and not is_local(ref)


def _pinned(evicted: Evicted) -> str:
    """The reference an evicted image is pulled again by: its own digest (the same image, whatever
    its tag names now)."""
    if is_local(evicted.reference):
        return evicted.reference
    ref = ImageRef.parse(evicted.reference)
    return str(ImageRef(ref.registry, ref.repository, ref.tag, evicted.digest))


def _known(node: BuildHost, ref: str) -> bool:
    try:
        node.find_template(ref)
        return True
    except TemplateNotFound:
        pass
    try:
        node.find_snapshot(ref)
        return True
    except SnapshotNotFound:
        return False


def _not_a_missing_tag(node: BuildHost, ref: str) -> None:
    """``name:tag`` of a template this node has is a tag it lacks, as E2B answers, not an image
    on Docker Hub."""
    if "/" in ref or "@" in ref:
        return
    name, _, tag = ref.partition(":")
    for t in node.templates.values():
        if name in (t.name, t.id) or any(alias.partition(":")[0] == name for alias in t.aliases):
            raise TemplateNotFound(f"tag '{tag}' does not exist for template '{name}'")


def made_from(node: BuildHost, reference: str, canonical: str) -> TemplateRecord | None:
    """The template this node made from the image ``reference`` (as written, or ``canonical``),
    or from the manifest a digest-pinned reference names in a repository it was pulled from. In
    another repository the registry is asked first (the build path: one manifest read, no
    layers): knowing a digest is no right to read the image, as a registry sees it."""
    pinned = None if is_local(canonical) else ImageRef.parse(canonical)
    for t in node.templates.values():
        if not t.image_digest:
            continue
        if canonical == t.image_ref or canonical in t.aliases or reference in t.aliases:
            return t
        if pinned is not None and pinned.digest == t.image_digest and _repository(pinned) in _repositories(t):
            return t
    return None


def _repository(ref: ImageRef) -> tuple[str, str]:
    return ref.registry, ref.repository


def _repositories(t: TemplateRecord) -> set[tuple[str, str]]:
    """The (registry, repository) pairs ``t``'s image was pulled or named by (its references and
    aliases that are image references; a template name among them is none)."""
    found = set()
    for r in (t.image_ref, *t.aliases):
        if is_local(r):
            continue
        try:
            found.add(_repository(ImageRef.parse(canonical_reference(r))))
        except InvalidRequest:
            continue
    return found


def by_digest(node: BuildHost, digest: str) -> TemplateRecord | None:
    return next((t for t in node.templates.values() if t.image_digest == digest), None)


def _start(
    node: BuildHost, builds: _Builds, reference: str, canonical: str, *, keep_first: bool = False
) -> asyncio.Future[TemplateRecord]:
    """The build for ``canonical``, as the node's background work: it goes on whoever waits."""
    done: asyncio.Future[TemplateRecord] = asyncio.get_running_loop().create_future()
    done.add_done_callback(_retrieved)
    builds.by_reference[canonical] = done
    meter = builds.meters[canonical] = PullMeter()
    deadline = node.settings.operation_timeout

    async def run() -> None:
        started = time.monotonic()
        timer = asyncio.timeout(deadline)
        try:
            async with timer, builds.slots:
                rec = await _build(node, builds, reference, canonical, done, meter, keep_first=keep_first)
        except TimeoutError as exc:
            late = f"failed to pull image '{reference}': not ready within {deadline:g}s (AENV_OPERATION_TIMEOUT)"
            _fail(done, OperationTimeout(late, status=504) if timer.expired() else exc)
        except asyncio.CancelledError:
            _fail(done, OperationTimeout(f"the build of image '{reference}' was stopped: the node stops", status=503))
            raise
        except BaseException as exc:  # noqa: BLE001 - every waiter gets it
            log.warning("create from image %s failed: %s", reference, exc)
            _fail(done, exc)
        else:
            log.info("image %s is template %s (%.1f s)", reference, rec.name, time.monotonic() - started)
            if not done.done():
                done.set_result(rec)
            node.spawn(node.collect_garbage(min_age=60))  # one image more: the cache keeps its budget
        finally:
            if builds.by_reference.get(canonical) is done:
                del builds.by_reference[canonical]
            if builds.meters.get(canonical) is meter:
                del builds.meters[canonical]

    node.spawn(run())
    return done


async def _build(
    node: BuildHost,
    builds: _Builds,
    reference: str,
    canonical: str,
    done: asyncio.Future[TemplateRecord],
    meter: PullMeter | None = None,
    *,
    keep_first: bool = False,
) -> TemplateRecord:
    """Resolve the manifest; the template of its digest if there is one (or being made), else
    pull, convert and commit it (an image this node evicted: under its old id and references)."""
    aliases = tuple(dict.fromkeys([reference, canonical]))
    said = functools.partial(_said, reference)  # the build's log lines, for an operator who asks (debug)
    on_progress = meter.seen if meter is not None else None
    async with ImagePull(node, reference, on_log=said, on_progress=on_progress) as job:
        digest = (await job.resolve()).digest
        rec = by_digest(node, digest)
        other = builds.by_digest.get(digest)
        if rec is None and other is None:
            builds.by_digest[digest] = done
            evicted = await evicted_images(node).by(digest)
            template_id = evicted.id if evicted is not None else ""
            if evicted is not None:
                aliases = tuple(dict.fromkeys([*aliases, *evicted.aliases]))
            try:
                made = await commit_image(
                    node,
                    job,
                    digest_name(digest),
                    canonical,
                    aliases=aliases,
                    on_log=said,
                    template_id=template_id,
                    public=True,  # pulled with the node's logins: every team may use it
                    keep_first=keep_first,
                )
            finally:
                if builds.by_digest.get(digest) is done:
                    del builds.by_digest[digest]
            await evicted_images(node).forget(digest)
            return made
    # Another reference to the same image: its template, with this reference as an alias too.
    if rec is None:
        assert other is not None
        rec = await asyncio.shield(other)
    rec.aliases = sorted({*rec.aliases, *aliases} - {rec.name})
    await node.save_template(rec)
    return rec


async def _wait(build: asyncio.Future[TemplateRecord], deadline: float, reference: str) -> TemplateRecord:
    """The build's template, or its error; past ``deadline`` a 504 (the build goes on)."""
    waiting = asyncio.shield(build)
    done, _ = await asyncio.wait([waiting], timeout=deadline)
    if not done:
        waiting.cancel()
        raise OperationTimeout(
            f"image '{reference}' is still being pulled and converted after {deadline:g}s (AENV_OPERATION_TIMEOUT): "
            "a create once it is ready restores it",
            status=504,
        )
    return waiting.result()


def _said(reference: str, line: str) -> None:
    log.info("image %s: %s", reference, line)


def _fail(done: asyncio.Future[TemplateRecord], exc: BaseException) -> None:
    if not done.done():
        done.set_exception(exc)


def _retrieved(done: asyncio.Future[TemplateRecord]) -> None:
    if not done.cancelled():
        done.exception()  # nobody may be waiting any more: not an unretrieved error
