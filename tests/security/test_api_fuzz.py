"""Schemathesis against the real server's OpenAPI document: valid and invalid inputs for every
control-plane operation, and not one answer is a 5xx; every error is JSON with `code` and `message`.

Bounded for CI (AENV_FUZZ_EXAMPLES examples per operation and mode, 50 by default: about a
minute and a half); raise it for a longer run. Sandboxes the fuzzer creates are killed at once, and anything
it leaves is removed at the end; the templates and snapshots that exist before the run are never
touched (the server is shared by the whole session).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error

from aenv.errors import InvalidRequest
from aenv.images.reference import ImageRef
from tests.conftest import API_KEY, Server

pytestmark = pytest.mark.sandbox
EXAMPLES = int(os.environ.get("AENV_FUZZ_EXAMPLES", "50"))
# These pull images from a registry named in the request: the fuzzer would send the node to
# arbitrary hosts. Their bodies are covered by test_api_hostile against a loopback address.
LEAVES_THE_MACHINE = [
    "/templates/from-image",
    "/v2/templates/{template_id}/builds/{build_id}",
    "/images/prefetch",  # its bodies: tests/images/test_image_cache.py, against loopback registries
]
CREATES = {"/sandboxes", "/v2/sandboxes"}
NOWHERE = "127.0.0.1:9"  # a registry of this machine that refuses at once (discard's port, closed)


@pytest.fixture(scope="module")
def api_schema(server: Server) -> Any:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    schema.config.generation.update(
        modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE], max_examples=EXAMPLES, allow_x00=True
    )
    return schema


@pytest.fixture(scope="module")
def existing(server: Server) -> Iterator[set[str]]:
    """Names, ids and aliases of the templates and snapshots there before the run; what the run
    adds is removed after it."""
    with server.client() as api:
        before = _inventory(api)
        yield {name for names in before.values() for name in names}
        after = _inventory(api)
        for sandbox_id in after["sandboxes"] - before["sandboxes"]:
            api.delete(f"/sandboxes/{sandbox_id}")
        for snapshot_id in after["snapshots"] - before["snapshots"]:
            api.delete(f"/snapshots/{snapshot_id}")
        for template_id in after["templates"] - before["templates"]:
            api.delete(f"/templates/{template_id}", params={"force": "true"})
        for webhook_id in after["webhooks"] - before["webhooks"]:
            api.delete(f"/events/webhooks/{webhook_id}")


def _inventory(api: httpx.Client) -> dict[str, set[str]]:
    templates = api.get("/templates").json()
    return {
        "sandboxes": {s["sandboxID"] for s in api.get("/v2/sandboxes").json()},
        "snapshots": {s["snapshotID"] for s in api.get("/snapshots").json()},
        "templates": {t["templateID"] for t in templates} | {a for t in templates for a in t["aliases"]},
        "webhooks": {h["id"] for h in api.get("/events/webhooks").json()},
    }


schema = schemathesis.pytest.from_fixture("api_schema").exclude(path=LEAVES_THE_MACHINE)


class Target:
    """A real sandbox that every third case naming a sandbox is sent to, so generated values reach
    the operations themselves and not only the lookup (made again when a case killed or expired it)."""

    def __init__(self, server: Server) -> None:
        self.server, self.cases, self.sandbox_id = server, 0, ""

    def take(self, case: Case) -> None:
        if "sandbox_id" not in (case.path_parameters or {}) or case.method == "DELETE":
            return
        self.cases += 1
        if self.cases % 3:
            return
        with self.server.client() as api:
            if not self.sandbox_id or api.get(f"/sandboxes/{self.sandbox_id}").status_code == 404:
                r = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 600})
                assert r.status_code == 201, r.text
                self.sandbox_id = r.json()["sandboxID"]
        case.path_parameters["sandbox_id"] = self.sandbox_id
        if case.path.endswith("/fork") and isinstance(case.body, dict) and isinstance(case.body.get("count"), int):
            case.body["count"] = min(case.body["count"], 2)  # children cost a restore each


@pytest.fixture(scope="module")
def target(server: Server, existing: set[str]) -> Target:
    return Target(server)  # `existing` removes whatever it made


@schemathesis.serializer("application/x-tar")
def build_context(ctx: Any, value: Any) -> bytes:
    """What the fuzzer makes up for a build context, sent as it is (not a tar, mostly)."""
    return value if isinstance(value, bytes) else str(value).encode()


@schema.parametrize()
@settings(deadline=None, database=None, suppress_health_check=list(HealthCheck), max_examples=EXAMPLES)
def test_no_input_is_a_server_error(case: Case, server: Server, existing: set[str], target: Target) -> None:
    assert case.path not in LEAVES_THE_MACHINE
    if _touches(case, existing):
        return  # never rename, retag or delete what the rest of the session relies on
    target.take(case)
    pulls = False
    if case.method == "POST" and case.path in CREATES and isinstance(case.body, dict):
        # each new disk size makes the node format a pool of spare uppers: keep to the default one
        limits = case.body.get("limits")
        if isinstance(limits, dict) and "diskSizeMB" in limits:
            limits["diskSizeMB"] = 2048
        pulls = _kept_on_the_machine(case.body)
    if case.path.startswith("/events/webhooks") and isinstance(case.body, dict):
        _deliveries_kept_on_the_machine(case.body)
    response = case.call(base_url=server.url, headers={"X-API-Key": API_KEY}, timeout=120)
    if case.method == "POST" and case.path in CREATES and response.status_code == 201:
        httpx.delete(f"{server.url}/sandboxes/{response.json()['sandboxID']}", headers={"X-API-Key": API_KEY})
    if pulls and response.status_code == 502 and response.json().get("error_code") == "upstream_error":
        return  # the registry it names refused the connection: the registry's failure, said as such
    case.validate_response(response, checks=[not_a_server_error])
    if response.status_code >= 400:
        try:
            error = response.json()
        except ValueError:
            pytest.fail(f"{case.method} {case.formatted_path}: {response.status_code} is not JSON: {response.text!r}")
        assert isinstance(error, dict) and error.get("code") and error.get("message"), (
            f"{case.method} {case.formatted_path}: {response.status_code} {response.text!r}"
        )


def _kept_on_the_machine(body: dict[str, Any]) -> bool:
    """A create may name an image (its `image`, or a `templateID` that is a reference): pulled from
    the registry it names, which a fuzzer must not choose. A reference is sent to a closed port of
    this machine instead, the rest of it as generated. Whether the create may pull."""
    pulls = False
    for key in ("templateID", "image"):
        value = body.get(key)
        if not isinstance(value, str) or (key == "templateID" and not any(m in value for m in "/:@")):
            continue
        try:
            ref = ImageRef.parse(value)
        except InvalidRequest:
            continue  # a 400, asking no one
        body[key] = str(replace(ref, registry=NOWHERE))
        pulls = True
    return pulls


def _deliveries_kept_on_the_machine(body: dict[str, Any]) -> None:
    """A webhook's URL, when it is one the node would deliver to, sent to a closed port here: the
    fuzzer must not choose where the node's requests go (nor have names looked up)."""
    url = body.get("url")
    if not isinstance(url, str):
        return
    try:
        parts = urlsplit(url)
        named = parts.scheme in ("http", "https") and parts.hostname
    except ValueError:
        return
    if named:
        body["url"] = urlunsplit(parts._replace(netloc=NOWHERE))


def _touches(case: Case, names: set[str]) -> bool:
    values = [*(case.path_parameters or {}).values(), *_strings(case.body)]
    return any(isinstance(v, str) and (v in names or v.split(":", 1)[0] in names) for v in values)


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list):
        return [s for v in value for s in _strings(v)]
    return []
