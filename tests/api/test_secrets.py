"""E2B's secrets with the E2B SDK's own calls: kept, listed page by page, updated to a new version,
deleted; their values never answered, never in the node's files in the clear, nor in its log."""

from __future__ import annotations

import secrets
from pathlib import Path

import httpx
import pytest
from e2b import Secret, SecretException, SecretNotFoundException

from tests.conftest import Server

pytestmark = [pytest.mark.sandbox, pytest.mark.fast]  # the fast tier runs it on the fake runtime


def _everywhere(root: Path, needle: bytes) -> list[Path]:
    """Files below ``root`` (and the node's log) whose bytes hold ``needle``."""
    found = []
    for path in root.rglob("*"):
        try:
            if path.is_file() and not path.is_symlink() and path.stat().st_size < 64 << 20:
                if needle in path.read_bytes():
                    found.append(path)
        except OSError:
            continue
    return found


def test_secrets_are_kept_listed_updated_and_deleted_with_the_sdk(e2b_env: Server, api: httpx.Client) -> None:
    name = f"OpenAI_{secrets.token_hex(3)}"
    value = f"sk-test-{secrets.token_hex(16)}"
    made = Secret.create(name, value, metadata={"owner": "rl"})
    try:
        assert made.name == name.lower() and made.secret_id.startswith("sec_") and made.version == 1
        assert made.metadata == {"owner": "rl"}
        by_name = Secret.get_info(name.upper())  # names are case-insensitive
        assert by_name.secret_id == made.secret_id
        assert Secret.exists(made.secret_id) and not Secret.exists("no-such-secret")
        with pytest.raises(SecretException, match="409"):
            Secret.create(name.lower(), "another")
        updated = Secret.update(made.secret_id, value + "-v2")
        assert updated.version == 2 and updated.metadata == {"owner": "rl"}  # metadata left out: kept
        cleared = Secret.update(name, value + "-v3", metadata={})
        assert cleared.version == 3 and cleared.metadata == {}
        for answer in (
            api.get("/secrets").text,
            api.get(f"/secrets/{made.secret_id}").text,
            api.post(f"/secrets/{made.secret_id}", json={"value": value}).text,
        ):
            assert value not in answer and "-v2" not in answer
        assert api.get(f"/secrets/{made.secret_id}").headers["cache-control"] == "no-store"
        # the value is nowhere in the node's files or log, in the clear
        assert _everywhere(Path(e2b_env.data_dir), value.encode()) == []
        assert value not in e2b_env.log.read_text(errors="replace")
    finally:
        assert Secret.destroy(made.secret_id) is True
    assert Secret.destroy(made.secret_id) is False
    with pytest.raises(SecretNotFoundException):
        Secret.get_info(made.secret_id)


def test_secrets_page_with_e2bs_next_token(e2b_env: Server) -> None:
    prefix = f"page-{secrets.token_hex(3)}"
    made = [Secret.create(f"{prefix}-{i}", "v") for i in range(5)]
    try:
        paginator = Secret.list(limit=2)
        seen: list[str] = []
        while paginator.has_next:
            seen += [s.name for s in paginator.next_items()]
        assert [n for n in seen if n.startswith(prefix)] == [s.name for s in made]
        assert len(seen) == len(set(seen))
    finally:
        for secret in made:
            Secret.destroy(secret.secret_id)


def test_bad_secrets_are_clear_400s(api: httpx.Client) -> None:
    bad = [
        {"name": "sec_x", "value": "v"},
        {"name": "a.b", "value": "v"},
        {"name": "x" * 129, "value": "v"},
        {"name": "ok", "value": ""},
        {"name": "ok", "value": "v" * (64 * 1024 + 1)},
        {"name": "ok", "value": "v", "metadata": {str(i): "x" for i in range(33)}},
        {"name": "ok", "value": "v", "metadata": {"k": 1}},
        {"name": "ok", "value": 5},
        {"name": "ok"},
    ]
    for body in bad:
        r = api.post("/secrets", json=body)
        assert r.status_code == 400, (body, r.text[:200])
        assert set(r.json()) >= {"code", "message"}
    assert api.get("/secrets", params={"nextToken": "%%%"}).status_code == 400
    assert api.get("/secrets", params={"limit": 0}).status_code == 400
    assert api.get("/secrets/nonesuch").status_code == 404
