"""Sandbox lists answered from a gateway's mirror of the directory, without asking the nodes.

Each sandbox's entry carries what its node's list shows for it (``SandboxEntry.listed``), so the
gateway applies one node's filters, order, keyset pages and ``X-Total-Running`` to the entries of
every live node: a slow or stopped node costs a list nothing. Tokens are derived from the
cluster secret, as the nodes derive them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from starlette.requests import Request

from aenv.api import listing
from aenv.api.sandboxes import parse_metadata_query, parse_states
from aenv.api.schemas import rfc3339
from aenv.cluster.entries import SandboxEntry
from aenv.errors import InvalidRequest
from aenv.node import tokens


@dataclass(frozen=True, slots=True)
class ListQuery:
    """A list's parameters, checked as a node checks them."""

    paginated: bool
    order: listing.Order
    limit: int
    token: str | None
    states: set[str] | None
    metadata: dict[str, str]
    started_after: int | None = None
    template: str | None = None

    @classmethod
    def of(cls, request: Request, *, paginated: bool, limit: int) -> ListQuery:
        params = request.query_params
        metadata = parse_metadata_query(params.get("metadata"))
        if not paginated:  # the legacy list: running sandboxes, by metadata only
            return cls(False, listing.SANDBOXES_NEWEST_FIRST, 0, None, {"running"}, metadata)
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise InvalidRequest(f"Invalid order parameter: unknown order '{order[:32]}'")
        after = params.get("startedAfter")
        return cls(
            True,
            listing.SANDBOXES_OLDEST_FIRST if order == "asc" else listing.SANDBOXES_NEWEST_FIRST,
            limit,
            params.get("nextToken"),
            parse_states(params.getlist("state")),
            metadata,
            listing.parse_time(after, "startedAfter") if after is not None else None,
            params.get("template") or None,
        )

    def matches(self, entry: SandboxEntry) -> bool:
        if self.states and entry.state not in self.states and entry.listed.get("aenvState") not in self.states:
            return False
        if any(entry.metadata.get(k) != v for k, v in self.metadata.items()):
            return False
        if self.started_after is not None and listing.micros(entry.started_at) < self.started_after:
            return False
        return self.template is None or self.template == entry.template_id or self.template in entry.template_names


def answer(
    query: ListQuery, entries: Iterable[SandboxEntry], secret: bytes, domain: str | None
) -> tuple[list[dict[str, object]], dict[str, str]]:
    """The list's items and headers (X-Next-Token, X-Total-Running), as one node answers."""
    found = [e for e in entries if query.matches(e)]
    headers: dict[str, str] = {}
    if query.paginated and (query.states is None or "running" in query.states):
        headers["X-Total-Running"] = str(sum(1 for e in found if e.state == "running"))
    if query.paginated:
        page, next_token = query.order.page(found, _position, query.limit, query.token)
        if next_token is not None:
            headers["X-Next-Token"] = next_token
    else:
        page = query.order.sort(found, _position)
    return [listed_item(e, secret, domain) for e in page], headers


def _position(entry: SandboxEntry) -> listing.Position:
    return listing.Position(listing.micros(entry.started_at), entry.sandbox_id)


def listed_item(entry: SandboxEntry, secret: bytes, domain: str | None) -> dict[str, object]:
    """The node's list item kept in the entry, with what the entry keeps apart put back. An
    entry too large to keep it (`listed` left out) gives what the entry itself says."""
    item = dict(entry.listed) if entry.listed else _from_entry(entry)
    secure, private = item.pop("secure", False), item.pop("private", False)
    # nodeID: not E2B's, but where it runs is what the dashboard's Node column and an operator ask
    item.update(sandboxID=entry.sandbox_id, metadata=entry.metadata, domain=domain, nodeID=entry.node_id)
    if "durable" in item:  # the node's item was made before the entry it went into said durable
        item["durable"] = entry.durable
    if secure:
        item["envdAccessToken"] = tokens.access_token(secret, entry.sandbox_id)
    if private:
        item["trafficAccessToken"] = tokens.traffic_token(secret, entry.sandbox_id)
    return item


def _from_entry(entry: SandboxEntry) -> dict[str, object]:
    return {
        "templateID": entry.template_id,
        "alias": entry.alias,
        "state": entry.state,
        "startedAt": rfc3339(entry.started_at),
        "endAt": rfc3339(entry.end_at),
        "durable": entry.durable,
    }
