"""E2B's ``network.rules``: headers the node sets on a sandbox's HTTP(S) requests to a host, with
``${e2b.secrets.NAME}`` placeholders filled from its team's secrets at request time.

The sandbox names the secret; only the node (aenv/node/intercept.py) ever holds its value. The
rules are kept in the sandbox record's ``network`` dict as given and parsed here, as E2B checks
them: keyed by a DNS name (``*.example.com``: any subdomain, not the apex; an exact name beats the
longest wildcard, never merged), at most 10 hosts, one rule per host, 20 headers per rule.
A secret that does not exist is not a create's error (it may be made later): its request is
answered 502 instead (never forwarded without it).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from aenv.errors import InvalidRequest, NotFound, snippet

MAX_HOSTS = 10
MAX_RULES_PER_HOST = 1
MAX_HEADERS = 20
MAX_HEADER_NAME = 64
MAX_HEADER_VALUE = 2048
SECRET_PREFIX = "${e2b.secrets."
IDENTITY_PREFIX = "${e2b.identity.tokens."
SECRET_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")
TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's field name
LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
HOST = re.compile(rf"(?:\*\.)?(?:{LABEL}\.)+{LABEL}|{LABEL}")
# Headers that frame or route the request: set by a rule they would break the relay (h11 frames
# the body itself) or send the request elsewhere than the host the rule is for.
FRAMING = frozenset({"content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer", "host"})

# (team, secret name, lower case) -> its current value, or None when the team has no such secret.
SecretLookup = Callable[[str, str], Awaitable[str | None]]


class MissingSecret(NotFound):
    """A rule names a secret its sandbox's team does not have."""

    def __init__(self, name: str) -> None:
        super().__init__(f"secret {name!r} not found")
        self.name = name


@dataclass(frozen=True)
class Template:
    """A header value: literal text and secret names, alternately (``parts[1::2]`` are names)."""

    parts: tuple[str, ...]

    @property
    def secrets(self) -> tuple[str, ...]:
        return self.parts[1::2]

    @classmethod
    def parse(cls, value: str, where: str) -> Template:
        if IDENTITY_PREFIX in value:
            raise InvalidRequest(f"{where}: identity token placeholders are not available for your team.")
        parts: list[str] = []
        rest = value
        while (at := rest.find(SECRET_PREFIX)) >= 0:
            end = rest.find("}", at)
            if end < 0:
                raise InvalidRequest(f"{where}: unterminated placeholder {snippet(rest[at:], 64)!r}")
            name = rest[at + len(SECRET_PREFIX) : end]
            if not SECRET_NAME.fullmatch(name):
                raise InvalidRequest(f"{where}: {snippet(name, 64)!r} is not a secret name ([A-Za-z0-9_-], 1-128)")
            parts.extend((rest[:at], name.lower()))  # names are case-insensitive, kept lower case
            rest = rest[end + 1 :]
        parts.append(rest)
        return cls(tuple(parts))

    async def fill(self, lookup: SecretLookup, team: str) -> str:
        out = [self.parts[0]]
        for name, text in zip(self.parts[1::2], self.parts[2::2], strict=True):
            value = await lookup(team, name)
            if value is None:
                raise MissingSecret(name)
            out.extend((value, text))
        return "".join(out)


@dataclass(frozen=True)
class Rule:
    host: str
    headers: tuple[tuple[str, Template], ...]  # (name as given, value)


def _header_value_ok(value: str) -> bool:
    return all(ch == "\t" or (" " <= ch and ch != "\x7f") for ch in value)


def _rule(host: str, entries: Any) -> Rule | None:
    where = f"network.rules[{host!r}]"
    if not isinstance(entries, list):
        raise InvalidRequest(f"{where} must be a list of rules")
    if len(entries) > MAX_RULES_PER_HOST:
        raise InvalidRequest(f"{where}: at most {MAX_RULES_PER_HOST} rule per domain")
    if not entries:
        return None
    entry = entries[0]
    if not isinstance(entry, dict) or set(entry) - {"transform"}:
        raise InvalidRequest(f"{where}[0] must be an object with a 'transform'")
    transform = entry.get("transform")
    if transform is None:
        return None
    if not isinstance(transform, dict) or set(transform) - {"headers"}:
        raise InvalidRequest(f"{where}[0].transform must be an object with 'headers'")
    headers = transform.get("headers") or {}
    if not isinstance(headers, dict):
        raise InvalidRequest(f"{where}[0].transform.headers must be an object of strings")
    if len(headers) > MAX_HEADERS:
        raise InvalidRequest(f"{where}: at most {MAX_HEADERS} headers per rule")
    out: list[tuple[str, Template]] = []
    seen: set[str] = set()
    for name, value in headers.items():
        shown = snippet(str(name), MAX_HEADER_NAME)
        if not isinstance(name, str) or len(name) > MAX_HEADER_NAME or not TOKEN.fullmatch(name):
            raise InvalidRequest(f"{where}: {shown!r} is not a header name (an HTTP token, at most 64 characters)")
        if name.lower() in FRAMING:
            raise InvalidRequest(f"{where}: the {name} header cannot be set by a rule")
        if name.lower() in seen:
            raise InvalidRequest(f"{where}: header {shown!r} is set twice")
        seen.add(name.lower())
        if not isinstance(value, str) or len(value) > MAX_HEADER_VALUE or not _header_value_ok(value):
            raise InvalidRequest(
                f"{where}: the value of {shown!r} must be a string of at most {MAX_HEADER_VALUE} characters, "
                "without control characters"
            )
        out.append((name, Template.parse(value, f"{where}: {name}")))
    return Rule(host, tuple(out))


@dataclass(frozen=True)
class Transforms:
    exact: dict[str, Rule]
    wildcards: tuple[tuple[str, Rule], ...]  # (".example.com", rule), longest suffix first

    @classmethod
    def parse(cls, rules: Any) -> Transforms:
        if rules is None:
            return NO_TRANSFORMS
        if not isinstance(rules, dict):
            raise InvalidRequest("network.rules must be an object of domain: rules")
        if len(rules) > MAX_HOSTS:
            raise InvalidRequest(f"network.rules: at most {MAX_HOSTS} domains")
        exact: dict[str, Rule] = {}
        wild: dict[str, Rule] = {}
        for host, entries in rules.items():
            if not isinstance(host, str) or len(host) > 253 or not HOST.fullmatch(host):
                raise InvalidRequest(
                    f"network.rules: {snippet(str(host), 64)!r} is not a lower-case domain (or *.domain)"
                )
            rule = _rule(host, entries)
            if rule is None:
                continue
            if host.startswith("*."):
                wild[host[1:]] = rule
            else:
                exact[host] = rule
        wildcards = tuple(sorted(wild.items(), key=lambda item: -len(item[0])))
        return cls(exact, wildcards)

    def __bool__(self) -> bool:
        return bool(self.exact or self.wildcards)

    def match(self, host: str) -> Rule | None:
        """The rule for ``host``: its exact entry, else the longest ``*.`` suffix that matches
        (a subdomain at any depth; ``*.example.com`` is not ``example.com``)."""
        host = host.lower().rstrip(".")
        if host in self.exact:
            return self.exact[host]
        for suffix, rule in self.wildcards:
            if host.endswith(suffix) and len(host) > len(suffix):
                return rule
        return None


NO_TRANSFORMS = Transforms({}, ())
