"""Signed upload URLs taken by any HTTP client, as E2B's own SDK suite does with `fetch` and `FormData`.

envd decides that a multipart part is the file by its field name (`file`) alone; the filename only
names the target when the URL has no path. Browsers' `FormData.append("file", text)` and
`curl -F file=<x` send no filename.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from e2b import Sandbox

from tests.compat.conftest import Deployment

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime

BOUNDARY = "aenvsuiteboundary"


def multipart(*parts: tuple[str, str | None, bytes]) -> bytes:
    """A multipart/form-data body of (field name, filename or None, content) parts."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return body + f"--{BOUNDARY}--\r\n".encode()


FORM = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def post(url: str, body: bytes) -> httpx.Response:
    return httpx.post(url, content=body, headers=FORM)


@pytest.fixture()
def secure() -> Iterator[Sandbox]:
    sandbox = Sandbox.create(secure=True, timeout=300)
    yield sandbox
    sandbox.kill()


@pytest.mark.parametrize(
    ("user", "home"),
    [(None, "/home/user"), ("root", "/root")],
)
def test_a_file_part_without_filename_goes_to_the_signed_path(secure: Sandbox, user: str | None, home: str) -> None:
    url = secure.upload_url("nameless.txt", user=user, use_signature_expiration=60_000)
    answer = post(url, multipart(("note", None, b"not the file"), ("file", None, b"file content")))
    assert answer.status_code == 200, answer.text
    assert answer.json() == [{"name": "nameless.txt", "path": f"{home}/nameless.txt", "type": "file"}]
    assert secure.files.read(f"{home}/nameless.txt", user=user or "user") == "file content"


def test_an_empty_filename_goes_to_the_signed_path(secure: Sandbox) -> None:
    url = secure.upload_url("/tmp/empty-name.txt", use_signature_expiration=60_000)
    answer = post(url, multipart(("file", "", b"named by the url")))
    assert answer.status_code == 200, answer.text
    assert secure.files.read("/tmp/empty-name.txt") == "named by the url"


def test_one_path_takes_one_file_part(secure: Sandbox) -> None:
    url = secure.upload_url("/tmp/one.txt", use_signature_expiration=60_000)
    answer = post(url, multipart(("file", "a.txt", b"first"), ("file", None, b"second")))
    assert answer.status_code == 400
    assert answer.json()["code"] == 400 and "one file" in answer.json()["message"]


def test_only_other_fields_is_no_file(secure: Sandbox) -> None:
    url = secure.upload_url("/tmp/none.txt", use_signature_expiration=60_000)
    answer = post(url, multipart(("note", None, b"no file here")))
    assert answer.status_code == 400
    assert "no file part" in answer.json()["message"]
    assert not secure.files.exists("/tmp/none.txt")


def test_a_nameless_file_part_needs_a_path(deployment: Deployment) -> None:
    """Without the path parameter the filename names the file: a part with none is a clear 400."""
    sandbox = Sandbox.create(timeout=120)
    try:
        headers = sandbox.connection_config.sandbox_headers  # routing and access token, as the SDK sends them
        body = multipart(("file", None, b"where to?"))
        answer = httpx.post(f"{deployment.url}/files", content=body, headers={**headers, **FORM})
        assert answer.status_code == 400
        assert answer.json()["code"] == 400 and "no filename" in answer.json()["message"]
        named = multipart(("file", "/tmp/named.txt", b"here"))
        assert httpx.post(f"{deployment.url}/files", content=named, headers={**headers, **FORM}).status_code == 200
        assert sandbox.files.read("/tmp/named.txt") == "here"
    finally:
        sandbox.kill()
