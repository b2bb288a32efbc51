"""Domain mode for tests: a wildcard certificate under a CA made for the test, a DNS server that
answers every name under the test's domain, and clients that use both unchanged.

How a client finds ``*.D`` without touching the machine's resolver: the E2B Python SDK resolves
names with pyqwest's own resolver (Rust; it reads ``/etc/resolv.conf``, not Python's
``getaddrinfo``, so patching that in-process does nothing), and the sandbox's name is known only
after its create, so per-name ``/etc/hosts`` lines would be written while the SDK's resolver has
already read the file. So the client runs as a child process in its own mount namespace, where
``/etc/resolv.conf`` (a bind mount seen by that process alone) names the test's DNS server, which
answers ``D`` and every ``*.D`` with the loopback address the gateway listens on. The SDK's
resolver, its TLS and its URLs stay exactly as shipped; it trusts the test CA through
``SSL_CERT_FILE`` (pyqwest loads the system's roots from it; Node.js takes ``NODE_EXTRA_CA_CERTS``).
"""

from __future__ import annotations

import datetime
import os
import random
import socket
import struct
import subprocess
import threading
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class Certificates:
    ca: Path  # the CA's certificate, for clients to trust
    cert: Path  # the server's: D and *.D
    key: Path


def make_certificates(directory: Path, domain: str, *, client: bool = False) -> Certificates:
    """A CA and a certificate for ``domain`` and ``*.domain`` signed by it (valid for a day); with
    ``client``, good for a client's authentication too (etcd's --client-cert-auth)."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"aenv test CA for {domain}")])
    ca = (
        _valid(x509.CertificateBuilder(), now)
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(signs=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        _valid(x509.CertificateBuilder(), now)
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, domain)]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(domain), x509.DNSName(f"*.{domain}")]), False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(signs=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(_usages(client)), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = Certificates(directory / "ca.pem", directory / "cert.pem", directory / "key.pem")
    paths.ca.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    paths.key.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return paths


def _usages(client: bool) -> list[x509.ObjectIdentifier]:
    return [ExtendedKeyUsageOID.SERVER_AUTH, *([ExtendedKeyUsageOID.CLIENT_AUTH] if client else [])]


def _valid(builder: x509.CertificateBuilder, now: datetime.datetime) -> x509.CertificateBuilder:
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
    )


def _key_usage(*, signs: bool) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=signs,
        crl_sign=signs,
        encipher_only=False,
        decipher_only=False,
    )


def loopback_address() -> str:
    """A loopback address of its own (all of 127/8 is loopback) with UDP 53 and TCP 443 free, so
    the test's DNS server and gateway take the ports clients assume without another test's."""
    for _ in range(50):
        address = f"127.{random.randint(64, 250)}.{random.randint(0, 255)}.{random.randint(1, 254)}"
        try:
            for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                with socket.socket(socket.AF_INET, kind) as s:
                    s.bind((address, 53 if kind == socket.SOCK_DGRAM else 443))
        except OSError:
            continue
        return address
    raise RuntimeError("no free loopback address")


@dataclass
class WildcardDNS:
    """A DNS server (UDP) on ``address``:53: A records of ``answer`` for ``domain`` and every name
    under it, no records for other types, NXDOMAIN for any other name. Notes every name asked."""

    address: str
    domain: str
    answer: str
    asked: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind((self.address, 53))
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._sock.close()

    def resolv_conf(self, directory: Path) -> Path:
        path = directory / "resolv.conf"
        path.write_text(f"nameserver {self.address}\noptions timeout:2 attempts:2\n")
        return path

    def _serve(self) -> None:
        while True:
            try:
                query, peer = self._sock.recvfrom(512)
                self._sock.sendto(self._reply(query), peer)
            except OSError:
                return
            except (IndexError, struct.error, UnicodeDecodeError):
                continue  # not a query this server understands

    def _reply(self, query: bytes) -> bytes:
        ident = query[:2]
        labels, offset = [], 12
        while query[offset]:
            labels.append(query[offset + 1 : offset + 1 + query[offset]].decode("ascii"))
            offset += 1 + query[offset]
        qtype = struct.unpack(">H", query[offset + 1 : offset + 3])[0]
        question = query[12 : offset + 5]
        name = ".".join(labels).lower()
        self.asked.append(name)
        ours = name == self.domain or name.endswith("." + self.domain)
        answers = b""
        if ours and qtype == 1:  # A
            answers = b"\xc0\x0c" + struct.pack(">HHIH", 1, 1, 5, 4) + socket.inet_aton(self.answer)
        flags = 0x8180 | (0 if ours else 3)  # a response, recursion available; NXDOMAIN when not ours
        header = ident + struct.pack(">HHHHH", flags, 1, 1 if answers else 0, 0, 0)
        return header + question + answers


def run_resolving(
    command: list[str], resolv_conf: Path, env: dict[str, str], timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``command`` in a mount namespace of its own where /etc/resolv.conf is ``resolv_conf``
    (the machine's stays as it is for every other process)."""
    script = 'mount --bind "$0" /etc/resolv.conf && exec "$@"'
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, str(resolv_conf), *command],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def client_env(extra: dict[str, str]) -> dict[str, str]:
    """This process's environment without any E2B_* setting, plus ``extra``."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith("E2B_")}, **extra}
