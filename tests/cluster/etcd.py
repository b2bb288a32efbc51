"""A real etcd cluster on loopback ports, for tests (and the cluster fixtures built on it)."""

from __future__ import annotations

import shutil
import signal
import ssl
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.cluster.domain import Certificates
from tests.conftest import free_port

START_TIMEOUT = 30.0


@dataclass
class Member:
    name: str
    client_port: int
    peer_port: int
    data_dir: Path
    log: Path
    argv: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    tls: Certificates | None = None  # clients speak TLS and show a certificate of the same CA

    @property
    def client_url(self) -> str:
        return f"https://localhost:{self.client_port}" if self.tls else f"http://127.0.0.1:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://127.0.0.1:{self.peer_port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT, start_new_session=True
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def _trust(self) -> ssl.SSLContext | bool:
        if self.tls is None:
            return True
        context = ssl.create_default_context(cafile=self.tls.ca)
        context.load_cert_chain(self.tls.cert, self.tls.key)
        return context

    def healthy(self) -> bool:
        try:
            r = httpx.get(f"{self.client_url}/health", timeout=1, verify=self._trust())
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False


class EtcdCluster:
    """``size`` etcd members on free loopback ports, data in a temp dir (tmpfs when there is one:
    fsyncs on a shared disk make elections slow)."""

    def __init__(self, size: int = 3, *, tls: Certificates | None = None, args: tuple[str, ...] = ()) -> None:
        """With ``tls`` (a certificate for localhost, good for clients too), the members serve
        clients over TLS only and ask for a client certificate of the same CA; ``args``: more of
        etcd's flags for every member."""
        root = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.dir = Path(tempfile.mkdtemp(prefix="aenv-etcd-", dir=root))
        token = uuid.uuid4().hex
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self.dir / f"m{i}", self.dir / f"m{i}.log", tls=tls)
            for i in range(size)
        ]
        self.tls = tls
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.argv = [
                "etcd",
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls={m.client_url.replace('localhost', '127.0.0.1')}",
                f"--advertise-client-urls={m.client_url}",
                f"--listen-peer-urls={m.peer_url}",
                f"--initial-advertise-peer-urls={m.peer_url}",
                f"--initial-cluster={initial}",
                f"--initial-cluster-token={token}",
                "--initial-cluster-state=new",
                "--logger=zap",
                "--log-level=warn",
                *args,
            ]
            if tls is not None:
                m.argv += [
                    f"--cert-file={tls.cert}",
                    f"--key-file={tls.key}",
                    f"--trusted-ca-file={tls.ca}",
                    "--client-cert-auth",
                ]

    @property
    def url(self) -> str:
        if self.tls is not None:  # by the name the certificate holds
            return "etcds://" + ",".join(f"localhost:{m.client_port}" for m in self.members)
        return "etcd://" + ",".join(f"127.0.0.1:{m.client_port}" for m in self.members)

    def start(self) -> None:
        if shutil.which("etcd") is None:
            raise RuntimeError("etcd is not installed (Debian: apt-get install etcd-server; scripts/install does it)")
        for m in self.members:
            m.start()
        self.wait_healthy(self.members)

    def wait_healthy(self, members: list[Member], timeout: float = START_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        while not all(m.healthy() for m in members):
            for m in members:
                if m.proc is not None and m.proc.poll() is not None:
                    raise RuntimeError(f"etcd member {m.name} exited:\n{m.log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError("etcd cluster did not become healthy:\n" + self.members[0].log.read_text()[-3000:])
            time.sleep(0.2)

    def restart(self, member: Member) -> None:
        member.start()
        self.wait_healthy([member])

    def _v3(self, member: Member, path: str, body: dict[str, object]) -> dict[str, object]:
        # etcd's JSON gateway to its gRPC API (ids are decimal strings in it)
        r = httpx.post(f"{member.client_url}/v3/{path}", json=body, timeout=5, verify=member._trust())
        r.raise_for_status()
        answer: dict[str, object] = r.json()
        return answer

    def leader(self) -> Member:
        """The member that leads now (as a member that is up sees it)."""
        up = next(m for m in self.members if m.proc is not None and m.healthy())
        leader_id = self._v3(up, "maintenance/status", {})["leader"]
        for m in self.members:
            if m.proc is not None and self._v3(m, "maintenance/status", {})["header"]["member_id"] == leader_id:  # type: ignore[index]
                return m
        raise RuntimeError(f"no member is leader {leader_id}")

    def make_leader(self, member: Member, timeout: float = 15) -> None:
        """Hand the leadership to ``member`` (etcd's MoveLeader, asked of the leader)."""
        target = self._v3(member, "maintenance/status", {})["header"]["member_id"]  # type: ignore[index]
        deadline = time.monotonic() + timeout
        while (leader := self.leader()) is not member:
            try:
                self._v3(leader, "maintenance/transfer-leadership", {"targetID": target})
            except httpx.HTTPError:
                pass  # an election meanwhile: ask the new leader
            assert time.monotonic() < deadline, f"{member.name} did not become leader"
            time.sleep(0.2)

    def stop(self) -> None:
        for m in self.members:
            m.stop(signal.SIGKILL)  # its data goes too: nothing to shut down cleanly
        shutil.rmtree(self.dir, ignore_errors=True)
