"""Control-plane routes: sandboxes, snapshots, fork, templates (E2B paths where E2B has the concept).

One module per group of routes, joined into one :data:`router` here: :mod:`.create`, :mod:`.lists`,
:mod:`.metrics`, :mod:`.lifecycle`, :mod:`.network`, :mod:`.snapshots`, :mod:`.templates`; what they
all read off a request is in :mod:`.requests`. The order matters where paths overlap:
``GET /sandboxes/metrics`` comes before ``GET /sandboxes/{sandbox_id}``.
"""

from __future__ import annotations

from fastapi import APIRouter

from aenv.api.sandboxes import create, lifecycle, lists, metrics, network, snapshots, templates
from aenv.api.sandboxes.lists import parse_metadata_query, parse_states
from aenv.api.sandboxes.requests import (
    _body,
    add_body_schemas,
    build_host_of,
    declared_length,
    domain_of,
    json_body,
    node_of,
    quotas_of,
)

__all__ = [
    "_body",
    "add_body_schemas",
    "build_host_of",
    "declared_length",
    "domain_of",
    "json_body",
    "node_of",
    "parse_metadata_query",
    "parse_states",
    "quotas_of",
    "router",
]

router = APIRouter()
for group in (create, lists, metrics, lifecycle, network, snapshots, templates):
    router.include_router(group.router)
