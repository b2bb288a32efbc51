"""Repository fixtures: a POSIX directory, and an S3 endpoint served by a real `moto` server
(an S3 implementation; the only stand-in here, because no real S3 is reachable from CI)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from aenv.repo.backends import Backend, PosixBackend, S3Backend

S3_KEY = {"access_key_id": "testing", "secret_access_key": "testing"}


@dataclass
class S3Endpoint:
    url: str

    def backend(self, bucket: str, prefix: str = "") -> S3Backend:
        return S3Backend(bucket, prefix, endpoint=self.url, region="us-east-1", **S3_KEY)

    def new_bucket(self) -> str:
        import boto3

        name = f"aenv-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id=S3_KEY["access_key_id"],
            aws_secret_access_key=S3_KEY["secret_access_key"],
        ).create_bucket(Bucket=name)
        return name


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    port = _free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    if shutil.which("moto_server") is None and not _have_moto():
        pytest.fail("the repository tests need moto[server] (scripts/install installs it)")
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto server did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.2)
    yield S3Endpoint(url)
    proc.terminate()
    proc.wait(10)


def _have_moto() -> bool:
    try:
        import moto.server  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(params=["posix", "s3"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Backend:
    if request.param == "posix":
        return PosixBackend(tmp_path / "repo")
    s3: S3Endpoint = request.getfixturevalue("s3")
    return s3.backend(s3.new_bucket(), "some/prefix")
