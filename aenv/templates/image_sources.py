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
from dataclasses import dataclass, field
from typing import Any

from aenv.errors import OperationTimeout, SnapshotNotFound, TemplateNotFound
from aenv.images.local import is_local
from aenv.images.pull import ImagePull
from aenv.images.reference import ImageRef
from aenv.node.service import BuildHost, TemplateRecord
from aenv.templates.images import canonical_reference, commit_image

log = logging.getLogger("aenv.images")
REFERENCE_MARKS = ("/", ":", "@")
BUILDS_AT_ONCE = 4  # image builds (pull, conversion, boot) a node runs at once; the others queue


def digest_name(digest: str) -> str:
    """The name of the template made from the manifest ``digest``: ``sha256-<hex>``."""
    return digest.replace(":", "-", 1)


@dataclass
class _Builds:
    """Image builds under way on one node."""

    by_reference: dict[str, asyncio.Future[TemplateRecord]] = field(default_factory=dict)
    by_digest: dict[str, asyncio.Future[TemplateRecord]] = field(default_factory=dict)
    # a burst of creates naming new images must not boot as many build sandboxes at once
    slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(BUILDS_AT_ONCE))


_BUILDS: weakref.WeakKeyDictionary[Any, _Builds] = weakref.WeakKeyDictionary()


async def source_for(node: BuildHost, ref: str, *, image: bool = False) -> str:
    """What a create naming ``ref`` restores: ``ref`` itself when it names a template or a
    snapshot (or is nothing an image could be: the create's own 404), else the id of the template
    made from the image ``ref`` names, pulled and built first if this node has none. ``image``:
    ``ref`` is an image reference whatever templates there are (the native API's ``image``)."""
    if not image:
        if _known(node, ref) or not any(mark in ref for mark in REFERENCE_MARKS):
            return ref
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
        build = _start(node, builds, reference, canonical)
    return (await _wait(build, node.settings.operation_timeout, reference)).id


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
    or from the manifest a digest-pinned reference names."""
    pinned = _pinned(canonical)
    for t in node.templates.values():
        if not t.image_digest:
            continue
        if canonical == t.image_ref or canonical in t.aliases or reference in t.aliases:
            return t
        if pinned is not None and pinned == t.image_digest:
            return t
    return None


def _pinned(canonical: str) -> str | None:
    if is_local(canonical):
        return None
    return ImageRef.parse(canonical).digest


def by_digest(node: BuildHost, digest: str) -> TemplateRecord | None:
    return next((t for t in node.templates.values() if t.image_digest == digest), None)


def _start(node: BuildHost, builds: _Builds, reference: str, canonical: str) -> asyncio.Future[TemplateRecord]:
    """The build for ``canonical``, as the node's background work: it goes on whoever waits."""
    done: asyncio.Future[TemplateRecord] = asyncio.get_running_loop().create_future()
    done.add_done_callback(_retrieved)
    builds.by_reference[canonical] = done
    deadline = node.settings.operation_timeout

    async def run() -> None:
        started = time.monotonic()
        timer = asyncio.timeout(deadline)
        try:
            async with timer, builds.slots:
                rec = await _build(node, builds, reference, canonical, done)
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
        finally:
            if builds.by_reference.get(canonical) is done:
                del builds.by_reference[canonical]

    node.spawn(run())
    return done


async def _build(
    node: BuildHost, builds: _Builds, reference: str, canonical: str, done: asyncio.Future[TemplateRecord]
) -> TemplateRecord:
    """Resolve the manifest; the template of its digest if there is one (or being made), else
    pull, convert and commit it."""
    aliases = tuple(dict.fromkeys([reference, canonical]))
    said = functools.partial(_said, reference)  # the build's log lines, for an operator who asks (debug)
    async with ImagePull(node, reference, on_log=said) as job:
        digest = (await job.resolve()).digest
        rec = by_digest(node, digest)
        other = builds.by_digest.get(digest)
        if rec is None and other is None:
            builds.by_digest[digest] = done
            try:
                return await commit_image(node, job, digest_name(digest), canonical, aliases=aliases, on_log=said)
            finally:
                if builds.by_digest.get(digest) is done:
                    del builds.by_digest[digest]
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
