"""Prefetch: images pulled and made templates ahead of a training schedule.

``POST /images/prefetch {"images": [REF, ...]}`` starts a job that makes each image a template as
its first create would (aenv/templates/image_sources.py: the same single flight, so a create of an
image being prefetched waits for that one build), a few at a time; ``GET /images/prefetch/{id}``
reads its progress: each image pending, pulling (pulled, converted, booted and snapshotted),
ready (its template id) or failed (the error in E2B's words, with its status), and the bytes of its
layers downloaded so far. Prefetched images then create with no pull (while the cache budget keeps
them: a list larger than the budget evicts its own first images, least recently used first).

Everything in the request is checked before anything starts (400 for a list that is empty, too
long or holds a reference that is none; duplicates are prefetched once); a node runs at most
``MAX_RUNNING`` jobs at once (429 past it) and remembers the last ``MAX_KEPT``.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from aenv.errors import AenvError, InvalidRequest, LimitExceeded, TemplateNotFound, lookup
from aenv.node.service import BuildHost
from aenv.templates import image_sources
from aenv.templates.images import canonical_reference

log = logging.getLogger("aenv.images")
MAX_IMAGES = 1000  # references in one request
MAX_REFERENCE = 1024  # characters of one reference
AT_ONCE = 4  # images of one job pulled at a time (builds share the node's own bound, image_sources)
MAX_RUNNING = 8  # jobs under way on a node
MAX_KEPT = 64  # jobs remembered, the oldest finished ones forgotten first
STATES = ("pending", "pulling", "ready", "failed")


@dataclass
class Item:
    reference: str
    canonical: str
    phase: str = "pending"  # pending, pulling, ready or failed (its "state" in the API)
    template_id: str = ""
    digest: str = ""
    error: dict[str, Any] | None = None
    bytes_done: int = 0
    bytes_total: int = 0
    started_at: float = 0.0
    seconds: float = 0.0
    meter: image_sources.PullMeter | None = None

    def as_json(self) -> dict[str, Any]:
        if self.meter is not None and self.phase == "pulling":
            self.bytes_done, self.bytes_total = self.meter.bytes_done, self.meter.bytes_total
        body: dict[str, Any] = {
            "reference": self.reference,
            "state": self.phase,
            "bytesDone": self.bytes_done,
            "bytesTotal": self.bytes_total,
        }
        if self.template_id:
            body["templateID"], body["digest"] = self.template_id, self.digest
        if self.error is not None:
            body["error"] = self.error
        if self.phase in ("ready", "failed"):
            body["seconds"] = round(self.seconds, 3)
        return body


@dataclass
class Job:
    id: str
    items: list[Item]
    created_at: float = field(default_factory=time.time)
    done_at: float = 0.0

    @property
    def done(self) -> bool:
        return all(item.phase in ("ready", "failed") for item in self.items)

    def as_json(self) -> dict[str, Any]:
        images = [item.as_json() for item in self.items]
        counts = {state: sum(1 for i in self.items if i.phase == state) for state in STATES}
        return {
            "prefetchID": self.id,
            "state": "done" if self.done else "running",
            "createdAt": self.created_at,
            "doneAt": self.done_at or None,
            "counts": counts,
            "bytesDone": sum(i["bytesDone"] for i in images),
            "images": images,
        }


class Prefetches:
    """A node's prefetch jobs."""

    def __init__(self) -> None:
        self.jobs: OrderedDict[str, Job] = OrderedDict()

    def running(self) -> int:
        return sum(1 for job in self.jobs.values() if not job.done)

    def keep(self, job: Job) -> None:
        self.jobs[job.id] = job
        for old in [j for j in self.jobs.values() if j.done][: max(0, len(self.jobs) - MAX_KEPT)]:
            del self.jobs[old.id]


_JOBS: weakref.WeakKeyDictionary[Any, Prefetches] = weakref.WeakKeyDictionary()


def _jobs(node: BuildHost) -> Prefetches:
    found = _JOBS.get(node)
    if found is None:
        found = _JOBS[node] = Prefetches()
    return found


def checked(images: Any) -> list[tuple[str, str]]:
    """The request's references as (as written, canonical), duplicates dropped; a 400 naming the
    first one that is no reference."""
    if not isinstance(images, list) or not images:
        raise InvalidRequest("images must be a non-empty list of image references")
    if len(images) > MAX_IMAGES:
        raise InvalidRequest(f"images may name at most {MAX_IMAGES} references, not {len(images)}")
    out: dict[str, str] = {}
    for i, ref in enumerate(images):
        if not isinstance(ref, str) or not ref.strip():
            raise InvalidRequest(f"images[{i}] must be an image reference (a non-empty string)")
        if len(ref) > MAX_REFERENCE or not ref.isprintable():
            raise InvalidRequest(
                f"images[{i}] is not an image reference ({MAX_REFERENCE} printable characters at most)"
            )
        try:
            canonical = canonical_reference(ref)
        except AenvError as exc:
            raise InvalidRequest(f"images[{i}]: {exc.message}") from None
        out.setdefault(canonical, ref.strip())
    return [(ref, canonical) for canonical, ref in out.items()]


def start(node: BuildHost, images: Any) -> Job:
    """Check the request and start its job (the node's background work); the job as it starts."""
    refs = checked(images)
    jobs = _jobs(node)
    if jobs.running() >= MAX_RUNNING:
        raise LimitExceeded(f"this node runs at most {MAX_RUNNING} prefetches at once: wait for one to finish")
    job = Job(secrets.token_hex(8), [Item(ref, canonical) for ref, canonical in refs])
    jobs.keep(job)
    node.spawn(_run(node, job))
    return job


def get(node: BuildHost, job_id: str) -> Job | None:
    return _jobs(node).jobs.get(job_id)


async def _run(node: BuildHost, job: Job) -> None:
    slots = asyncio.Semaphore(AT_ONCE)

    async def one(item: Item) -> None:
        async with slots:
            await _fetch(node, item)

    try:
        await asyncio.gather(*(one(item) for item in job.items))
    finally:
        job.done_at = time.time()
        failed = [i for i in job.items if i.phase == "failed"]
        log.info("prefetch %s: %d images, %d failed", job.id, len(job.items), len(failed))


async def _fetch(node: BuildHost, item: Item) -> None:
    item.phase, item.started_at = "pulling", time.monotonic()
    work = asyncio.ensure_future(image_sources.source_for(node, item.reference, image=True))
    await asyncio.sleep(0)  # the build starts (or is joined): its meter is there to follow
    item.meter = image_sources.pull_progress(node, item.canonical)
    try:
        item.template_id = await work
        item.digest = _digest_of(node, item.template_id)
        item.phase = "ready"
    except asyncio.CancelledError:
        work.cancel()
        item.phase, item.error = "failed", {"code": 503, "message": "the node stopped before the image was ready"}
        raise
    except Exception as exc:  # noqa: BLE001 - told to the client in E2B's words
        item.phase, item.error = "failed", _error(exc)
    finally:
        if item.meter is not None:
            item.bytes_done, item.bytes_total = item.meter.bytes_done, item.meter.bytes_total
        item.meter = None
        item.seconds = time.monotonic() - item.started_at


def _digest_of(node: BuildHost, template_id: str) -> str:
    try:
        return node.find_template(template_id).image_digest
    except TemplateNotFound:
        return ""  # evicted already (a list larger than the cache budget)


def _error(exc: BaseException) -> dict[str, Any]:
    if isinstance(exc, AenvError):
        status = exc.status or lookup(type(exc))[0]
        return {"code": status, "message": exc.message}
    log.exception("prefetch failed", exc_info=exc)
    return {"code": 500, "message": f"failed to prepare the image: {type(exc).__name__}"}
