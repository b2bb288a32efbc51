"""Connect envelopes and E2B query decoding, without a server."""

from __future__ import annotations

import pytest

from aenv.api import connect
from aenv.api.sandboxes import parse_metadata_query
from aenv.errors import InvalidRequest

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)


def test_envelopes_round_trip() -> None:
    body = connect.message_envelope({"a": 1}) + connect.message_envelope({"b": 2}) + connect.end_stream()
    assert connect.decode_envelopes(body) == [{"a": 1}, {"b": 2}]
    err = connect.end_stream(connect.ConnectError("deadline_exceeded", "late"))
    assert err[0] == 0x02 and b'"deadline_exceeded"' in err


def test_unknown_code_becomes_unknown() -> None:
    assert connect.ConnectError("bogus", "x").code == "unknown"


def test_camel_and_snake_keys() -> None:
    schema = {"watcherId": connect.STRING}
    assert connect.checked({"watcher_id": "w1"}, schema) == {"watcherId": "w1"}
    assert connect.checked({"watcherId": "w2", "unknown": 1}, schema) == {"watcherId": "w2"}


@pytest.mark.parametrize(
    ("value", "kind", "expected"),
    [
        ("7", connect.UINT32, 7),
        (7, connect.UINT32, 7),
        ("aGk", connect.BYTES, "aGk="),
        ("-_8", connect.BYTES, "+/8="),
        ("SIGNAL_SIGKILL", connect.ENUM, "SIGNAL_SIGKILL"),
        (["a", "b"], [connect.STRING], ["a", "b"]),
        ({"K": "v"}, ("map", connect.STRING), {"K": "v"}),
    ],
)
def test_proto3_json_values(value: object, kind: object, expected: object) -> None:
    assert connect.checked_value(value, kind, "f") == expected


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        ("x", connect.UINT32),
        (True, connect.UINT32),
        (-1, connect.UINT32),
        (2**32, connect.UINT32),
        (1.5, connect.UINT32),
        (1, connect.BOOL),
        ("true", connect.BOOL),
        ("a\x00b", connect.STRING),
        ("\ud800", connect.STRING),
        (5, connect.STRING),
        ("a" * 256, connect.PATH),
        ("/a" * 2049, connect.PATH),
        ("not base64!", connect.BYTES),
        ({"a": 1}, connect.ENUM),
        ("x", [connect.STRING]),
        ({"k": 1}, ("map", connect.STRING)),
        ([], {"pid": connect.UINT32}),
    ],
)
def test_proto3_json_mistakes_are_invalid_argument(value: object, kind: object) -> None:
    with pytest.raises(connect.ConnectError) as info:
        connect.checked_value(value, kind, "f")
    assert info.value.code == "invalid_argument"


def test_metadata_query_as_the_sdk_encodes_it() -> None:
    # the SDK sends metadata=a%252520b%3Dc%252Fd for {"a b": "c/d"}; the framework decodes once
    assert parse_metadata_query("a%2520b=c%252Fd") == {"a b": "c/d"}
    assert parse_metadata_query("k%3Dv%26k2%3Dv2") == {"k": "v", "k2": "v2"}
    with pytest.raises(InvalidRequest):
        parse_metadata_query("novalue")
