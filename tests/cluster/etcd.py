"""A real etcd cluster on loopback ports, for tests (and the cluster fixtures built on it)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

import httpx

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

    @property
    def client_url(self) -> str:
        return f"http://127.0.0.1:{self.client_port}"

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

    def healthy(self) -> bool:
        try:
            r = httpx.get(f"{self.client_url}/health", timeout=1)
            return r.status_code == 200 and r.json().get("health") == "true"
        except (httpx.HTTPError, ValueError):
            return False


class EtcdCluster:
    """``size`` etcd members on free loopback ports, data in a temp dir (tmpfs when there is one:
    fsyncs on a shared disk make elections slow)."""

    def __init__(self, size: int = 3) -> None:
        root = "/dev/shm" if Path("/dev/shm").is_dir() else None
        self.dir = Path(tempfile.mkdtemp(prefix="aenv-etcd-", dir=root))
        token = uuid.uuid4().hex
        self.members = [
            Member(f"m{i}", free_port(), free_port(), self.dir / f"m{i}", self.dir / f"m{i}.log") for i in range(size)
        ]
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        for m in self.members:
            m.argv = [
                "etcd",
                f"--name={m.name}",
                f"--data-dir={m.data_dir}",
                f"--listen-client-urls={m.client_url}",
                f"--advertise-client-urls={m.client_url}",
                f"--listen-peer-urls={m.peer_url}",
                f"--initial-advertise-peer-urls={m.peer_url}",
                f"--initial-cluster={initial}",
                f"--initial-cluster-token={token}",
                "--initial-cluster-state=new",
                "--logger=zap",
                "--log-level=warn",
            ]

    @property
    def url(self) -> str:
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

    def stop(self) -> None:
        for m in self.members:
            m.stop(signal.SIGKILL)  # its data goes too: nothing to shut down cleanly
        shutil.rmtree(self.dir, ignore_errors=True)
