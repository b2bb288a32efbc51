"""E2B's `network.rules` (aenv/node/transforms.py): what a create accepts, and which rule a host gets.
No sandbox needed."""

from __future__ import annotations

from typing import Any

import pytest

from aenv.errors import InvalidRequest
from aenv.node.egress import EgressPolicy
from aenv.node.transforms import MissingSecret, Template, Transforms

pytestmark = pytest.mark.fast


def rule(headers: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"transform": {"headers": headers}}]


def refused(rules: Any) -> str:
    with pytest.raises(InvalidRequest) as info:
        Transforms.parse(rules)
    return str(info.value)


def test_a_rule_parses_and_matches() -> None:
    t = Transforms.parse({"api.example.com": rule({"Authorization": "Bearer ${e2b.secrets.API_Key}"})})
    found = t.match("API.example.com.")
    assert found is not None and found.headers[0][0] == "Authorization"
    assert found.headers[0][1].parts == ("Bearer ", "api_key", "")  # names are case-insensitive
    assert t.match("example.com") is None and t.match("x.api.example.com") is None


def test_exact_beats_the_longest_wildcard_and_wildcards_skip_the_apex() -> None:
    t = Transforms.parse(
        {
            "*.example.com": rule({"X-Which": "short"}),
            "*.b.example.com": rule({"X-Which": "long"}),
            "a.b.example.com": rule({"X-Which": "exact"}),
        }
    )

    def which(host: str) -> str | None:
        found = t.match(host)
        return found.headers[0][1].parts[0] if found else None

    assert which("a.b.example.com") == "exact"
    assert which("c.b.example.com") == "long" and which("x.y.b.example.com") == "long"
    assert which("b.example.com") == "short" and which("deep.er.example.com") == "short"
    assert which("example.com") is None and which("badexample.com") is None


@pytest.mark.parametrize(
    ("rules", "message"),
    [
        ([], "must be an object"),
        ({f"h{i}.example.com": rule({"X": "v"}) for i in range(11)}, "at most 10 domains"),
        ({"a.example.com": rule({"X": "v"}) * 2}, "at most 1 rule"),
        ({"a.example.com": rule({f"X-{i}": "v" for i in range(21)})}, "at most 20 headers"),
        ({"a.example.com": rule({"X" * 65: "v"})}, "not a header name"),
        ({"a.example.com": rule({"X Y": "v"})}, "not a header name"),
        ({"a.example.com": rule({"": "v"})}, "not a header name"),
        ({"a.example.com": rule({"X": "v" * 2049})}, "at most 2048"),
        ({"a.example.com": rule({"X": "a\r\nX-Evil: 1"})}, "control characters"),
        ({"a.example.com": rule({"X": 7})}, "must be a string"),
        ({"a.example.com": rule({"Host": "v"})}, "cannot be set"),
        ({"a.example.com": rule({"Content-Length": "1"})}, "cannot be set"),
        ({"a.example.com": rule({"X": "${e2b.secrets.A"})}, "unterminated"),
        ({"a.example.com": rule({"X": "${e2b.secrets.}"})}, "not a secret name"),
        ({"a.example.com": rule({"X": "${e2b.secrets.a.b}"})}, "not a secret name"),
        ({"a.example.com": rule({"X": "${e2b.secrets." + "a" * 129 + "}"})}, "not a secret name"),
        ({"a.example.com": rule({"X": "${e2b.identity.tokens.aud}"})}, "identity token"),
        ({"A.example.com": rule({"X": "v"})}, "lower-case domain"),
        ({"*.*.example.com": rule({"X": "v"})}, "lower-case domain"),
        ({"example.com/x": rule({"X": "v"})}, "lower-case domain"),
        ({"a.example.com": {"transform": {}}}, "must be a list"),
        ({"a.example.com": [{"transform": {"body": "x"}}]}, "with 'headers'"),
        ({"a.example.com": [{"other": 1}]}, "with a 'transform'"),
    ],
)
def test_bad_rules_are_refused(rules: Any, message: str) -> None:
    assert message in refused(rules)


def test_limits_themselves_are_accepted() -> None:
    many = {f"h{i}.example.com": rule({f"X-{j}": "v" * 2048 for j in range(20)}) for i in range(10)}
    assert len(Transforms.parse(many).exact) == 10
    assert Transforms.parse({"a.example.com": rule({"X" * 64: "${e2b.secrets." + "a" * 128 + "}"})})
    assert not Transforms.parse({"a.example.com": []}) and not Transforms.parse({})


def test_other_dollar_text_is_left_as_it_is() -> None:
    t = Template.parse("${HOME} ${e2b.other} $x ${e2b.secrets.A}${e2b.secrets.b}!", "x")
    assert t.parts == ("${HOME} ${e2b.other} $x ", "a", "", "b", "!")


async def test_fill_takes_the_teams_secrets_and_names_a_missing_one() -> None:
    asked: list[tuple[str, str]] = []

    async def lookup(team: str, name: str) -> str | None:
        asked.append((team, name))
        return {"a": "VALUE"}.get(name)

    assert await Template.parse("Bearer ${e2b.secrets.A}", "x").fill(lookup, "t1") == "Bearer VALUE"
    with pytest.raises(MissingSecret) as info:
        await Template.parse("${e2b.secrets.a}:${e2b.secrets.nope}", "x").fill(lookup, "t1")
    assert info.value.name == "nope" and asked == [("t1", "a"), ("t1", "a"), ("t1", "nope")]


def test_the_policy_keeps_rules_and_they_open_nothing() -> None:
    policy = EgressPolicy.of(False, {"rules": {"api.example.com": rule({"X": "v"})}})
    assert policy.transforms.match("api.example.com") is not None
    assert not policy.may_resolve("api.example.com")
