"""The native Python SDK: async first, with a sync face derived from it.

from aenv.sdk import Client
with Client() as c:
    sbx = c.create()
    print(sbx.exec("echo hi").stdout)
    children = sbx.fork(4)

from aenv.sdk import AsyncClient
async with AsyncClient() as c:
    sbx = await c.create()
    result = await sbx.exec("echo hi")
"""

from aenv.errors import (
    AenvError,
    CommandFailed,
    Conflict,
    InvalidRequest,
    LimitExceeded,
    NotFound,
    OperationTimeout,
    PayloadTooLarge,
    SandboxError,
    SandboxGone,
    SandboxNotFound,
    SnapshotNotFound,
    TemplateNotFound,
    Unauthenticated,
    WrongState,
)
from aenv.sdk._async import AsyncClient, AsyncSandbox, SandboxInfo
from aenv.sdk._rl import best_of_n, fork_group, tree_search
from aenv.sdk._rollout import BestOfN, Branch, TreeSearch
from aenv.sdk._sync import Client, Pty, Sandbox
from aenv.sdk._templates import BuildError
from aenv.sdk._wire import DEFAULT_EXEC_TIMEOUT, CommandResult, PtySession

__all__ = [
    "AenvError",
    "AsyncClient",
    "AsyncSandbox",
    "BestOfN",
    "Branch",
    "BuildError",
    "Client",
    "CommandFailed",
    "CommandResult",
    "Conflict",
    "DEFAULT_EXEC_TIMEOUT",
    "InvalidRequest",
    "LimitExceeded",
    "NotFound",
    "OperationTimeout",
    "PayloadTooLarge",
    "Pty",
    "PtySession",
    "Sandbox",
    "SandboxError",
    "SandboxGone",
    "SandboxInfo",
    "SandboxNotFound",
    "SnapshotNotFound",
    "TemplateNotFound",
    "TreeSearch",
    "Unauthenticated",
    "WrongState",
    "best_of_n",
    "fork_group",
    "tree_search",
]
