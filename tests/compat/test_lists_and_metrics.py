"""Lists, filters, pages and metrics ranges as E2B's API answers them, through the official SDK
(and raw HTTP for what a hostile client sends); and a timed-out sandbox reads paused promptly."""

from __future__ import annotations

import base64
import datetime as dt
import time
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox, SandboxQuery, SandboxState

from tests.compat.conftest import Deployment

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


@pytest.fixture()
def api(deployment: Deployment) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=deployment.url, headers={"X-API-Key": deployment.api_key}, timeout=60) as client:
        yield client


@pytest.fixture()
def tag() -> str:
    return uuid.uuid4().hex[:12]


@pytest.fixture()
def tagged(tag: str) -> Iterator[list[Sandbox]]:
    """Sandboxes made by a test, all carrying its metadata tag; killed at its end."""
    made: list[Sandbox] = []
    yield made
    for sandbox in made:
        try:
            sandbox.kill()
        except Exception:
            pass


def make(tagged: list[Sandbox], tag: str, **kwargs: object) -> Sandbox:
    sandbox = Sandbox.create(timeout=300, metadata={"test": tag}, **kwargs)  # type: ignore[arg-type]
    tagged.append(sandbox)
    return sandbox


def listed(query: SandboxQuery, limit: int | None = None) -> list[str]:
    """Every sandbox id the SDK's paginator yields, page after page."""
    paginator = Sandbox.list(query=query, limit=limit)
    ids: list[str] = []
    while paginator.has_next:
        ids.extend(s.sandbox_id for s in paginator.next_items())
    return ids


def assert_bad_request(answer: httpx.Response, words: str) -> None:
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["code"] == 400 and words in body["message"], body


def token(text: str) -> str:
    return base64.urlsafe_b64encode(text.encode()).decode()


# -- sandbox lists ----------------------------------------------------------------------------------


def test_started_after_is_an_inclusive_bound(tagged: list[Sandbox], tag: str) -> None:
    first = make(tagged, tag)
    time.sleep(0.05)
    second = make(tagged, tag)
    started = first.get_info().started_at
    later = second.get_info().started_at
    meta = {"test": tag}
    assert set(listed(SandboxQuery(metadata=meta, started_after=started))) == {first.sandbox_id, second.sandbox_id}
    assert listed(SandboxQuery(metadata=meta, started_after=started + dt.timedelta(microseconds=1))) == [
        second.sandbox_id
    ]
    assert listed(SandboxQuery(metadata=meta, started_after=later)) == [second.sandbox_id]
    assert listed(SandboxQuery(metadata=meta, started_after=later + dt.timedelta(seconds=1))) == []
    # Another time zone names the same instant.
    shifted = started.astimezone(dt.timezone(dt.timedelta(hours=-7)))
    assert set(listed(SandboxQuery(metadata=meta, started_after=shifted))) == {first.sandbox_id, second.sandbox_id}
    # Combined with the other filters.
    before = started - dt.timedelta(hours=1)
    assert listed(SandboxQuery(metadata=meta, started_after=before, state=[SandboxState.PAUSED])) == []
    assert listed(SandboxQuery(metadata={"test": tag + "x"}, started_after=before)) == []
    both = listed(SandboxQuery(metadata=meta, started_after=before, state=[SandboxState.RUNNING]))
    assert both == [second.sandbox_id, first.sandbox_id]  # newest first


@pytest.mark.parametrize(
    "value", ["yesterday", "2024-01-01T00:00:00", "2024-13-01T00:00:00Z", "", "1700000000", "2024-01-01T00:00:00 00:00"]
)
def test_a_bad_started_after_is_a_400(api: httpx.Client, value: str) -> None:
    assert_bad_request(api.get("/v2/sandboxes", params={"startedAfter": value}), "startedAfter")


def test_pages_of_sandboxes_neither_repeat_nor_skip(tagged: list[Sandbox], tag: str) -> None:
    for _ in range(4):
        make(tagged, tag)
    made = [s.sandbox_id for s in tagged]
    meta = {"test": tag}
    newest_first = listed(SandboxQuery(metadata=meta), limit=1)
    assert newest_first == made[::-1]
    assert listed(SandboxQuery(metadata=meta), limit=3) == made[::-1]
    # A sandbox made between two pages shifts nothing: the next page starts after the last one served.
    paginator = Sandbox.list(query=SandboxQuery(metadata=meta), limit=2)
    seen = [s.sandbox_id for s in paginator.next_items()]
    make(tagged, tag)
    while paginator.has_next:
        seen.extend(s.sandbox_id for s in paginator.next_items())
    assert seen == made[::-1]


def test_ascending_pages_and_tokens_of_one_order_only(api: httpx.Client, tagged: list[Sandbox], tag: str) -> None:
    for _ in range(3):
        make(tagged, tag)
    made = [s.sandbox_id for s in tagged]
    params = {"metadata": f"test={tag}", "order": "asc", "limit": 1}
    seen: list[str] = []
    answer = api.get("/v2/sandboxes", params=params)
    while True:
        assert answer.status_code == 200, answer.text
        seen.extend(s["sandboxID"] for s in answer.json())
        next_token = answer.headers.get("x-next-token")
        if next_token is None:
            break
        # A token is for its own order: replayed under the other it is refused, not misread.
        desc = api.get("/v2/sandboxes", params={**params, "order": "desc", "nextToken": next_token})
        assert_bad_request(desc, "Invalid next token")
        answer = api.get("/v2/sandboxes", params={**params, "nextToken": next_token})
    assert seen == made


BAD_TOKENS = [
    "not base64!",
    "A" * 5000,
    token("no separator"),
    token("2024-01-01T00:00:00Z__../../etc/passwd"),
    token("2024-01-01T00:00:00__abc"),  # no offset
    token("not-a-time__abc"),
    token("2024-01-01T00:00:00Z__abc__desc"),
    token("2024-01-01T00:00:00Z__"),
    base64.urlsafe_b64encode(b"\xff\xfe__abc").decode(),
    "MTIz",  # "123": the offset tokens of earlier versions
    "%00",
]


@pytest.mark.parametrize("path", ["/v2/sandboxes", "/snapshots"])
@pytest.mark.parametrize("bad", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_a_forged_token_is_a_400(api: httpx.Client, path: str, bad: str) -> None:
    assert_bad_request(api.get(path, params={"nextToken": bad}), "Invalid next token")


@pytest.mark.parametrize(
    ("path", "params", "words"),
    [
        ("/v2/sandboxes", {"limit": 0}, "limit"),
        ("/v2/sandboxes", {"limit": 101}, "limit"),
        ("/v2/sandboxes", {"order": "sideways"}, "order"),
        ("/snapshots", {"limit": 0}, "limit"),
        ("/snapshots", {"limit": "many"}, "limit"),
        ("/snapshots", {"sandboxID": "../x"}, "Invalid sandbox ID"),
        ("/snapshots", {"sandboxID": "a-b-c"}, "Invalid sandbox ID"),
        ("/snapshots", {"name": ""}, "Invalid name"),
    ],
)
def test_bad_list_parameters_are_400s(api: httpx.Client, path: str, params: dict[str, object], words: str) -> None:
    assert_bad_request(api.get(path, params=params), words)


# -- snapshot lists ---------------------------------------------------------------------------------


@pytest.fixture()
def snapshots(tagged: list[Sandbox], tag: str) -> Iterator[tuple[Sandbox, list[str]]]:
    """A sandbox and five snapshots of it, oldest first (the first two named)."""
    source = make(tagged, tag)
    ids = []
    for n in range(5):
        name = f"snap-{tag}-{n}" if n < 2 else None
        ids.append(source.create_snapshot(name=name).snapshot_id)
    yield source, ids
    for snapshot_id in ids:
        Sandbox.delete_snapshot(snapshot_id)


def snapshot_ids(**kwargs: object) -> list[str]:
    paginator = Sandbox.list_snapshots(**kwargs)  # type: ignore[arg-type]
    ids: list[str] = []
    while paginator.has_next:
        ids.extend(s.snapshot_id for s in paginator.next_items())
    return ids


def test_snapshots_filtered_by_name_and_id(snapshots: tuple[Sandbox, list[str]], tag: str) -> None:
    source, ids = snapshots
    assert snapshot_ids(name=f"snap-{tag}-0") == [ids[0]]
    assert snapshot_ids(name=f"snap-{tag}-1") == [ids[1]]
    assert snapshot_ids(name=ids[3]) == [ids[3]]
    assert snapshot_ids(name=f"snap-{tag}") == []  # a name matches whole, not as a prefix
    assert snapshot_ids(name=f"snap-{tag}-0-does-not-exist") == []
    assert snapshot_ids(name=f"snap-{tag}-0", sandbox_id=source.sandbox_id) == [ids[0]]
    assert snapshot_ids(name=f"snap-{tag}-0", sandbox_id="a" * 20) == []


def test_pages_of_snapshots_neither_repeat_nor_skip(
    snapshots: tuple[Sandbox, list[str]], api: httpx.Client, tag: str
) -> None:
    source, ids = snapshots
    assert snapshot_ids(sandbox_id=source.sandbox_id, limit=2) == ids[::-1]  # newest first
    assert snapshot_ids(sandbox_id=source.sandbox_id, limit=1) == ids[::-1]
    assert snapshot_ids(sandbox_id=source.sandbox_id) == ids[::-1]
    everything = snapshot_ids(limit=3)
    assert len(everything) == len(set(everything)) and set(ids) <= set(everything)
    # A snapshot made between two pages shifts nothing.
    first = api.get("/snapshots", params={"sandboxID": source.sandbox_id, "limit": 2})
    assert [s["snapshotID"] for s in first.json()] == ids[:2:-1]
    extra = source.create_snapshot().snapshot_id
    try:
        rest = api.get(
            "/snapshots",
            params={"sandboxID": source.sandbox_id, "limit": 10, "nextToken": first.headers["x-next-token"]},
        )
        assert [s["snapshotID"] for s in rest.json()] == ids[2::-1]
        assert "x-next-token" not in rest.headers
    finally:
        Sandbox.delete_snapshot(extra)


# -- metrics ----------------------------------------------------------------------------------------


def metrics_of(api: httpx.Client, sandbox_id: str, **params: object) -> httpx.Response:
    return api.get(f"/sandboxes/{sandbox_id}/metrics", params=params)


def wait_for_metrics(sandbox: Sandbox, start: dt.datetime) -> list[object]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = sandbox.get_metrics(start=start, end=dt.datetime.now(dt.UTC))
        if got:
            return got
        time.sleep(0.5)
    raise AssertionError("no metrics within 30 s")


def test_metrics_answer_the_range_asked(api: httpx.Client, tagged: list[Sandbox], tag: str) -> None:
    start = dt.datetime.now(dt.UTC)
    sandbox = make(tagged, tag)
    sandbox.commands.run("head -c 20000000 /dev/urandom | sha256sum")
    got = wait_for_metrics(sandbox, start)
    end = dt.datetime.now(dt.UTC)
    for m in got:
        assert start.timestamp() - 10 <= m.timestamp.timestamp() <= end.timestamp() + 10  # type: ignore[attr-defined]
        assert m.mem_used > 0 and m.disk_used > 0 and m.mem_total > 0 and m.cpu_count >= 1  # type: ignore[attr-defined]
    sid = sandbox.sandbox_id
    created = int(start.timestamp())
    assert sandbox.get_metrics(start=start - dt.timedelta(hours=1), end=start - dt.timedelta(minutes=30)) == []
    assert metrics_of(api, sid, start=0, end=created - 60).json() == []
    future = int(time.time()) + 3600
    assert metrics_of(api, sid, start=future, end=future + 60).json() == []
    assert metrics_of(api, sid, start=future).json() == []
    everything = metrics_of(api, sid).json()  # no range: the whole history
    assert everything and everything == metrics_of(api, sid, start=created - 5).json()
    # A range of a day and more has E2B's coarser buckets (15 minutes past a week), each the maximum.
    coarse = metrics_of(api, sid, start=0).json()
    assert coarse and all(m["timestampUnix"] % 900 == 0 for m in coarse)
    assert max(m["memUsed"] for m in coarse) == max(m["memUsed"] for m in everything)
    assert [m["timestampUnix"] for m in everything] == sorted(m["timestampUnix"] for m in everything)
    assert all(m["timestampUnix"] % 5 == 0 for m in everything)  # E2B's 5 s buckets
    assert_bad_request(metrics_of(api, sid, start=created + 10, end=created), "Invalid time range")
    assert_bad_request(metrics_of(api, sid, start=-1), "start")
    assert_bad_request(metrics_of(api, sid, end="soon"), "end")
    assert_bad_request(metrics_of(api, sid, start=1.5), "start")
    assert_bad_request(metrics_of(api, sid, start=10**19), "start")


def test_a_paused_sandbox_keeps_its_metrics_and_adds_none(api: httpx.Client, tagged: list[Sandbox], tag: str) -> None:
    start = dt.datetime.now(dt.UTC)
    sandbox = make(tagged, tag)
    wait_for_metrics(sandbox, start)
    sandbox.pause()
    paused_at = time.time()
    before = metrics_of(api, sandbox.sandbox_id).json()
    assert before
    time.sleep(6)  # more than a sampling interval
    after = metrics_of(api, sandbox.sandbox_id).json()
    assert after == before
    assert all(m["timestampUnix"] <= paused_at for m in after)
    assert metrics_of(api, sandbox.sandbox_id, start=int(paused_at) + 1).json() == []


def test_latest_metrics_of_several_sandboxes(api: httpx.Client, tagged: list[Sandbox], tag: str) -> None:
    start = dt.datetime.now(dt.UTC)
    one, two = make(tagged, tag), make(tagged, tag)
    wait_for_metrics(one, start)
    wait_for_metrics(two, start)
    answer = api.get("/sandboxes/metrics", params={"sandbox_ids": f"{one.sandbox_id},{two.sandbox_id},{'z' * 20}"})
    assert answer.status_code == 200, answer.text
    latest = answer.json()["sandboxes"]
    assert set(latest) == {one.sandbox_id, two.sandbox_id}
    assert latest[one.sandbox_id]["memUsed"] > 0
    many = ",".join(f"{n:020d}" for n in range(101))
    assert_bad_request(api.get("/sandboxes/metrics", params={"sandbox_ids": many}), "maximum is 100")
    assert_bad_request(api.get("/sandboxes/metrics", params={"sandbox_ids": "../etc"}), "Invalid sandbox ID")
    assert_bad_request(api.get("/sandboxes/metrics"), "sandbox_ids")


def test_the_history_is_a_bounded_ring() -> None:
    from aenv.node.usage import History, Sample, in_range

    history = History(capacity=3)
    for n in range(10):
        history.add(Sample(ts=1000.0 + 5 * n, cpu_used_pct=n, mem_used=n, mem_cache=0, disk_used=n))
    assert [s.mem_used for s in history] == [7, 8, 9]
    latest = history.latest()
    assert latest is not None and latest.mem_used == 9
    assert [b.start for b in in_range(history, 1035, 1040)] == [1035, 1040]
    assert in_range(history, 1046, None) == []
    assert in_range(History(capacity=3), None, None) == []


# -- expiry -----------------------------------------------------------------------------------------


def test_timed_out_sandboxes_read_paused_promptly(tagged: list[Sandbox], tag: str) -> None:
    """Several sandboxes expire at once, each holding memory that makes its checkpoint take a
    while (their pauses run side by side on a busy node): from half a second past its endAt each
    reads paused, never running, and it can be connected to again."""
    lifecycle = {"on_timeout": "pause", "auto_resume": False}
    expiring = [make(tagged, tag, lifecycle=lifecycle) for _ in range(3)]
    hold = "import os, time; b = os.urandom(96 << 20); open('/tmp/held', 'w').close(); time.sleep(3600)"
    for sandbox in expiring:
        sandbox.commands.run(f'python3 -c "{hold}"', background=True)
    for sandbox in expiring:
        deadline = time.monotonic() + 30
        while not sandbox.files.exists("/tmp/held") and time.monotonic() < deadline:
            time.sleep(0.2)
    for sandbox in expiring:
        sandbox.set_timeout(2)
    ends = {sandbox.sandbox_id: sandbox.get_info().end_at.timestamp() for sandbox in expiring}
    seen: list[tuple[str, float, SandboxState]] = []
    while time.time() < max(ends.values()) + 2.0:
        for sandbox in expiring:
            late = time.time() - ends[sandbox.sandbox_id]
            if late > 0.5:
                seen.append((sandbox.sandbox_id, round(late, 2), sandbox.get_info().state))
        time.sleep(0.1)
    assert seen and [s for s in seen if s[2] != SandboxState.PAUSED] == []
    assert not expiring[0].is_running()
    expiring[0].connect(timeout=120)  # without one it would get its own again: the 2 s set above
    assert expiring[0].get_info().state == SandboxState.RUNNING
    assert expiring[0].commands.run("echo back").stdout == "back\n"
