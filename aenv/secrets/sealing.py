"""Secrets' values encrypted at rest: AES-256-GCM under a key kept apart from the records, each
value bound to its secret's id, team and version (a sealed value copied onto another record does
not open)."""

from __future__ import annotations

import base64
import os
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from aenv.errors import Forbidden

KEY_BYTES = 32


class Sealer:
    def __init__(self, key: bytes) -> None:
        self._aead = AESGCM(key)

    @classmethod
    def from_file(cls, path: Path, *, make: bool) -> Sealer:
        """The key in ``path`` (32 bytes, owner-only), made there when missing and ``make``."""
        try:
            key = path.read_bytes()
        except FileNotFoundError:
            if not make:
                raise Forbidden(
                    "Secrets are not available on this deployment: its operator gives every node the same "
                    "AENV_SECRETS_KEY_FILE (docs/secrets.md)"
                ) from None
            key = os.urandom(KEY_BYTES)
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, key)
                os.fsync(fd)
            finally:
                os.close(fd)
        if len(key) != KEY_BYTES:
            raise Forbidden(f"Secrets are not available: the key file holds {len(key)} bytes, not {KEY_BYTES}")
        return cls(key)

    @staticmethod
    def _bound(secret_id: str, team: str, version: int) -> bytes:
        return f"{secret_id}\0{team}\0{version}".encode()

    def seal(self, value: str, secret_id: str, team: str, version: int) -> str:
        nonce = os.urandom(12)
        sealed = self._aead.encrypt(nonce, value.encode(), self._bound(secret_id, team, version))
        return base64.b64encode(nonce + sealed).decode()

    def open(self, sealed: str, secret_id: str, team: str, version: int) -> str:
        raw = base64.b64decode(sealed)
        return self._aead.decrypt(raw[:12], raw[12:], self._bound(secret_id, team, version)).decode()
