"""The template catalogue: delete (refused while sandboxes use a template, unless forced), aliases.

A tag is an alias of the form ``name:tag``; ``find_template`` resolves names, ids and aliases alike.
Deleting a record frees nothing a sandbox still needs: sandboxes name their own layers, and the
node's garbage collection removes only layers and images no record names.
"""

from __future__ import annotations

import re

from aenv.errors import Conflict, InvalidRequest
from aenv.node import housekeeping
from aenv.node.orchestrator import Node
from aenv.node.store import TemplateRecord

TEMPLATE_NAME = r"[a-z0-9][a-z0-9._-]{0,62}"
ALIAS = re.compile(rf"{TEMPLATE_NAME}(?::[\w][\w.-]{{0,127}})?")  # a name, or name:tag


def users_of(node: Node, template: TemplateRecord) -> list[str]:
    return [sb.id for sb in node.sandboxes.values() if sb.rec.template_id in (template.id, template.name)]


async def delete_template(node: Node, ref: str, *, force: bool = False) -> None:
    template = node.find_template(ref)
    users = users_of(node, template)
    if users and not force:
        raise Conflict(
            f"template '{template.name}' is used by {len(users)} sandbox(es) ({', '.join(users[:3])}); "
            "kill them first or delete with force=true"
        )
    node.templates.pop(template.id, None)
    await node.store.delete_template(template.id)
    await node.artifacts.forget(template)
    await housekeeping.gc_files(node, min_age=60)


async def set_aliases(node: Node, ref: str, aliases: list[str]) -> TemplateRecord:
    template = node.find_template(ref)
    for alias in aliases:
        if not ALIAS.fullmatch(alias):
            raise InvalidRequest(f"alias {alias!r} is not a template name or name:tag")
        for other in node.templates.values():
            if other.id != template.id and alias in (other.name, other.id, *other.aliases):
                raise Conflict(f"alias {alias!r} already names template '{other.name}'")
    template.aliases = sorted(set(aliases) - {template.name})
    await node.store.put_template(template)
    await node.artifacts.record_changed(template)
    return template
