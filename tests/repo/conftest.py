"""Repository fixtures: a POSIX directory, and an S3 endpoint served by a real `moto` server
(an S3 implementation; the only stand-in here, because no real S3 is reachable from CI)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.repo.backends import Backend, PosixBackend
from tests.repo.s3 import S3Endpoint, start_moto


@pytest.fixture(scope="session")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Endpoint]:
    if not _have_moto():
        pytest.fail("the repository tests need moto[server] (scripts/install installs it)")
    proc, endpoint = start_moto(tmp_path_factory.mktemp("moto") / "moto.log")
    yield endpoint
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
