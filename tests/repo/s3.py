"""An S3 endpoint for tests and benchmarks: a real `moto` server on loopback (an S3
implementation; no real S3 is reachable from CI)."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from aenv.repo.backends import S3Backend
from tests.conftest import free_port

S3_KEY = {"access_key_id": "testing", "secret_access_key": "testing"}
REGION = "us-east-1"


@dataclass
class S3Endpoint:
    url: str

    def backend(self, bucket: str, prefix: str = "") -> S3Backend:
        return S3Backend(bucket, prefix, endpoint=self.url, region=REGION, **S3_KEY)

    def new_bucket(self, name: str | None = None) -> str:
        import boto3

        name = name or f"aenv-{uuid.uuid4().hex[:12]}"
        boto3.client(
            "s3",
            endpoint_url=self.url,
            region_name=REGION,
            aws_access_key_id=S3_KEY["access_key_id"],
            aws_secret_access_key=S3_KEY["secret_access_key"],
        ).create_bucket(Bucket=name)
        return name


def start_moto(log: Path) -> tuple[subprocess.Popen[bytes], S3Endpoint]:
    """Start a moto server on a free port; its output goes to ``log``."""
    port = free_port()
    argv = [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)]
    proc = subprocess.Popen(argv, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(url, timeout=1)
            return proc, S3Endpoint(url)
        except httpx.HTTPError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError(f"moto server did not start:\n{log.read_text()[-2000:]}") from None
            time.sleep(0.2)
