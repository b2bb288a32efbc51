"""etcd users and roles for a cluster (``aenv etcd-auth``), and turning etcd's auth on.

Without auth, whoever reaches etcd reads the cluster secret (every sandbox's access and traffic
token, every signed URL derives from it) and can rewrite the directory. With it, only aenv's users
reach its keys, each with what its part does and no more:

- ``aenv-node``: read and write everything under /aenv/ (it registers itself, writes the secret
  once, its sandboxes' entries, takeovers, create ids; drops tombstones it obeyed);
- ``aenv-gateway``: read everything under /aenv/ (the directory it mirrors and the secret its
  signed URLs and wake tokens need), write only sandbox entries and tombstones (the kill of a lost
  node's sandbox) and the teams' create reservations (/aenv/teams/q/, aenv/teams/gateway.py). It
  cannot register a node, rewrite the configuration, claim a create or make a team or key;
- ``root`` (etcd's own): only for this set-up and for operators.

A node or gateway logs in with AENV_CLUSTER_USER and AENV_CLUSTER_PASSWORD_FILE; over TLS with
client certificates etcd takes the user from the certificate's common name instead (issue
certificates with CN=aenv-node and CN=aenv-gateway). Running it again changes nothing but the
passwords given: a user made before keeps its password unless a new one is given.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import aetcd.rpc

from aenv.cluster.entries import PREFIX, SANDBOXES_PREFIX, TOMBSTONES_PREFIX
from aenv.cluster.store import ClusterStore, EtcdTls, EtcdUser
from aenv.errors import ClusterUnavailable
from aenv.teams.cluster import QUOTA_PREFIX

ROOT = "root"
NODE_USER = "aenv-node"
GATEWAY_USER = "aenv-gateway"
READ, WRITE, READWRITE = aetcd.rpc.Permission.READ, aetcd.rpc.Permission.WRITE, aetcd.rpc.Permission.READWRITE
# role (and user) -> (permission, key prefix)
ROLES: dict[str, list[tuple[int, str]]] = {
    NODE_USER: [(READWRITE, PREFIX)],
    GATEWAY_USER: [(READ, PREFIX), (WRITE, SANDBOXES_PREFIX), (WRITE, TOMBSTONES_PREFIX), (WRITE, QUOTA_PREFIX)],
}


@dataclass(frozen=True)
class AuthReport:
    enabled_now: bool  # False: auth was on already (logged in as root)
    users: dict[str, list[str]]  # user -> its grants, as "read /aenv/"


def prefix_end(prefix: str) -> bytes:
    """The end of the key range holding every key that starts with ``prefix``."""
    raw = prefix.encode()
    return raw[:-1] + bytes([raw[-1] + 1])


async def enable_auth(
    url: str,
    root_password: str,
    passwords: dict[str, str | None],
    *,
    tls: EtcdTls | None = None,
    timeout: float = 5.0,
) -> AuthReport:
    """Make etcd's root user and aenv's users and roles (``passwords``: user -> its password; None
    keeps an existing user's and gives a new one a random one: a user who logs in by certificate),
    then turn auth on. Idempotent."""
    store = ClusterStore.from_url(url, tls=tls, user=EtcdUser(ROOT, root_password), timeout=timeout)
    enabled_now = True
    try:
        try:
            await store.get_config()  # logs in as root: auth is on already
            enabled_now = False
        except ClusterUnavailable as exc:
            if "not enabled" not in exc.message:
                raise
            await store.close()
            store = ClusterStore.from_url(url, tls=tls, timeout=timeout)  # no auth yet: no login
        await _user(store, ROOT, root_password, "root")
        report: dict[str, list[str]] = {}
        for role, grants in ROLES.items():
            await store.auth_request(
                f"add role {role}", "RoleAdd", aetcd.rpc.AuthRoleAddRequest(name=role), done_if="already exists"
            )
            for kind, prefix in grants:
                permission = aetcd.rpc.Permission(permType=kind, key=prefix.encode(), range_end=prefix_end(prefix))
                request = aetcd.rpc.AuthRoleGrantPermissionRequest(name=role, perm=permission)
                await store.auth_request(f"grant role {role} {prefix}", "RoleGrantPermission", request)
            report[role] = [f"{aetcd.rpc.Permission.Type.Name(k).lower()} {p}" for k, p in grants]
        for user in ROLES:
            await _user(store, user, passwords.get(user), user)
        if enabled_now:
            await store.auth_request("turn auth on", "AuthEnable", aetcd.rpc.AuthEnableRequest())
        return AuthReport(enabled_now, report)
    finally:
        await store.close()


async def _user(store: ClusterStore, name: str, password: str | None, role: str) -> None:
    """The user with this role, and this password (a new user without one: a random one; an
    existing user without one keeps its own: its sessions and files stay good)."""
    added = await store.auth_request(
        f"add user {name}",
        "UserAdd",
        aetcd.rpc.AuthUserAddRequest(name=name, password=password or secrets.token_urlsafe(32)),
        done_if="already exists",
    )
    if added is None and password is not None:
        request = aetcd.rpc.AuthUserChangePasswordRequest(name=name, password=password)
        await store.auth_request(f"set the password of {name}", "UserChangePassword", request)
    grant = aetcd.rpc.AuthUserGrantRoleRequest(user=name, role=role)
    await store.auth_request(f"grant {name} role {role}", "UserGrantRole", grant)
