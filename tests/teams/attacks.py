"""Team B's attempts on team A's sandboxes, snapshot, template, team and keys, on every route of
the node's app (read from the app itself), against a node or a gateway."""

from __future__ import annotations

import re
import secrets
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest.mock import MagicMock

import httpx
import pytest

from aenv.api.app import create_app
from aenv.teams.guard import BUILD_ROUTES
from tests.teams.conftest import TeamKey

PARAM = re.compile(r"\{(\w+)(?::\w+)?\}")
# Routes without a path parameter, and what another team may do there (checked below):
#   list: answers, naming nothing of A; public: open without a key; page: the dashboard's files;
#   admin: 403; own: acts on B's own team; ref: names A's object in its body or query, answered
#   as a name that does not exist; claim: takes A's template name, refused (409) as E2B does.
UNSCOPED: dict[tuple[str, str], str] = {
    ("GET", "/openapi.json"): "public",
    ("GET", "/docs"): "public",
    ("GET", "/docs/oauth2-redirect"): "public",
    ("GET", "/redoc"): "public",
    ("GET", "/health"): "public",
    ("GET", "/metrics"): "public",
    ("GET", "/dashboard"): "page",
    ("GET", "/dashboard/"): "page",
    ("GET", "/dashboard/static/{name}"): "page",
    ("GET", "/v2/sandboxes"): "list",
    ("GET", "/sandboxes"): "list",
    ("GET", "/sandboxes/metrics"): "ref",
    ("GET", "/snapshots"): "list",
    ("GET", "/templates"): "list",
    ("GET", "/v2/templates"): "list",  # another team's teamID: 403 (below)
    ("GET", "/default-templates"): "list",
    ("GET", "/dashboard/api/nodes"): "list",
    ("GET", "/dashboard/api/stats"): "list",
    ("GET", "/dashboard/api/artifacts"): "list",
    ("GET", "/teams"): "list",
    ("GET", "/api-keys"): "list",
    ("POST", "/api-keys"): "own",
    ("POST", "/teams"): "admin",
    ("GET", "/repository"): "admin",
    ("POST", "/repository/gc"): "admin",
    ("GET", "/images"): "admin",
    ("POST", "/images/prefetch"): "admin",
    ("GET", "/images/prefetch/{prefetch_id}"): "admin",
    ("POST", "/sandboxes"): "ref",
    ("POST", "/v2/sandboxes"): "ref",
    ("POST", "/templates/tags"): "ref",
    ("DELETE", "/templates/tags"): "ref",
    ("POST", "/templates/from-image"): "claim",
    ("POST", "/templates/build"): "claim",
    ("POST", "/v3/templates"): "claim",
    ("GET", "/events/sandboxes"): "list",
    ("GET", "/events/webhooks"): "list",
    ("POST", "/events/webhooks"): "own",
    ("GET", "/volumes"): "list",
    ("POST", "/volumes"): "own",
    ("GET", "/secrets"): "list",
    ("POST", "/secrets"): "own",
}
# Bodies that are valid, so that a route reaches its lookup (an id that does not exist: its 404).
BODIES: dict[tuple[str, str], Any] = {
    ("POST", "/sandboxes/{sandbox_id}/timeout"): {"timeout": 60},
    ("PUT", "/sandboxes/{sandbox_id}/network"): {"allowOut": ["10.0.0.1"]},
    ("POST", "/sandboxes/{sandbox_id}/refreshes"): {"duration": 60},
    ("POST", "/sandboxes/{sandbox_id}/fork"): {"count": 1},
    ("POST", "/sandboxes/{sandbox_id}/snapshots"): {"name": "stolen"},
    ("PATCH", "/templates/{template_id}"): {"public": True},
    ("PUT", "/templates/{template_id}/warm-pool"): {"size": 1},
    ("PATCH", "/teams/{team_id}"): {"name": "stolen"},
    ("PATCH", "/api-keys/{api_key_id}"): {"name": "stolen"},
    ("POST", "/admin/teams/{team_id}/api-keys"): {"name": "stolen"},
    ("PATCH", "/events/webhooks/{webhook_id}"): {"name": "stolen"},
    ("POST", "/secrets/{secret_ref}"): {"value": "stolen"},
}


def app_routes() -> list[tuple[str, str]]:
    """Every (method, path) of the node's app, read from the app (HEAD aside)."""
    node = MagicMock()
    node.settings.cluster = None
    node.settings.data_dir = Path("/nonexistent")
    app = create_app(node, start_node=False)
    found: list[tuple[str, str]] = []

    def walk(routes: list[Any], prefix: str = "") -> None:
        for route in routes:
            inner = getattr(route, "original_router", None)
            if inner is not None:
                walk(inner.routes, prefix + route.include_context.prefix)
            elif getattr(route, "methods", None):
                found.extend((m, prefix + route.path) for m in sorted(route.methods - {"HEAD"}))

    walk(app.router.routes)
    assert len(found) > 50
    return found


@dataclass
class Owned:
    """Team A's things."""

    team: TeamKey
    running: str
    paused: str
    snapshot: str
    template: str
    key_id: str
    webhook: str
    volume: str
    secret: str


def make_owned(a: TeamKey, layout: Path) -> Owned:
    """A's things, made through ``a.url`` (a node or a gateway): two sandboxes (one paused), a
    snapshot, a template from the busybox image at ``layout``."""
    with a.client() as client:
        running = client.post("/sandboxes", json={"templateID": "bb", "timeout": 600}).json()["sandboxID"]
        paused = client.post("/sandboxes", json={"templateID": "bb", "timeout": 600}).json()["sandboxID"]
        assert client.post(f"/sandboxes/{paused}/pause").status_code == 204
        snap = client.post(f"/sandboxes/{running}/snapshots", json={"name": f"a-snap-{secrets.token_hex(3)}"})
        assert snap.status_code == 201, snap.text
        name = f"a-tpl-{secrets.token_hex(3)}"
        made = client.post("/templates/from-image", json={"name": name, "image": f"oci:{layout}:v1"})
        assert made.status_code == 201, made.text
        key_id = client.get("/api-keys").json()[0]["id"]
        hook = {"name": "a's", "url": "http://127.0.0.1:9/a", "events": ["sandbox.lifecycle.killed"]}
        webhook = client.post("/events/webhooks", json={**hook, "signatureSecret": "a-secret-of-a"})
        assert webhook.status_code == 201, webhook.text
        volume = client.post("/volumes", json={"name": f"a-vol-{secrets.token_hex(3)}"})
        assert volume.status_code == 201, volume.text
        secret = client.post("/secrets", json={"name": f"a-secret-{secrets.token_hex(3)}", "value": "a's value"})
        assert secret.status_code == 201, secret.text
    snapshot_id, volume_id = snap.json()["snapshotID"], volume.json()["volumeID"]
    return Owned(a, running, paused, snapshot_id, name, key_id, webhook.json()["id"], volume_id, secret.json()["name"])


def drop_owned(a: Owned) -> None:
    with a.team.client() as client:
        client.delete(f"/sandboxes/{a.running}")
        client.delete(f"/sandboxes/{a.paused}")
        client.delete(f"/snapshots/{a.snapshot}")
        client.delete(f"/templates/{a.template}")
        client.delete(f"/events/webhooks/{a.webhook}")
        client.delete(f"/volumes/{a.volume}")
        client.delete(f"/secrets/{a.secret}")


def _values(a: Owned, which: str) -> dict[str, str]:
    """Path parameters naming A's things, or (``none``) things of the same shape that do not exist."""
    if which == "none":
        return {
            "sandbox_id": "zz" + secrets.token_hex(9),
            "snapshot_id": "snap_" + secrets.token_hex(8),
            "template_id": "nope-" + secrets.token_hex(4),
            "alias": "nope-" + secrets.token_hex(4),
            "team_id": str(uuid.uuid4()),
            "api_key_id": str(uuid.uuid4()),
            "event_sandbox_id": "zz" + secrets.token_hex(9),
            "webhook_id": str(uuid.uuid4()),
            "volume_id": str(uuid.uuid4()),
            "secret_ref": "nope-" + secrets.token_hex(4),
        }
    return {
        "sandbox_id": a.paused if which == "paused" else a.running,
        "snapshot_id": a.snapshot,
        "template_id": a.snapshot if which == "snapshot" else a.template,
        "alias": a.template,
        "team_id": a.team.team_id,
        "api_key_id": a.key_id,
        "event_sandbox_id": a.paused if which == "paused" else a.running,
        "webhook_id": a.webhook,
        "volume_id": a.volume,
        "secret_ref": a.secret,
    }


FIXED = {"build_id": str(uuid.UUID(int=7)), "files_hash": "ab" * 32, "name": "app.js", "prefetch_id": "p1"}


def _normalized(r: httpx.Response, values: dict[str, str]) -> tuple[int, str]:
    text = re.sub(r"token=[0-9a-f]+", "token=<TOKEN>", r.text)
    text = re.sub(r"https?://[^/\"]+", "<HOST>", text)  # a gateway: whichever node answered
    for value in sorted(values.values(), key=len, reverse=True):
        text = text.replace(value, "<ID>")
    return r.status_code, text


def routes_with_ids(a: Owned, b: TeamKey, extra: list[tuple[str, str]] | None = None) -> int:
    """Every route with a path parameter, with A's ids as B: answered as ids that do not exist
    (status and body, the ids aside). Returns how many requests were compared."""
    attacked = 0
    with b.client() as client:
        for method, path in [*app_routes(), *(extra or [])]:
            params = PARAM.findall(path)
            if not params or (method, PARAM.sub(lambda m: "{" + m.group(1) + "}", path)) in UNSCOPED:
                continue
            template = PARAM.sub(lambda m: "{" + m.group(1) + "}", path)
            body = BODIES.get((method, template))
            for which in ("running", "paused", "snapshot"):
                foreign, missing = {**_values(a, which), **FIXED}, {**_values(a, "none"), **FIXED}
                names = params
                url_a = template.format(**{n: foreign[n] for n in names})
                url_none = template.format(**{n: missing[n] for n in names})
                got = client.request(method, url_a, json=body, params={"token": "x"})
                baseline = client.request(method, url_none, json=body, params={"token": "x"})
                # an E2B build's file links answer for any name (uploads are kept by content hash)
                assert got.status_code >= 400 or template in BUILD_ROUTES, (method, url_a, got.text[:300])
                assert _normalized(got, foreign) == _normalized(baseline, missing), (method, template, which, got.text)
                attacked += 1
    untouched(a)
    return attacked


def routes_without_ids(a: Owned, b: TeamKey, layout: Path) -> None:
    """Every route without a path parameter is in UNSCOPED, and holds as it says (as B)."""
    unscoped = {
        (method, PARAM.sub(lambda m: "{" + m.group(1) + "}", path))
        for method, path in app_routes()
        if not PARAM.search(path) or (method, PARAM.sub(lambda m: "{" + m.group(1) + "}", path)) in UNSCOPED
    }
    assert unscoped - UNSCOPED.keys() == set(), "new routes: say in UNSCOPED what another team may do there"
    secrets_of_a = [a.running, a.paused, a.snapshot, a.template, a.team.team_id, a.key_id, a.team.key]
    secrets_of_a += [a.webhook, a.volume, a.secret]
    with b.client() as client:
        for (method, path), kind in sorted(UNSCOPED.items()):
            if (method, path) not in unscoped:
                continue
            url = path.format(name="app.js", prefetch_id="p1")
            if kind == "list":
                r = client.request(method, url)
                assert r.status_code == 200, (url, r.text[:300])
                assert not [s for s in secrets_of_a if s in r.text], (url, r.text[:300])
            elif kind == "admin":
                r = client.request(method, url, json={"images": []} if method == "POST" else None)
                assert r.status_code == 403, (method, url, r.status_code)
        # ids of A's in bodies and queries: answered as names that do not exist
        for source in (a.template, a.snapshot):
            for path in ("/sandboxes", "/v2/sandboxes"):
                got = client.post(path, json={"templateID": source})
                none = client.post(path, json={"templateID": "nope-x"})
                assert _normalized(got, {"s": source}) == _normalized(none, {"s": "nope-x"})
        got = client.post("/templates/tags", json={"target": a.template, "tags": ["stolen"]})
        none = client.post("/templates/tags", json={"target": "nope-x", "tags": ["stolen"]})
        assert got.status_code == 404 and _normalized(got, {"s": a.template}) == _normalized(none, {"s": "nope-x"})
        got = client.request("DELETE", "/templates/tags", json={"name": a.template, "tags": ["latest"]})
        none = client.request("DELETE", "/templates/tags", json={"name": "nope-x", "tags": ["latest"]})
        assert got.status_code == 404 and _normalized(got, {"s": a.template}) == _normalized(none, {"s": "nope-x"})
        assert client.get("/v2/templates", params={"teamID": a.team.team_id}).status_code == 403
        metrics = client.get("/sandboxes/metrics", params={"sandbox_ids": f"{a.running},{a.paused}"})
        assert metrics.status_code == 200 and metrics.json() == {"sandboxes": {}}
        # A's template name cannot be taken over: never a rebuild of another team's template
        claims = [
            client.post("/templates/from-image", json={"name": a.template, "image": f"oci:{layout}:v1"}),
            client.post("/v3/templates", json={"name": a.template}),
            client.post("/templates/build", params={"name": a.template}, content=b""),
            client.patch(f"/templates/{a.template}", json={"aliases": ["x"]}),
        ]
        assert [r.status_code for r in claims[:3]] == [409, 409, 409], [r.text for r in claims]
        assert "already used" in claims[0].json()["message"]
        assert claims[3].status_code == 404
        made = client.post("/api-keys", json={"name": "own"})  # its own team's
        assert made.status_code == 201
        client.delete(f"/api-keys/{made.json()['id']}")
    untouched(a)


def envd_traffic(a: Owned, b: TeamKey) -> None:
    """B's E2B SDK, B's access token, B's signed URL: none reaches A's sandbox."""
    from e2b import Sandbox
    from e2b.exceptions import NotFoundException

    url = b.url
    with pytest.raises(NotFoundException):
        Sandbox.connect(a.running, api_key=b.key, api_url=url, sandbox_url=url)
    assert Sandbox.kill(a.running, api_key=b.key, api_url=url) is False
    own = Sandbox.create("bb", api_key=b.key, api_url=url, sandbox_url=url, timeout=60)
    try:
        token = own._envd_access_token
        assert token
        run = {"E2b-Sandbox-Id": a.running, "E2b-Sandbox-Port": "49983", "Connect-Protocol-Version": "1"}
        for headers in ({"X-Access-Token": token}, {"X-API-Key": b.key}, {}):
            r = httpx.post(
                f"{url}/process.Process/List", json={}, headers={**run, **headers, "Content-Type": "application/json"}
            )
            assert r.status_code == 401, (headers, r.status_code, r.text[:200])
        signed = own.download_url("/etc/hostname", use_signature_expiration=60)
        stolen = httpx.get(signed, headers={"E2b-Sandbox-Id": a.running, "E2b-Sandbox-Port": "49983"})
        assert stolen.status_code == 401
        assert httpx.get(signed).status_code == 200  # its own sandbox's URL works
    finally:
        own.kill()
    untouched(a)


def untouched(a: Owned) -> None:
    with a.team.client() as client:
        running = client.get(f"/sandboxes/{a.running}")
        assert running.status_code == 200 and running.json()["state"] == "running"
        assert client.get(f"/sandboxes/{a.paused}").json()["state"] == "paused"
        assert client.get(f"/snapshots/{a.snapshot}").status_code == 200
        deadline = time.monotonic() + 10  # a gateway sends it to the node that holds it once its entry says so
        while (template := client.get(f"/templates/{a.template}")).status_code == 404 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert template.status_code == 200 and template.json()["public"] is False, template.text
        team = client.get(f"/teams/{a.team.team_id}").json()
        assert team["name"] == "iso-a"
        assert [k["name"] for k in client.get("/api-keys").json()] == ["default"]
        bb = client.get("/templates/bb")
        assert bb.status_code == 200, bb.text
