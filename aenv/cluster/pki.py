"""A private CA and etcd's certificates and root password, for a cluster on one host.

``scripts/cluster up`` (aenv/cluster/local.py) and deploy/compose.yaml use it: etcd speaks TLS to
its clients and peers and asks both for a certificate of this CA, and with etcd's auth on
(``aenv etcd-auth``) a client certificate's common name is its etcd user. One directory per part,
each with the CA's certificate and that part's certificate and key (what it mounts):

    ca.crt, ca.key                  the CA (its key signs nothing after this)
    member/member.crt, member.key   every etcd member, as server and as peer (names: ``hosts``)
    node/client.crt, client.key     CN=aenv-node: what a node may do (aenv/cluster/auth.py)
    gateway/client.crt, client.key  CN=aenv-gateway
    root/client.crt, client.key     CN=root: etcd's root (an operator's etcdctl, aenv etcd-auth)
    root/password                   etcd's root user's password

Every key and the password are 0600, every directory 0700: whoever reads a client key is that
etcd user. Keys are ECDSA P-256, made by the ``openssl`` command (Debian: openssl).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from aenv.cluster.auth import GATEWAY_USER, NODE_USER, ROOT
from aenv.errors import AenvError

CA_DAYS = 3650
CERT_DAYS = 825
MEMBER_CN = "etcd-member"  # not an etcd user: a member's certificate logs in as nobody
CLIENTS = {"node": NODE_USER, "gateway": GATEWAY_USER, "root": ROOT}
KEY = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]


class PkiError(AenvError):
    """openssl is missing or failed."""


def make(directory: Path, hosts: list[str]) -> None:
    """The CA and every certificate under ``directory`` (made 0700), unless its CA exists: then
    nothing is changed (a compose one-shot runs it at every start)."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    if (directory / "ca.crt").exists():
        return
    if shutil.which("openssl") is None:
        raise PkiError("the openssl command is not installed (Debian: apt-get install openssl)")
    old = os.umask(0o077)
    try:
        with tempfile.TemporaryDirectory(dir=directory) as scratch:
            work = Path(scratch)
            _openssl(
                ["req", "-x509", "-new", *KEY, "-days", str(CA_DAYS), "-subj", "/CN=aenv-etcd-ca"]
                + ["-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"]
                + ["-keyout", str(work / "ca.key"), "-out", str(work / "ca.crt")]
            )
            names = ",".join(_alt_name(h) for h in dict.fromkeys(hosts))
            _issue(work, "member", "member", MEMBER_CN, "serverAuth,clientAuth", names)
            for part, user in CLIENTS.items():
                _issue(work, part, "client", user, "clientAuth", None)
            (work / "root" / "password").write_text(secrets.token_urlsafe(32) + "\n")
            for part in ("member", *CLIENTS):
                shutil.copyfile(work / "ca.crt", work / part / "ca.crt")
                os.replace(work / part, directory / part)
            os.replace(work / "ca.key", directory / "ca.key")
            os.replace(work / "ca.crt", directory / "ca.crt")  # last: it says the rest is there
    finally:
        os.umask(old)


def _issue(work: Path, part: str, name: str, common_name: str, usage: str, alt_names: str | None) -> None:
    (work / part).mkdir(mode=0o700)
    extensions = [
        "basicConstraints=critical,CA:FALSE",
        "keyUsage=critical,digitalSignature,keyEncipherment",
        f"extendedKeyUsage={usage}",
    ]
    if alt_names:
        extensions.append(f"subjectAltName={alt_names}")
    (work / "ext").write_text("\n".join(extensions) + "\n")
    csr = _openssl(["req", "-new", *KEY, "-subj", f"/CN={common_name}", "-keyout", str(work / part / f"{name}.key")])
    _openssl(
        ["x509", "-req", "-CA", str(work / "ca.crt"), "-CAkey", str(work / "ca.key")]
        + ["-set_serial", f"0x{secrets.token_hex(16)}", "-days", str(CERT_DAYS), "-extfile", str(work / "ext")]
        + ["-out", str(work / part / f"{name}.crt")],
        csr,
    )


def _alt_name(host: str) -> str:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return f"DNS:{host}"
    return f"IP:{host}"


def _openssl(args: list[str], stdin: bytes | None = None) -> bytes:
    done = subprocess.run(["openssl", *args], input=stdin, capture_output=True, timeout=60)
    if done.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {done.stderr.decode(errors='replace')[-500:]}")
    return done.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m aenv.cluster.pki", description="etcd's CA, certificates and root password (once)"
    )
    parser.add_argument("directory", type=Path)
    parser.add_argument("hosts", nargs="+", help="the names and addresses the etcd members are reached at")
    args = parser.parse_args(argv)
    try:
        make(args.directory, args.hosts)
    except AenvError as exc:
        print(f"error: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
