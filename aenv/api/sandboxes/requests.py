"""What every route of the control plane reads off its request: the node as the request's team
sees it (and its quotas and domain), and a JSON body checked against its model, with that model's
schema in the OpenAPI document.

The route groups of :mod:`aenv.api.sandboxes` (and the image, team and E2B template routes) share it.
"""

from __future__ import annotations

from typing import Any

from fastapi import Request
from pydantic import BaseModel

from aenv.errors import InvalidRequest, snippet
from aenv.node.service import BuildHost, NodeService
from aenv.teams import guard as team_guard
from aenv.teams.quotas import NodeQuotas


def node_of(request: Request) -> NodeService:
    """The node as the request's team sees it (aenv/teams/guard.py)."""
    return team_guard.view_of(request.app.state.node)


def build_host_of(request: Request) -> BuildHost:
    """The node, for the routes that build or edit templates on it (as the request's team sees it)."""
    node: BuildHost = team_guard.view_of(request.app.state.node)  # type: ignore[assignment]
    return node


def quotas_of(request: Request) -> NodeQuotas:
    quotas: NodeQuotas = request.app.state.quotas
    return quotas


def domain_of(request: Request) -> str | None:
    node = node_of(request)
    return node.settings.domain


# Bodies are read by the routes themselves (``_body``: an empty body is ``{}``, errors are 400s); the
# OpenAPI document still describes them, with these models' schemas under components.
BODY_MODELS: dict[str, type[BaseModel]] = {}


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of a route whose JSON body is ``model``."""
    BODY_MODELS[model.__name__] = model
    required = any(field.is_required() for field in model.model_fields.values())
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": required, "content": {"application/json": {"schema": schema}}}}


def add_body_schemas(openapi: dict[str, Any]) -> None:
    schemas = openapi.setdefault("components", {}).setdefault("schemas", {})
    for name, model in BODY_MODELS.items():
        schema = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[name] = schema


def declared_length(request: Request) -> int | None:
    """The body's Content-Length (None for a chunked body; the server has checked its syntax)."""
    value = request.headers.get("content-length")
    return int(value) if value is not None else None


async def _body(request: Request, model: type[Any]) -> Any:
    """The request's JSON body as ``model``; an empty body is ``{}`` (required fields still are)."""
    raw = await request.body()
    try:
        return model.model_validate_json(raw if raw.strip() else b"{}")
    except ValueError as exc:
        raise InvalidRequest(_first_error(exc)) from exc


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        items = errors()
        if items:
            first = items[0]
            # a location may be a key the client sent: quoted short and printable
            where = ".".join(snippet(str(p), 64) for p in first.get("loc", ()))
            msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
            return f"invalid request body: {where + ': ' if where else ''}{msg}"
    return f"invalid request body: {exc}"
