"""E2B's lifecycle events and webhooks against a real node: the events of what the E2B SDK does
to sandboxes, read back with E2B's query parameters, and delivered to a receiver on the host with
E2B's headers and signature, in order, retried when the receiver fails.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from e2b import Sandbox

from aenv.errors import InvalidRequest
from aenv.events.webhooks import UrlRule
from tests.conftest import Server
from tests.webhooks import Receiver, e2b_signature, receiving

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

ALL = [
    "sandbox.lifecycle.created",
    "sandbox.lifecycle.updated",
    "sandbox.lifecycle.paused",
    "sandbox.lifecycle.resumed",
    "sandbox.lifecycle.killed",
    "sandbox.lifecycle.checkpointed",
]


@pytest.fixture()
def receiver() -> Iterator[Receiver]:
    with receiving() as state:
        yield state


def events(api: httpx.Client, sandbox_id: str, **params: Any) -> list[dict[str, Any]]:
    r = api.get(f"/events/sandboxes/{sandbox_id}", params={"orderAsc": "true", "limit": 100} | params)
    if r.status_code == 404:  # none written yet
        return []
    assert r.status_code == 200, r.text
    found: list[dict[str, Any]] = r.json()
    return found


def wait_events(api: httpx.Client, sandbox_id: str, count: int, timeout: float = 30) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = events(api, sandbox_id)
        if len(found) >= count:
            return found
        time.sleep(0.1)
    raise AssertionError(f"{events(api, sandbox_id)}")


def hook(api: httpx.Client, receiver: Receiver, secret: str = "a-long-enough-secret", **body: Any) -> dict[str, Any]:
    made = api.post(
        "/events/webhooks",
        json={"name": "test", "url": receiver.url, "events": ALL, "signatureSecret": secret} | body,
    )
    assert made.status_code == 201, made.text
    found: dict[str, Any] = made.json()
    return found


def test_a_sandboxs_life_is_told_in_order_with_e2bs_fields(e2b_env: Server, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=120, metadata={"rollout": "r1"})
    sbx.set_timeout(300)
    sbx.beta_pause()
    Sandbox.connect(sbx.sandbox_id, timeout=120)
    sbx.kill()
    got = wait_events(api, sbx.sandbox_id, 5)
    assert [e["type"].rsplit(".", 1)[1] for e in got][:1] == ["created"]
    kinds = [e["type"].rsplit(".", 1)[1] for e in got]
    # the resume's connect renews the timeout as E2B's does (an update); the rest in order
    assert [k for k in kinds if k != "updated"] == ["created", "paused", "resumed", "killed"], kinds
    assert kinds.index("updated") < kinds.index("paused")
    for e in got:
        assert e["sandboxId"] == sbx.sandbox_id and e["version"] == "v2"
        assert e["sandboxTemplateId"] and e["sandboxTeamId"] and e["sandboxBuildId"]
        assert e["timestamp"].endswith("Z") and len(e["id"]) == 36
        assert e["eventData"]["sandbox_metadata"] == {"rollout": "r1"}
    runs = {e["type"]: e["sandboxExecutionId"] for e in got}
    assert runs["sandbox.lifecycle.created"] != runs["sandbox.lifecycle.resumed"]  # a resume is a new run
    updated = next(e for e in got if e["type"] == "sandbox.lifecycle.updated")
    assert updated["eventData"]["set_timeout"].endswith("Z")
    paused = next(e for e in got if e["type"] == "sandbox.lifecycle.paused")
    assert set(paused["eventData"]["execution"]) == {"started_at", "vcpu_count", "memory_mb", "execution_time"}
    killed = got[-1]
    assert killed["type"] == "sandbox.lifecycle.killed" and killed["eventData"]["kill_reason"] == "request"
    # newest first by default; paging; a filter of several types
    newest = api.get(f"/events/sandboxes/{sbx.sandbox_id}").json()
    assert [e["id"] for e in newest] == [e["id"] for e in reversed(got)][:10]
    page = events(api, sbx.sandbox_id, offset=1, limit=2)
    assert [e["id"] for e in page] == [e["id"] for e in got[1:3]]
    picked = api.get(
        f"/events/sandboxes/{sbx.sandbox_id}",
        params=[("types", "sandbox.lifecycle.killed"), ("types", "sandbox.lifecycle.created")],
    ).json()
    assert [e["type"] for e in picked] == ["sandbox.lifecycle.killed", "sandbox.lifecycle.created"]
    team = api.get("/events/sandboxes", params={"limit": 100}).json()
    assert {e["id"] for e in got} <= {e["id"] for e in team} or len(team) == 100


def test_a_timeout_a_snapshot_and_a_fork_are_told(e2b_env: Server, api: httpx.Client) -> None:
    sbx = Sandbox.create(timeout=120)
    Sandbox.connect(sbx.sandbox_id, timeout=60)  # connecting to a running one: an update, as E2B's
    updated = wait_events(api, sbx.sandbox_id, 2)[1]
    assert updated["type"] == "sandbox.lifecycle.updated" and updated["eventData"]["set_timeout"].endswith("Z")
    assert api.post(f"/sandboxes/{sbx.sandbox_id}/snapshots", json={}).status_code == 201
    fork = api.post(f"/sandboxes/{sbx.sandbox_id}/fork", json={"count": 1})
    assert fork.status_code in (200, 201), fork.text
    child_id = fork.json()[0]["sandbox"]["sandboxID"]
    got = wait_events(api, sbx.sandbox_id, 4)
    kinds = ["created", "updated", "checkpointed", "checkpointed"]
    assert [e["type"] for e in got] == [f"sandbox.lifecycle.{k}" for k in kinds]
    assert [e["type"] for e in wait_events(api, child_id, 1)] == ["sandbox.lifecycle.created"]
    api.delete(f"/sandboxes/{child_id}")
    short = Sandbox.create(timeout=1)
    killed = wait_events(api, short.sandbox_id, 2)[-1]
    assert killed["type"] == "sandbox.lifecycle.killed" and killed["eventData"]["kill_reason"] == "timeout"
    sbx.kill()


def test_bad_queries_are_clear_400s(api: httpx.Client) -> None:
    for params in ({"limit": 0}, {"limit": 101}, {"offset": -1}, {"types": "sandbox.lifecycle.exploded"}):
        r = api.get("/events/sandboxes", params=params)
        assert r.status_code == 400, (params, r.text)
        assert set(r.json()) >= {"code", "message"}
    unknown = api.get("/events/sandboxes/nonesuch")
    assert unknown.status_code == 404 and "nonesuch" in unknown.json()["message"]


def test_webhooks_are_managed_with_e2bs_shapes_and_never_show_their_secret(
    api: httpx.Client, receiver: Receiver
) -> None:
    made = hook(api, receiver, secret="never-to-be-seen-again", events=["sandbox.lifecycle.killed"])
    assert set(made) == {"id", "teamId", "name", "createdAt", "enabled", "url", "events"}
    try:
        assert made["enabled"] is True and made["events"] == ["sandbox.lifecycle.killed"]
        listed = api.get("/events/webhooks").json()
        assert made["id"] in [h["id"] for h in listed]
        changed = api.patch(f"/events/webhooks/{made['id']}", json={"name": "renamed", "enabled": False})
        assert changed.status_code == 200 and changed.json()["name"] == "renamed"
        assert changed.json()["enabled"] is False and changed.json()["url"] == receiver.url
        again = api.get(f"/events/webhooks/{made['id']}").json()
        assert again == changed.json()
        for answer in (made, listed, changed.json(), again):
            assert "never-to-be-seen-again" not in json.dumps(answer)
    finally:
        assert api.delete(f"/events/webhooks/{made['id']}").status_code == 200
    assert api.get(f"/events/webhooks/{made['id']}").status_code == 404
    assert api.delete(f"/events/webhooks/{made['id']}").status_code == 404
    bad = [
        {"url": "ftp://example.com/x"},
        {"url": "not a url"},
        {"url": "http://user:pw@example.com/"},
        {"events": ["sandbox.lifecycle.exploded"]},
        {"signatureSecret": "short"},
        {"name": ""},
        {"extra": 1},
    ]
    for change in bad:
        body = {"name": "x", "url": receiver.url, "events": ALL, "signatureSecret": "long-enough-secret"} | change
        r = api.post("/events/webhooks", json=body)
        assert r.status_code == 400, (change, r.text)
    assert api.post("/events/webhooks", content=b"{", headers={"content-type": "application/json"}).status_code == 400


def test_deliveries_are_signed_in_order_and_retried(e2b_env: Server, api: httpx.Client, receiver: Receiver) -> None:
    secret = "whsec-" + "s" * 30
    made = hook(api, receiver, secret=secret)
    try:
        receiver.fail = 2  # the first event's first two attempts fail: it is retried, the rest wait for it
        sbx = Sandbox.create(timeout=120, metadata={"k": "v"})
        sbx.beta_pause()
        Sandbox.connect(sbx.sandbox_id, timeout=120)
        sbx.kill()
        got = receiver.wait(sbx.sandbox_id, 4)
        kinds = [b["type"].rsplit(".", 1)[1] for b in got]
        assert [k for k in kinds if k != "updated"] == ["created", "paused", "resumed", "killed"]
        attempts = [d for d in receiver.got if d.body["sandbox_id"] == sbx.sandbox_id]
        assert [d.headers["x-answered"] for d in attempts[:3]] == ["500", "500", "200"]
        assert len({d.body["id"] for d in attempts[:3]}) == 1  # one event, three attempts
        assert len({d.headers["e2b-delivery-id"] for d in attempts}) == len(attempts)
        for d in attempts:
            assert d.headers["e2b-webhook-id"] == made["id"]
            assert d.headers["e2b-signature-version"] == "v1"
            assert d.headers["e2b-signature"] == e2b_signature(secret, d.raw)
            assert d.headers["content-type"] == "application/json"
            body = d.body
            assert body["sandbox_id"] == sbx.sandbox_id and body["event_data"]["sandbox_metadata"] == {"k": "v"}
            assert {"sandbox_execution_id", "sandbox_template_id", "sandbox_build_id", "sandbox_team_id"} <= set(body)
        # the same events as the API's
        api_ids = [e["id"] for e in events(api, sbx.sandbox_id)]
        assert [b["id"] for b in got] == api_ids
        # disabled: nothing more; enabled again: only what happens from then on
        api.patch(f"/events/webhooks/{made['id']}", json={"enabled": False})
        quiet = Sandbox.create(timeout=60)
        quiet.kill()
        wait_events(api, quiet.sandbox_id, 2)
        time.sleep(1.5)
        assert receiver.of(quiet.sandbox_id) == []
        # a new secret signs from now on
        api.patch(f"/events/webhooks/{made['id']}", json={"enabled": True, "signatureSecret": "rotated-secret-1"})
        loud = Sandbox.create(timeout=60)
        loud.kill()
        receiver.wait(loud.sandbox_id, 2)
        last = [d for d in receiver.got if d.body["sandbox_id"] == loud.sandbox_id]
        assert all(d.headers["e2b-signature"] == e2b_signature("rotated-secret-1", d.raw) for d in last)
    finally:
        api.delete(f"/events/webhooks/{made['id']}")


def test_a_webhook_sees_only_the_types_it_asked_for(e2b_env: Server, api: httpx.Client, receiver: Receiver) -> None:
    made = hook(api, receiver, events=["sandbox.lifecycle.killed"])
    try:
        sbx = Sandbox.create(timeout=60)
        sbx.kill()
        got = receiver.wait(sbx.sandbox_id, 1)
        time.sleep(0.5)
        assert [b["type"] for b in receiver.of(sbx.sandbox_id)] == ["sandbox.lifecycle.killed"]
        assert got[0]["event_data"]["kill_reason"] == "request"
    finally:
        api.delete(f"/events/webhooks/{made['id']}")


def test_webhook_addresses_follow_the_operators_rule() -> None:
    strict, open_ = UrlRule(allow_private=False), UrlRule(allow_private=True)
    for address in ("127.0.0.1", "10.1.2.3", "192.168.0.1", "169.254.169.254", "::1", "::ffff:127.0.0.1", "fd00::1"):
        assert not strict.allows(address), address
        assert open_.allows(address), address
    for address in ("0.0.0.0", "::", "224.0.0.1"):
        assert not open_.allows(address), address
    assert strict.allows("8.8.8.8") and strict.allows("2606:4700:4700::1111")
    for url in ("http://127.0.0.1:9/x", "http://localhost/x", "http://[::1]/", "http://169.254.169.254/latest"):
        with pytest.raises(InvalidRequest, match="loopback, private or link-local"):
            asyncio.run(strict.check_registration(url))
        asyncio.run(open_.check_registration(url))
    assert UrlRule.of("auto", "127.0.0.1").allow_private and not UrlRule.of("auto", "0.0.0.0").allow_private
    assert not UrlRule.of("deny", "127.0.0.1").allow_private and UrlRule.of("allow", "0.0.0.0").allow_private
