"""Client configuration: explicit argument, then AENV_* environment variable, then default."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:3000"
DEFAULT_KEY_FILE = Path("/var/lib/aenv/api-key")
DEFAULT_REQUEST_TIMEOUT = 120.0


@dataclass(frozen=True, slots=True)
class ClientConfig:
    url: str
    api_key: str | None
    request_timeout: float

    @classmethod
    def resolve(
        cls,
        url: str | None = None,
        api_key: str | None = None,
        request_timeout: float | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> ClientConfig:
        env = os.environ if environ is None else environ
        key = api_key or env.get("AENV_API_KEY") or _key_from_file(Path(env.get("AENV_DATA_DIR", "")) / "api-key")
        key = key or _key_from_file(DEFAULT_KEY_FILE)
        timeout = (
            request_timeout
            if request_timeout is not None
            else float(env.get("AENV_REQUEST_TIMEOUT", DEFAULT_REQUEST_TIMEOUT))
        )
        return cls((url or env.get("AENV_URL") or DEFAULT_URL).rstrip("/"), key, timeout)


def _key_from_file(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except OSError:
        return None
