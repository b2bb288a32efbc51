"""What a request's team may see: every route of the node passes through here.

- ``check_route``, a dependency of every API route: each path parameter that names a sandbox,
  template or snapshot of another team is answered exactly as one that does not exist (404, the
  same message), before the route runs; admin routes refuse other keys (403); a path parameter
  this module does not know is refused to team keys (a new route must say what it names:
  tests/teams/test_isolation.py walks every route).
- ``TeamView``, what ``node_of(request)`` hands the routes for a team key: the node with only the
  team's sandboxes, templates (and public ones) and snapshots in its lookups and lists, so ids in
  bodies and queries, and every list, are held to the same rule.
- ``claim_template_name``: a build or alias may not take over another team's template name.

Requests with the admin key and X-Team-ID ``*`` (the deployment's own calls) and requests to a
node without an API key see everything.
"""

from __future__ import annotations

import logging
import re
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from fastapi import Request

from aenv.errors import Conflict, Forbidden, NotFound, SandboxNotFound, SnapshotNotFound, TemplateNotFound
from aenv.node.service import (
    DEFAULT_SPEC,
    LiveSandbox,
    NodeService,
    SandboxRecord,
    SandboxSpec,
    SnapshotRecord,
    TemplateRecord,
)
from aenv.teams.model import DEFAULT_TEAM, PUBLIC_TEMPLATES, Principal, current, template_visible

log = logging.getLogger("aenv.teams")
ID = re.compile(r"[a-z0-9]{1,128}")  # what a sandbox id can be (aenv/api/listing.py short_sandbox_id)

# Path parameters that name something of a team, and the check each gets.
SANDBOX_PARAMS = frozenset({"sandbox_id"})
SNAPSHOT_PARAMS = frozenset({"snapshot_id"})
TEMPLATE_PARAMS = frozenset({"template_id", "alias"})  # a template (or, where routes take one, a snapshot)
# Path parameters scoped by another one of the same path, or by the principal itself.
SCOPED_PARAMS = frozenset(
    {
        "build_id",  # under /templates/{template_id}/builds/
        "files_hash",  # under /templates/{template_id}/files/
        "api_key_id",  # the principal's team's keys only (aenv/teams/registry.py)
        "team_id",  # the principal's own team, or any for the admin key (aenv/teams/routes.py)
        "name",  # the dashboard's static files
        "prefetch_id",  # an image prefetch job: image references the node pulls, no team's data
        "event_sandbox_id",  # the principal's team's events only, a killed sandbox's too (aenv/events)
        "webhook_id",  # the principal's team's webhooks only (aenv/events/routes.py)
        "volume_id",  # the principal's team's volumes, or the one a content token names (aenv/volumes)
        "secret_ref",  # the principal's team's secrets only (aenv/secrets/routes.py)
    }
)
KNOWN_PARAMS = SANDBOX_PARAMS | SNAPSHOT_PARAMS | TEMPLATE_PARAMS | SCOPED_PARAMS
# Routes whose template_id names an E2B build's template (maybe not made yet): the build's own team
# check answers there (aenv/api/e2b_templates.py), as for a build that does not exist.
BUILD_ROUTES = frozenset(
    {
        "/templates/{template_id}/files/{files_hash}",
        "/templates/{template_id}/files/{files_hash}/upload",
        "/v2/templates/{template_id}/builds/{build_id}",
        "/templates/{template_id}/builds/{build_id}/status",
    }
)
READ_METHODS = frozenset({"GET", "HEAD"})
# Routes that only read a template (or bring its files here) whatever their method.
READS_A_TEMPLATE = frozenset({("POST", "/templates/{template_id}/fetch")})
# Routes only the admin key may use: the node's own machinery, whose answers name every team's work.
ADMIN_ROUTES = frozenset(
    {
        ("GET", "/repository"),
        ("POST", "/repository/gc"),
        ("GET", "/images"),
        ("POST", "/images/prefetch"),
        ("GET", "/images/prefetch/{prefetch_id}"),
    }
)


def restricted() -> Principal | None:
    """The principal when it is a team's view (None: sees everything)."""
    who = current()
    return None if who is None or who.all_teams else who


def in_team(template: TemplateRecord, team_id: str | None) -> bool:
    """Whether E2B's ``teamID`` filter keeps ``template``: None keeps what the request sees; the
    key's own team is its view; another team is the admin key's alone (403 for a team key), and
    shows that team's templates and those every team may use."""
    if team_id is None:
        return True
    who = current()
    if who is not None and not who.admin and team_id != who.team:
        raise Forbidden(f"this key cannot list the templates of team {team_id[:64]!r}")
    if who is not None and not who.admin:
        return True
    return (template.team or DEFAULT_TEAM) == team_id or template.public or template.name in PUBLIC_TEMPLATES


def visible(rec: SandboxRecord | SnapshotRecord | TemplateRecord) -> bool:
    who = restricted()
    if who is None:
        return True
    if isinstance(rec, TemplateRecord):
        return template_visible(rec.team, rec.name, rec.public)
    return who.sees(rec.team)


async def check_route(request: Request) -> None:
    """Every API route's first step (a FastAPI dependency of the whole app)."""
    who = restricted()
    if who is None:
        return
    route = request.scope.get("route")
    path = getattr(route, "path", "")
    if (request.method, path) in ADMIN_ROUTES or (request.method == "HEAD" and ("GET", path) in ADMIN_ROUTES):
        if not who.admin:
            raise Forbidden("this route needs the deployment's admin key")
    node: NodeService = request.app.state.node
    for name, value in request.path_params.items():
        if not isinstance(value, str):
            continue
        if name in SANDBOX_PARAMS:
            await _check_sandbox(request, node, value)
        elif name in SNAPSHOT_PARAMS:
            _check_snapshot(node, value)
        elif name in TEMPLATE_PARAMS:
            if path not in BUILD_ROUTES:
                _check_template(node, value)
                if request.method not in READ_METHODS and (request.method, path) not in READS_A_TEMPLATE:
                    check_owned_template(node, value)
        elif name not in SCOPED_PARAMS and not who.admin:
            log.error("route %s %s has a path parameter %r no team check knows: refused", request.method, path, name)
            raise NotFound(f"no route {request.method} {request.url.path[:100]}")


async def _check_sandbox(request: Request, node: NodeService, value: str) -> None:
    """Another team's sandbox is answered as one that does not exist. For a team key, so is one
    that does not exist, before the route reads its body: a malformed body then tells nothing
    either (the admin key's routes answer as they always did)."""
    short = value.split("-", 1)[0]
    sb = node.sandboxes.get(short)
    owner: str | None = sb.rec.team if sb is not None else None
    if sb is None and ID.fullmatch(short):
        remote = getattr(request.app.state, "remote_team", None)  # a cluster: a durable pause elsewhere
        owner = await remote(short) if remote is not None else None
        who = restricted()
        if owner is None and who is not None and not who.admin:
            raise SandboxNotFound(f"sandbox {value} not found", sandbox_id=value)
    if owner is not None and not visible_team(owner):
        raise SandboxNotFound(f"sandbox {value} not found", sandbox_id=value)


def visible_team(owner: str) -> bool:
    who = restricted()
    return who is None or who.sees(owner)


def _check_snapshot(node: NodeService, value: str) -> None:
    snap = _find_snapshot(node, value)
    if snap is not None and not visible(snap):
        raise SnapshotNotFound(f"snapshot '{value}' not found")


def _check_template(node: NodeService, value: str) -> None:
    snap = _find_snapshot(node, value)
    if snap is not None and not visible(snap):
        raise TemplateNotFound(f"template '{value}' not found")
    try:
        template = node.find_template(value)
    except TemplateNotFound:
        return
    if not visible(template):
        raise TemplateNotFound(f"template '{value}' not found")


def check_owned_template(node: NodeService, ref: str) -> None:
    """A change to a template (delete, aliases, tags, public, warm pool) is its team's: another
    team may use a public one (``base``), never change it (403: that it exists is no secret)."""
    who = restricted()
    if who is None:
        return
    try:
        template = node.find_template(ref)
    except TemplateNotFound:
        return
    if visible(template) and not who.sees(template.team):  # one it cannot see: its 404 elsewhere
        raise Forbidden(f"template '{template.name}' is another team's (public): only its team may change it")


def _find_snapshot(node: NodeService, ref: str) -> SnapshotRecord | None:
    try:
        return node.find_snapshot(ref)
    except SnapshotNotFound:
        return None


def _source(node: NodeService, ref: str) -> TemplateRecord | SnapshotRecord | None:
    try:
        return node.find_template(ref)
    except TemplateNotFound:
        return _find_snapshot(node, ref)


def claim_template_name(node: NodeService, name: str) -> None:
    """A build or an alias naming another team's template (or a public one this team does not
    own) is refused, as E2B refuses an alias in use: never a rebuild of someone else's template."""
    who = restricted()
    if who is None:
        return
    base = name.partition(":")[0]
    if base in PUBLIC_TEMPLATES:
        raise Conflict(f"'{base}' is a built-in template: give yours another name")
    for ref in dict.fromkeys((name, base)):
        try:
            template = node.find_template(ref)
        except TemplateNotFound:
            continue
        if not who.sees(template.team):
            raise Conflict(f"Alias '{base}' is already used")


class TeamView:
    """The node as one team sees it (``node_of`` for a team key): lookups and lists hold only its
    sandboxes, snapshots and the templates it may use; everything else is the node's."""

    def __init__(self, node: NodeService) -> None:
        self.ref = weakref.ref(node)  # kept per node, never keeping it alive

    @property
    def node(self) -> NodeService:
        node = self.ref()
        assert node is not None, "the node is gone"
        return node

    def __getattr__(self, name: str) -> Any:
        return getattr(self.node, name)

    # The node's tables kept per node (builds under way, E2B builds) find the node's entries.
    def __hash__(self) -> int:
        return hash(self.node)

    def __eq__(self, other: object) -> bool:
        return other is self.node or (isinstance(other, TeamView) and other.node is self.node)

    @property
    def sandboxes(self) -> Mapping[str, LiveSandbox]:
        return MappingProxyType({k: sb for k, sb in self.node.sandboxes.items() if visible(sb.rec)})

    @property
    def templates(self) -> Mapping[str, TemplateRecord]:
        return MappingProxyType({k: t for k, t in self.node.templates.items() if visible(t)})

    @property
    def snapshots(self) -> Mapping[str, SnapshotRecord]:
        return MappingProxyType({k: s for k, s in self.node.snapshots.items() if visible(s)})

    def get(self, sandbox_id: str) -> LiveSandbox:
        sb = self.node.get(sandbox_id)
        if not visible(sb.rec):
            raise SandboxNotFound(f"sandbox {sandbox_id} not found", sandbox_id=sandbox_id)
        return sb

    def list(self, **kwargs: Any) -> list[LiveSandbox]:
        return [sb for sb in self.node.list(**kwargs) if visible(sb.rec)]

    def find_template(self, ref: str) -> TemplateRecord:
        found = self.node.find_template(ref)
        if not visible(found):
            raise TemplateNotFound(f"template '{ref}' not found")
        return found

    def find_snapshot(self, ref: str) -> SnapshotRecord:
        found = self.node.find_snapshot(ref)
        if not visible(found):
            raise SnapshotNotFound(f"snapshot '{ref}' not found")
        return found

    async def create(self, template: str, spec: SandboxSpec = DEFAULT_SPEC) -> SandboxRecord:
        source = _source(self.node, template)
        artifacts = getattr(self.node, "artifacts", None)
        if source is None and artifacts is not None and await artifacts.refresh_catalogue(template):
            source = _source(self.node, template)  # committed to the repository by another node
        if source is not None and not visible(source):
            raise TemplateNotFound(f"no template or snapshot named '{template}'")
        return await self.node.create(template, spec)

    async def delete_snapshot(self, ref: str) -> None:
        self.find_snapshot(ref)
        await self.node.delete_snapshot(ref)

    def usage_of(self, sandbox_id: str) -> Any:
        sb = self.node.sandboxes.get(sandbox_id)
        return self.node.usage_of(sandbox_id) if sb is None or visible(sb.rec) else None


_VIEWS: weakref.WeakKeyDictionary[Any, TeamView] = weakref.WeakKeyDictionary()


def view_of(node: NodeService) -> NodeService:
    """The node for the current request: itself, or the team view of it (one per node: what it
    shows is the current request's team's)."""
    if restricted() is None:
        return node
    view = _VIEWS.get(node)
    if view is None:
        view = _VIEWS[node] = TeamView(node)
    return view  # type: ignore[return-value]
