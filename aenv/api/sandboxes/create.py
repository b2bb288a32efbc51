"""Creating a sandbox (``POST /sandboxes``, ``/v2/sandboxes``): E2B's create body read into one
:class:`SandboxSpec`, from a template, a snapshot or an image, within the team's quotas, once per
create id.
"""

from __future__ import annotations

from contextlib import AbstractAsyncContextManager

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from aenv.api.sandboxes.network import CREATE_NETWORK_FIELDS, egress_rules, ingress_options, unbuilt_features
from aenv.api.sandboxes.requests import _body, build_host_of, domain_of, json_body, node_of, quotas_of
from aenv.api.schemas import NewSandbox, sandbox_json
from aenv.errors import InvalidRequest, SnapshotNotFound, TemplateNotFound
from aenv.node.service import BuildHost, NodeService, SandboxSpec, create_id_of
from aenv.teams.model import team_of_new
from aenv.templates import desktop, image_sources
from aenv.volumes.service import Volumes

router = APIRouter()
# The template E2B's SDKs create from when given MCP servers; they start its gateway themselves
# (E2B's API only records `mcp`). From any other template a create with MCP servers has none.
MCP_TEMPLATE = "mcp-gateway"


def create_source(node: BuildHost, body: NewSandbox) -> AbstractAsyncContextManager[str]:
    """The template or snapshot a create restores: ``templateID`` as it names one, or the template
    made from the image it (or ``image``) names, built first if need be (image_sources); held
    (never evicted) until the block ends."""
    if body.image is None:
        return image_sources.held_source(node, body.template_id)
    if "template_id" in body.model_fields_set:
        raise InvalidRequest("invalid request body: give templateID or image, not both")
    return image_sources.held_source(node, body.image, image=True)


async def _create(request: Request) -> JSONResponse:
    node = node_of(request)
    body: NewSandbox = await _body(request, NewSandbox)
    auto_pause = bool(body.auto_pause)
    if body.lifecycle is not None and body.lifecycle.on_timeout is not None:
        if body.lifecycle.on_timeout not in ("pause", "kill"):
            raise InvalidRequest("lifecycle.onTimeout must be 'pause' or 'kill'")
        auto_pause = body.lifecycle.on_timeout == "pause"
    auto_resume = False
    if isinstance(body.auto_resume, bool):
        auto_resume = body.auto_resume
    elif body.auto_resume is not None:
        auto_resume = body.auto_resume.on
    if body.lifecycle is not None and body.lifecycle.auto_resume is not None:
        auto_resume = body.lifecycle.auto_resume
    auto_pause_memory = body.auto_pause_memory
    if auto_pause_memory is None and body.lifecycle is not None:
        auto_pause_memory = body.lifecycle.keep_memory
    unbuilt_features(body)
    secure = body.secure is not False
    limits = body.limits.model_dump(exclude_none=True) if body.limits else None
    network = egress_rules(body.network, known=CREATE_NETWORK_FIELDS)
    public_traffic, mask_request_host = ingress_options(body.network, secure=secure)
    volumes: Volumes = request.app.state.volumes
    mounts = await volumes.mounts_for(body.volume_mounts, team_of_new())

    spec = SandboxSpec(
        timeout=body.timeout,
        metadata=dict(body.metadata or {}),
        env_vars=dict(body.env_vars or {}),
        auto_pause=auto_pause,
        auto_resume=auto_resume,
        auto_pause_memory=auto_pause_memory is not False,
        limits=limits or {},
        allow_internet_access=body.allow_internet_access,
        network=network or {},
        secure=secure,
        public_traffic=public_traffic,
        mask_request_host=mask_request_host,
        grace=body.grace or 0,
        volume_mounts=mounts,
    )

    async def create() -> str:
        _first_use(request, node, body)
        async with create_source(build_host_of(request), body) as source:
            return await created(source)

    async def created(source: str) -> str:
        if body.mcp and not _runs_mcp(node, source):
            raise InvalidRequest(
                f"MCP servers (mcp) need the {MCP_TEMPLATE} template, which runs their gateway: "
                f"{body.template_id!r} is not it (the SDKs create from {MCP_TEMPLATE} when given mcp)"
            )
        return (await node.create(source, spec)).id

    # A create sent again with its id (a gateway whose connection broke, an SDK's retry with its
    # Idempotency-Key) gets the first one's sandbox.
    create_id = create_id_of(request.headers)
    sandbox_id = await quotas_of(request).admitted(  # the team's rate, and ?wait for room
        request, lambda: node.create_ids.once(create_id, create) if create_id is not None else create()
    )
    if node.announce is not None:
        await node.announce([sandbox_id])
    return JSONResponse(sandbox_json(node, node.get(sandbox_id), domain_of(request)), status_code=201)


def _first_use(request: Request, node: NodeService, body: NewSandbox) -> None:
    """A create from the built-in `desktop` before this node has it starts its build (a few
    minutes) and is answered 503 with Retry-After until it is there."""
    if body.image is not None or body.template_id.partition(":")[0] != desktop.NAME:
        return
    try:
        node.find_template(desktop.NAME)
        return
    except TemplateNotFound:
        pass
    settings = request.app.state.node.settings
    if not settings.desktop_on_first_use:
        raise TemplateNotFound(
            f"template '{desktop.NAME}' not found: this node builds it when asked "
            f"(`aenv template build {desktop.NAME}`)"
        )
    builds: desktop.Builds = request.app.state.desktop_builds
    raise builds.on_first_use(build_host_of(request), settings.desktop_browser)


def _runs_mcp(node: NodeService, source: str) -> bool:
    """Whether ``source`` (a template, or a snapshot of a sandbox of one) is the MCP gateway's:
    named or aliased ``mcp-gateway`` (any tag)."""
    try:
        template = node.find_template(source)
    except TemplateNotFound:
        try:
            template = node.find_template(node.find_snapshot(source).template_id)
        except (TemplateNotFound, SnapshotNotFound):
            return False
    return any(name.split(":", 1)[0] == MCP_TEMPLATE for name in [template.name, *template.aliases])


router.add_api_route(
    "/sandboxes",
    _create,
    methods=["POST"],
    status_code=201,
    summary="Create a sandbox",
    openapi_extra=json_body(NewSandbox),
)
router.add_api_route(
    "/v2/sandboxes",
    _create,
    methods=["POST"],
    status_code=201,
    summary="Create a sandbox (v2)",
    openapi_extra=json_body(NewSandbox),
)
