"""E2B's template build API, as the `e2b` SDK's `Template` builder drives it (v3 create, file
uploads by hash, v2 build start, status polling), carried out by aenv's Dockerfile builder.

Uploads go to a URL this server hands out; the SDK sends no API key there, so the URL carries
an HMAC of (template, files hash) instead, and only that exact upload is accepted. Uploads are
bounded and kept as a cache by files hash (`aenv.templates.uploads`).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import re
import shlex
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from aenv.api.sandboxes import _body, build_host_of, declared_length, json_body
from aenv.api.schemas import rfc3339
from aenv.errors import AenvError, InvalidRequest, NotFound, Unauthenticated
from aenv.node.service import BuildHost, NodeService
from aenv.storage.confined import remove_tree
from aenv.storage.space import ensure_space, headroom
from aenv.teams import guard as team_guard
from aenv.teams.model import team_of_new
from aenv.templates import build, catalog, uploads
from aenv.templates import dockerfile as df
from aenv.templates.catalog import TEMPLATE_NAME
from aenv.templates.uploads import FILES_HASH

router = APIRouter(tags=["e2b templates"])
E2B_USER, E2B_WORKDIR = "user", "/home/user"  # what E2B template steps start with


class NewTemplate(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    name: str = Field(..., min_length=1, max_length=200)
    tags: list[str] = Field(default_factory=list)
    # Checked as E2B checks them, not used: a sandbox's limits come from its own create request.
    cpu_count: int | None = Field(None, alias="cpuCount", ge=1)
    memory_mb: int | None = Field(None, alias="memoryMB", ge=1)
    min_free_disk_mb: int | None = Field(None, alias="minFreeDiskMB", ge=0)


class Step(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    type: str
    args: list[str] = Field(default_factory=list)
    files_hash: str | None = Field(None, alias="filesHash", pattern=f"^{FILES_HASH.pattern}$")


class BuildStart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", populate_by_name=True)
    from_image: str | None = Field(None, alias="fromImage")
    from_template: str | None = Field(None, alias="fromTemplate")
    from_image_registry: dict[str, Any] | None = Field(None, alias="fromImageRegistry")
    steps: list[Step] = Field(default_factory=list)
    start_cmd: str | None = Field(None, alias="startCmd")
    ready_cmd: str | None = Field(None, alias="readyCmd")


@dataclass
class Build:
    template_id: str
    build_id: str
    name: str
    tags: list[str]
    status: str = "waiting"
    logs: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    team: str = field(default_factory=team_of_new)  # whose build: another team's is not found

    def log(self, message: str, level: str = "info") -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime()) + f".{int(time.time() % 1 * 1000):03d}Z"
        self.logs.append({"timestamp": stamp, "level": level, "message": message})


_BUILDS: weakref.WeakKeyDictionary[NodeService, dict[str, Build]] = weakref.WeakKeyDictionary()


def builds_of(node: NodeService) -> dict[str, Build]:
    """The node's E2B builds by id, for as long as the node lives."""
    return _BUILDS.setdefault(node, {})


def upload_token(node: NodeService, template_id: str, files_hash: str) -> str:
    secret = node.token_secret.encode()
    return hmac.new(secret, f"upload:{template_id}:{files_hash}".encode(), hashlib.sha256).hexdigest()


def upload_authorized(node: NodeService, template_id: str, files_hash: str, token: str) -> bool:
    """Whether ``token`` is the one the files link handed out for this upload."""
    expected = upload_token(node, template_id, files_hash)
    return hmac.compare_digest(token.encode("utf-8", "surrogateescape"), expected.encode())


def _split_name(name: str) -> tuple[str, str | None]:
    base, _, tag = name.partition(":")
    base = base.lower().replace("/", "-")
    if not re.fullmatch(TEMPLATE_NAME, base):
        raise InvalidRequest(f"template name {name!r} is not usable (lowercase letters, digits, '.', '_', '-')")
    return base, tag or None


@router.post(
    "/v3/templates",
    status_code=202,
    summary="Start an E2B template (then build it)",
    openapi_extra=json_body(NewTemplate),
)
async def new_template(request: Request) -> JSONResponse:
    body: NewTemplate = await _body(request, NewTemplate)
    name, tag = _split_name(body.name)
    team_guard.claim_template_name(request.app.state.node, name)  # never a rebuild of another team's
    tags = sorted({*body.tags, *([tag] if tag else [])})
    entry = Build(template_id=name, build_id=str(uuid.uuid4()), name=name, tags=tags)
    builds_of(build_host_of(request))[entry.build_id] = entry
    out = {"templateID": name, "buildID": entry.build_id, "public": False, "names": [name], "tags": tags}
    out["aliases"] = [name]
    return JSONResponse(out, status_code=202)


@router.get("/templates/{template_id}/files/{files_hash}", status_code=201, summary="Where to upload COPY files")
async def files_link(request: Request, template_id: str, files_hash: str) -> JSONResponse:
    node = build_host_of(request)
    present = node.uploads.has(files_hash)
    url = str(request.url_for("upload_files", template_id=template_id, files_hash=files_hash))
    url += f"?token={upload_token(node, template_id, files_hash)}"
    return JSONResponse({"present": present, "url": url}, status_code=201)


@router.put("/templates/{template_id}/files/{files_hash}/upload", name="upload_files", include_in_schema=False)
async def upload_files(request: Request, template_id: str, files_hash: str, token: str = "") -> Response:
    node = build_host_of(request)
    if not upload_authorized(node, template_id, files_hash, token):
        raise Unauthenticated("this upload URL is not valid")
    await node.uploads.receive(files_hash, request.stream(), declared_length(request))
    return Response(status_code=200)


@router.post(
    "/v2/templates/{template_id}/builds/{build_id}",
    status_code=202,
    summary="Build an E2B template",
    openapi_extra=json_body(BuildStart),
)
async def start_build(request: Request, template_id: str, build_id: str) -> Response:
    node = build_host_of(request)
    entry = builds_of(node).get(build_id)
    if entry is None or entry.template_id != template_id or not team_guard.visible_team(entry.team):
        raise NotFound(f"build {build_id} of template {template_id} not found")
    if entry.status != "waiting":
        raise InvalidRequest(f"build {build_id} was started already")
    body: BuildStart = await _body(request, BuildStart)
    login = await registry_login(body.from_image_registry) if body.from_image_registry else None
    base = body.from_image or body.from_template
    if not base:
        raise InvalidRequest("a build needs fromImage or fromTemplate")
    ensure_space(node.files.root, headroom(node.settings), 0, f"build {build_id}")
    context = node.files.tmp / f"e2b-{build_id}"
    instructions = [df.Instruction(0, "FROM", base)]
    # E2B's starting point; the workdir is only the default one (sandboxes follow the user's home)
    instructions += [df.Instruction(0, "USER", E2B_USER), df.Instruction(0, "WORKDIR", E2B_WORKDIR, {"implicit": ""})]
    user = E2B_USER
    try:
        for step in body.steps:
            instructions += await _instructions(node, step, context, user)
            if step.type.upper() == "USER" and step.args:
                user = step.args[0]
    except BaseException:
        remove_tree(context, ignore_errors=True)
        raise
    for number, instr in enumerate(instructions, 1):
        instr.line = number  # errors name the step
    start = (body.start_cmd, body.ready_cmd) if body.start_cmd else None
    entry.status = "building"
    node.spawn(_run(node, entry, instructions, context, start, login))
    return Response(status_code=202)


async def _instructions(node: BuildHost, step: Step, context: Path, user: str) -> list[df.Instruction]:
    """aenv's instructions for one E2B step (``user`` is the one in force before it)."""
    kind, args = step.type.upper(), step.args
    if kind == "RUN" and args:
        run = df.Instruction(0, "RUN", args[0])
        if len(args) > 1 and args[1]:
            # run_cmd(user=...) is for that step only
            return [df.Instruction(0, "USER", args[1]), run, df.Instruction(0, "USER", user)]
        return [run]
    if kind == "ENV" and len(args) % 2 == 0:
        pairs = " ".join(f"{k}={shlex.quote(v)}" for k, v in zip(args[::2], args[1::2], strict=True))
        return [df.Instruction(0, "ENV", pairs)]
    if kind in ("WORKDIR", "USER") and len(args) == 1:
        return [df.Instruction(0, kind, args[0])]
    if kind == "COPY" and len(args) >= 2 and step.files_hash:
        with node.uploads.using(step.files_hash) as tar:
            if not tar.exists():
                raise InvalidRequest(f"COPY {args[0]}: its files ({step.files_hash}) were never uploaded")
            target = context / step.files_hash
            if not target.exists():  # links stay links, whatever they point at
                what = f"the files of COPY {args[0]} ({step.files_hash})"
                await asyncio.to_thread(uploads.unpack_context, tar, target, node.uploads.limits, what)
        flags = {}
        if len(args) > 2 and args[2]:
            flags["chown"] = args[2]
        if len(args) > 3 and args[3]:
            flags["chmod"] = args[3]
        src = shlex.quote(f"{step.files_hash}/{args[0]}")
        return [df.Instruction(0, "COPY", f"{src} {shlex.quote(args[1])}", flags)]
    raise InvalidRequest(f"template step {step.type} {args} is not supported")


async def registry_login(config: dict[str, Any]) -> tuple[str, str]:
    """(user, password) for the image's registry from E2B's ``fromImageRegistry``: a plain
    login, a GCP service account (Google's ``_json_key`` login) or AWS keys (exchanged for an ECR
    token). Used for this build's pull only; never stored."""
    kind = config.get("type")
    if kind == "registry":
        user, password = config.get("username"), config.get("password")
        if not user or not password:
            raise InvalidRequest("fromImageRegistry of type registry needs a username and a password")
        return str(user), str(password)
    if kind == "gcp":
        key = config.get("serviceAccountJson")
        if not key:
            raise InvalidRequest("fromImageRegistry of type gcp needs serviceAccountJson")
        return "_json_key", key if isinstance(key, str) else json.dumps(key)
    if kind == "aws":
        return await asyncio.to_thread(_ecr_login, config)
    raise InvalidRequest(f"fromImageRegistry type {kind!r} is not one of registry, aws, gcp")


def _ecr_login(config: dict[str, Any]) -> tuple[str, str]:
    # Without both keys boto3 would fall back to the node's own AWS credentials (its environment,
    # its instance role) and the registry the caller names would receive the node's ECR token.
    if not config.get("awsAccessKeyId") or not config.get("awsSecretAccessKey"):
        raise InvalidRequest("fromImageRegistry of type aws needs awsAccessKeyId and awsSecretAccessKey")
    try:
        import boto3
        from botocore.exceptions import BotoCoreError, ClientError
    except ImportError:
        raise InvalidRequest("pulling from ECR needs boto3 on the node: pip install 'aenv[s3]'") from None
    try:
        ecr = boto3.session.Session().client(
            "ecr",
            region_name=config.get("awsRegion"),
            aws_access_key_id=config.get("awsAccessKeyId"),
            aws_secret_access_key=config.get("awsSecretAccessKey"),
        )
        token = ecr.get_authorization_token()["authorizationData"][0]["authorizationToken"]
    except (BotoCoreError, ClientError) as exc:
        raise InvalidRequest(f"ECR refused the AWS credentials: {exc}") from exc
    user, _, password = base64.b64decode(token).decode().partition(":")
    return user, password


async def _run(
    node: BuildHost,
    entry: Build,
    instructions: list[df.Instruction],
    context: Path,
    start: tuple[str, str | None] | None,
    login: tuple[str, str] | None = None,
) -> None:
    try:
        rec = await build.build(
            node, name=entry.name, dockerfile=instructions, context=context, start=start, login=login, on_log=entry.log
        )
        if rec.add_build(entry.build_id):  # `name:<build id>` starts it (a rebuild that changed nothing too)
            await node.save_template(rec)
        await catalog.assign_tags(node, rec.id, entry.tags)  # moves name:tag here from older builds
        entry.status = "ready"
    except AenvError as exc:
        entry.log(exc.message, "error")
        entry.reason = {"message": exc.message}
        entry.status = "error"
    except Exception:  # the build's client learns of it through the status; the node's log has why
        entry.reason = {"message": f"build {entry.build_id} failed on the node (its log says why)"}
        entry.log(entry.reason["message"], "error")
        entry.status = "error"
        raise
    finally:
        remove_tree(context, ignore_errors=True)


@router.get("/templates/{template_id}/builds/{build_id}/status", summary="E2B template build status and logs")
async def build_status(request: Request, template_id: str, build_id: str, logsOffset: int = 0) -> dict[str, Any]:  # noqa: N803
    entry = builds_of(build_host_of(request)).get(build_id)
    if entry is None or entry.template_id != template_id or not team_guard.visible_team(entry.team):
        raise NotFound(f"build {build_id} of template {template_id} not found")
    window = entry.logs[max(0, logsOffset) : max(0, logsOffset) + 100]
    out: dict[str, Any] = {
        "templateID": template_id,
        "buildID": build_id,
        "status": entry.status,
        "logs": [e["message"] for e in window],
        "logEntries": window,
    }
    if entry.reason is not None:
        out["reason"] = entry.reason
    return out


@router.get("/templates/aliases/{alias}", summary="Whether a template name exists (E2B Template.exists)")
async def alias_exists(request: Request, alias: str) -> dict[str, Any]:
    template = build_host_of(request).find_template(alias)
    return {"templateID": template.id, "public": False}


class TagsAssign(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    target: str = Field(..., min_length=1, max_length=200)
    tags: list[str] = Field(..., min_length=1, max_length=64)


class TagsRemove(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str = Field(..., min_length=1, max_length=200)
    tags: list[str] = Field(..., min_length=1, max_length=64)


@router.post(
    "/templates/tags",
    status_code=201,
    summary="Point tags at a template build (E2B assign_tags)",
    openapi_extra=json_body(TagsAssign),
)
async def assign_tags(request: Request) -> JSONResponse:
    body: TagsAssign = await _body(request, TagsAssign)
    team_guard.check_owned_template(build_host_of(request), body.target)  # base's tags are not another team's
    template = await catalog.assign_tags(build_host_of(request), body.target, body.tags)
    return JSONResponse({"buildID": catalog.build_id_of(template), "tags": body.tags}, status_code=201)


@router.delete(
    "/templates/tags",
    status_code=204,
    summary="Remove tags of a template (E2B remove_tags)",
    openapi_extra=json_body(TagsRemove),
)
async def remove_tags(request: Request) -> Response:
    body: TagsRemove = await _body(request, TagsRemove)
    team_guard.check_owned_template(build_host_of(request), body.name)
    await catalog.remove_tags(build_host_of(request), body.name, body.tags)
    return Response(status_code=204)


@router.get("/templates/{template_id}/tags", summary="The tags of a template and the builds they name")
async def list_tags(request: Request, template_id: str) -> list[dict[str, Any]]:
    return [
        {
            "tag": item["tag"],
            "buildID": catalog.build_id_of(item["template"]),
            "createdAt": rfc3339(item["template"].created_at),
        }
        for item in catalog.tags_of(build_host_of(request), template_id)
    ]
