"""The gateway's control-plane API, as one table read top to bottom: the first entry whose methods
and path (a regular expression the whole path must match) fit a request answers it. Sandbox
traffic (a request naming a sandbox by its headers, its host or a signed URL) never gets here: it
is the sandbox's whatever its path (aenv/cluster/gateway/traffic.py).

An entry's ``access``: OPEN ones are answered before the API key is checked; every other one
needs the key first (a lookup must not tell a stranger which sandboxes exist), except what the
nodes open without it (their public routes, a signed upload); ADMIN ones need the admin key's
team. ``kind`` is the route's label on the gateway's metrics."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from starlette.requests import Request
from starlette.responses import Response

from aenv.cluster.gateway.admin import NodeRoutes
from aenv.cluster.gateway.artifacts import Artifacts
from aenv.cluster.gateway.creates import Creates
from aenv.cluster.gateway.listings import Lists
from aenv.cluster.gateway.relay import Relay
from aenv.cluster.gateway.sandboxes import SandboxRoutes

Handler = Callable[[Request, re.Match[str]], Awaitable[Response | Relay]]


class Access(Enum):
    OPEN = "open"
    KEY = "key"
    ADMIN = "admin"


OPEN, KEY, ADMIN = Access.OPEN, Access.KEY, Access.ADMIN
ANY = "*"  # every method
# The rest of a path, newlines included (a decoded %0A): "/nodes/..." is the nodes' whatever follows.
REST = r"(?s:.*)"
# A sandbox's own path. What follows its id stops at a newline but for one at the very end ("\n?"):
# a decoded %0A routes as it did when these were `re.match` with "$" (which allows that one).
SANDBOX = r"(?:/v2)?/sandboxes/(?P<id>[^/]+)"


@dataclass(frozen=True, slots=True)
class Route:
    methods: frozenset[str]  # empty: every method
    path: re.Pattern[str]
    handler: Handler
    kind: str
    access: Access

    def match(self, method: str, path: str) -> re.Match[str] | None:
        if self.methods and method not in self.methods:
            return None
        return self.path.fullmatch(path)


def route(methods: str, path: str, handler: Handler, kind: str, access: Access = KEY) -> Route:
    """``methods``: space-separated, or ANY."""
    return Route(frozenset() if methods == ANY else frozenset(methods.split()), re.compile(path), handler, kind, access)


def find(routes: list[Route], method: str, path: str) -> tuple[Route, re.Match[str]]:
    for candidate in routes:
        matched = candidate.match(method, path)
        if matched is not None:
            return candidate, matched
    raise LookupError(f"no route for {method} {path[:100]!r}")  # the table ends with a catch-all


class OwnRoutes(Protocol):
    """What the gateway answers itself, before any key."""

    async def health(self, request: Request, match: re.Match[str]) -> Response: ...

    async def prometheus(self, request: Request, match: re.Match[str]) -> Response: ...

    async def dashboard(self, request: Request, match: re.Match[str]) -> Response: ...


def table(
    own: OwnRoutes, nodes: NodeRoutes, sandboxes: SandboxRoutes, creates: Creates, lists: Lists, artifacts: Artifacts
) -> list[Route]:
    return [
        route("GET HEAD", r"/health", own.health, "own", OPEN),
        route("GET HEAD", r"/metrics", own.prometheus, "own", OPEN),
        route(ANY, r"/dashboard(?:/" + REST + ")?", own.dashboard, "own", OPEN),  # its data checks the key
        # the cluster's nodes
        route("POST", r"/nodes/(?P<id>[^/]+)/drain", nodes.drain, "nodes", ADMIN),
        route("POST", r"/nodes/(?P<id>[^/]+)/undrain", nodes.undrain, "nodes", ADMIN),
        route("POST", r"/nodes/(?P<id>[^/]+)", nodes.change_status, "nodes", ADMIN),
        route("GET HEAD", r"/nodes/?", nodes.nodes, "nodes", ADMIN),
        route("GET HEAD", r"/nodes/(?P<id>" + REST + ")", nodes.node, "nodes", ADMIN),
        route(ANY, r"/nodes(?:/" + REST + ")?", nodes.not_a_route, "nodes", ADMIN),  # 405
        # one sandbox, at its node (several: their metrics)
        route("GET", r"/sandboxes/metrics", lists.metrics, "list"),
        route("GET", r"/sandboxes/(?P<id>[^/]+)", sandboxes.info, "sandbox"),
        route("DELETE", r"/sandboxes/(?P<id>[^/]+)", sandboxes.kill, "sandbox"),
        route("POST", SANDBOX + r"/(?:connect|resume)\n?", sandboxes.resume, "sandbox"),
        route("POST", SANDBOX + r"(?:/.*)?(?<=/fork)", sandboxes.fork, "sandbox"),
        route("POST", SANDBOX + r"(?:/.*)?(?<=/snapshots)", sandboxes.snapshot, "sandbox"),
        route(ANY, SANDBOX + r"(?:/.*)?\n?", sandboxes.other, "sandbox"),
        # creates and lists
        route("POST", r"(?:/v2)?/sandboxes", creates.create, "create"),
        route("GET", r"(?:/v2)?/sandboxes", lists.sandboxes, "list"),
        route("GET", r"/snapshots", lists.snapshots, "list"),
        # templates, snapshots, the rest of the node-wide API: any node (or the one that knows more)
        route("POST", r"/v3/templates", artifacts.build, "other"),
        route(ANY, REST, artifacts.forward, "other"),
    ]
