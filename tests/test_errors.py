"""The one error table: every row maps both ways, and the tree has one root."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from aenv import errors
from aenv.errors import ERROR_TABLE, AenvError, error_body, from_body
from tests.source import parse

pytestmark = pytest.mark.fast  # the fast tier (./scripts/test --fast)


@pytest.mark.parametrize("cls", list(ERROR_TABLE))
def test_each_row_round_trips(cls: type[AenvError]) -> None:
    status, code = ERROR_TABLE[cls]
    exc = cls("boom")
    body = error_body(exc)
    assert body == {"code": status, "message": "boom", "error_code": code}
    back = from_body(status, body)
    assert type(back) is cls and back.status == status and back.message == "boom"


def test_builtin_bases() -> None:
    assert issubclass(errors.SandboxNotFound, LookupError)
    assert issubclass(errors.InvalidRequest, ValueError)
    assert issubclass(errors.OperationTimeout, TimeoutError)
    assert errors.lookup(KeyError) == ERROR_TABLE[AenvError]


def test_one_exception_root_in_the_package() -> None:
    roots = []
    for path in Path(errors.__file__).parent.rglob("*.py"):
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(getattr(b, "id", "") == "Exception" for b in node.bases):
                roots.append(f"{path.name}:{node.name}")
    # AenvError, plus the channel and the guest side, which must stay stdlib-only and speak
    # Connect codes, HTTP statuses (the in-sandbox proxy) or sudo's exit codes
    assert sorted(roots) == sorted(
        [
            "errors.py:AenvError",
            "frames.py:StreamError",
            "frames.py:ProtocolViolation",
            "files.py:FileError",
            "processes.py:ProcessError",
            "egress.py:Refusal",
            "sudo.py:Refused",
            "connect.py:ConnectError",
        ]
    ), roots
