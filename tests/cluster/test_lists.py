"""`GET /v2/sandboxes` through a gateway keeps one node's contract over the cluster: keyset pages
(a token is a position, so sandboxes created or killed between two pages shift nothing), both
orders, filters, `X-Total-Running`; a token any node would take."""

from __future__ import annotations

import base64
import uuid
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.cluster import Cluster, running_cluster
from tests.conftest import Server

pytestmark = pytest.mark.sandbox


@pytest.fixture(scope="module")
def cluster(server: Server) -> Iterator[Cluster]:
    with running_cluster(gateways=1) as c:
        yield c


def page(api: httpx.Client, run: str, limit: int, token: str | None = None, **params: str) -> httpx.Response:
    query = {"metadata": f"suite={run}", "limit": str(limit), **params, **({"nextToken": token} if token else {})}
    r = api.get("/v2/sandboxes", params=query)
    assert r.status_code == 200, r.text
    return r


def ids(r: httpx.Response) -> list[str]:
    return [item["sandboxID"] for item in r.json()]


@pytest.mark.parametrize("order", ["desc", "asc"])
def test_pages_stay_put_while_sandboxes_come_and_go(cluster: Cluster, order: str) -> None:
    run = uuid.uuid4().hex[:8]
    made: list[str] = []
    with cluster.api() as api:
        try:
            for _ in range(5):
                r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"suite": run}})
                assert r.status_code == 201, r.text
                made.append(r.json()["sandboxID"])
            on = {api.get(f"/sandboxes/{sid}").json()["nodeID"] for sid in made}
            assert on == set(cluster.nodes)  # the pages below merge both nodes
            whole = page(api, run, 100, order=order)
            assert sorted(ids(whole)) == sorted(made) and "x-next-token" not in whole.headers
            assert whole.headers["x-total-running"] == "5"
            expected = ids(whole)
            first = page(api, run, 2, order=order)
            assert ids(first) == expected[:2]
            token = first.headers["x-next-token"]
            assert "__" in base64.urlsafe_b64decode(token).decode()  # a position, as one node's
            # between two pages: one served already is killed, a new one is made (newest of all)
            api.delete(f"/sandboxes/{expected[0]}")
            r = api.post("/sandboxes", json={"templateID": "base", "timeout": 120, "metadata": {"suite": run}})
            made.append(r.json()["sandboxID"])
            second = page(api, run, 2, first.headers["x-next-token"], order=order)
            assert ids(second) == expected[2:4]  # nothing skipped, nothing twice
            third = page(api, run, 2, second.headers["x-next-token"], order=order)
            tail = expected[4:] + ([made[-1]] if order == "asc" else [])
            assert ids(third) == tail[:2]
            assert ("x-next-token" in third.headers) == (len(tail) > 2)
            # filters still the nodes': only paused ones, none here; a paused one then
            assert ids(page(api, run, 10, state="paused", order=order)) == []
            assert api.post(f"/sandboxes/{expected[1]}/pause").status_code == 204
            paused = page(api, run, 10, state="paused", order=order)
            assert ids(paused) == [expected[1]] and "x-total-running" not in paused.headers
            assert page(api, run, 10, order=order).headers["x-total-running"] == "4"
            # a token of the other order, or not a token, is the client's 400
            other = "asc" if order == "desc" else "desc"
            assert api.get("/v2/sandboxes", params={"nextToken": token, "order": other}).status_code == 400
            assert api.get("/v2/sandboxes", params={"nextToken": "bm90IGEgdG9rZW4"}).status_code == 400
        finally:
            for sid in made:
                api.delete(f"/sandboxes/{sid}")
