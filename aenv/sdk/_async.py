"""The native async client. The data plane is E2B's envd API (Connect JSON), as the server serves it.

Its parts: :mod:`aenv.sdk._client` (:class:`AsyncClient`: creating sandboxes and the node-wide
calls) and :mod:`aenv.sdk._sandbox` (:class:`AsyncSandbox`: one sandbox's calls). The sync face
(:mod:`aenv.sdk._sync`) and the rollout helpers import them from here.
"""

from __future__ import annotations

from aenv.sdk._client import AsyncClient
from aenv.sdk._sandbox import SCORING_HEADER, AsyncSandbox, SandboxInfo, kill_all

__all__ = ["SCORING_HEADER", "AsyncClient", "AsyncSandbox", "SandboxInfo", "kill_all"]
