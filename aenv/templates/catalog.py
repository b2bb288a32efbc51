"""The template catalogue: delete (refused while sandboxes use a template, unless forced), aliases
and tags.

A tag is an alias of the form ``name:tag``; ``find_template`` resolves names, ids and aliases alike.
The bare name is the newest build; an older build that still carries a tag stays reachable by it
(its record is then named by its id), as E2B keeps ``name:v1`` after ``name:v2`` is built.
Deleting a record frees nothing a sandbox still needs: sandboxes name their own layers, and the
node's garbage collection removes only layers and images no record names.
"""

from __future__ import annotations

import re
from typing import Any

from aenv.errors import Conflict, InvalidRequest, NotFound, TemplateNotFound
from aenv.node.imagecache import evicted_images
from aenv.node.service import BuildHost, TemplateRecord

TEMPLATE_NAME = r"[a-z0-9][a-z0-9._-]{0,62}"
ALIAS = re.compile(rf"{TEMPLATE_NAME}(?::[\w][\w.-]{{0,127}})?")  # a name, or name:tag


def users_of(node: BuildHost, template: TemplateRecord) -> list[str]:
    return [sb.id for sb in node.sandboxes.values() if sb.rec.template_id in (template.id, template.name)]


async def delete_template(node: BuildHost, ref: str, *, force: bool = False) -> None:
    try:
        template = node.find_template(ref)
    except TemplateNotFound:
        # An image evicted whole has no template here, only the entry a create makes it again
        # from: deleting it forgets that (a create of its tag then pulls the tag as it is now).
        evicted = await evicted_images(node).find(ref)
        if evicted is None:
            raise
        await evicted_images(node).forget(evicted.digest)
        return
    users = users_of(node, template)
    if users and not force:
        raise Conflict(
            f"template '{template.name}' is used by {len(users)} sandbox(es) ({', '.join(users[:3])}); "
            "kill them first or delete with force=true"
        )
    await node.drop_template(template)
    await node.collect_garbage(min_age=60)


async def set_aliases(node: BuildHost, ref: str, aliases: list[str]) -> TemplateRecord:
    template = node.find_template(ref)
    for alias in aliases:
        if not ALIAS.fullmatch(alias):
            raise InvalidRequest(f"alias {alias!r} is not a template name or name:tag")
        for other in node.templates.values():
            if other.id != template.id and alias in (other.name, other.id, *other.aliases):
                raise Conflict(f"alias {alias!r} already names template '{other.name}'")
    template.aliases = sorted(set(aliases) - {template.name})
    await node.save_template(template)
    return template


def build_id_of(template: TemplateRecord) -> str:
    """E2B names builds by UUID: the newest it was built under, or one derived from the id."""
    return template.e2b_build_id()


def family(template: TemplateRecord) -> str:
    """The name a template's tags hang from (an older, tagged build is named by its id)."""
    if template.name != template.id:
        return template.name
    return next((a.partition(":")[0] for a in template.aliases if ":" in a), template.name)


async def _untag(node: BuildHost, alias: str, keep: TemplateRecord | None = None) -> None:
    """Take ``alias`` off whichever other build has it; a retained older build left with no tag
    is deleted (its sandboxes keep running on their own layers)."""
    for other in list(node.templates.values()):
        if other is keep or alias not in other.aliases:
            continue
        other.aliases.remove(alias)
        if other.name == other.id and not other.aliases:
            await delete_template(node, other.id, force=True)
        else:
            await node.save_template(other)


async def assign_tags(node: BuildHost, target: str, tags: list[str]) -> TemplateRecord:
    """Point ``family:tag`` at the build ``target`` names (moved off any other build)."""
    template = node.find_template(target)
    base = target.partition(":")[0] if ":" in target else family(template)
    aliases = [f"{base}:{tag}" for tag in tags]
    for alias in aliases:
        if not ALIAS.fullmatch(alias) or ":" not in alias:
            raise InvalidRequest(f"tag {alias.partition(':')[2]!r} is not usable (letters, digits, '.', '_', '-')")
    for alias in aliases:
        await _untag(node, alias, keep=template)
    template.aliases = sorted({*template.aliases, *aliases} - {template.name})
    await node.save_template(template)
    return template


async def remove_tags(node: BuildHost, name: str, tags: list[str]) -> None:
    aliases = [f"{name}:{tag}" for tag in tags]
    holders = [t for t in node.templates.values() if set(aliases) & set(t.aliases)]
    if not holders:
        raise NotFound(f"template '{name}' has none of the tags {', '.join(tags)}")
    for alias in aliases:
        await _untag(node, alias)


def tags_of(node: BuildHost, ref: str) -> list[dict[str, Any]]:
    base = family(node.find_template(ref))
    out = []
    for t in node.templates.values():
        for alias in t.aliases:
            name, _, tag = alias.partition(":")
            if name == base and tag:
                out.append({"tag": tag, "template": t})
    return sorted(out, key=lambda item: item["tag"])


async def retire_builds(node: BuildHost, name: str) -> None:
    """A new build takes ``name``: the build that had it goes, unless tags still point at it."""
    for old in [t for t in node.templates.values() if t.name == name]:
        if any(a.startswith(f"{name}:") for a in old.aliases):
            old.name = old.id
            await node.save_template(old)
        else:
            await node.drop_template(old)
