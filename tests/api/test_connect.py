"""Connect envelopes and E2B query decoding, without a server."""

from __future__ import annotations

import pytest

from aenv.api import connect
from aenv.api.sandboxes import parse_metadata_query
from aenv.errors import InvalidRequest


def test_envelopes_round_trip() -> None:
    body = connect.message_envelope({"a": 1}) + connect.message_envelope({"b": 2}) + connect.end_stream()
    assert connect.decode_envelopes(body) == [{"a": 1}, {"b": 2}]
    err = connect.end_stream(connect.ConnectError("deadline_exceeded", "late"))
    assert err[0] == 0x02 and b'"deadline_exceeded"' in err


def test_unknown_code_becomes_unknown() -> None:
    assert connect.ConnectError("bogus", "x").code == "unknown"


def test_camel_and_snake_keys() -> None:
    assert connect.get({"watcher_id": "w1"}, "watcherId") == "w1"
    assert connect.get({"watcherId": "w2"}, "watcherId") == "w2"


def test_metadata_query_as_the_sdk_encodes_it() -> None:
    # the SDK sends metadata=a%252520b%3Dc%252Fd for {"a b": "c/d"}; the framework decodes once
    assert parse_metadata_query("a%2520b=c%252Fd") == {"a b": "c/d"}
    assert parse_metadata_query("k%3Dv%26k2%3Dv2") == {"k": "v", "k2": "v2"}
    with pytest.raises(InvalidRequest):
        parse_metadata_query("novalue")
