"""Node configuration: explicit argument, then AENV_* environment variable, then default."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

DEFAULT_DATA_DIR = Path("/var/lib/aenv")
DEFAULT_TIMEOUT = 300
DEFAULT_MAX_FORK = 16


# The highest per-user process limit a sandbox may be given. Agents boot with it as their own
# limit (a restored agent keeps the rlimits it was checkpointed with) and set each command's.
MAX_NPROC = 65536


class Settings(BaseSettings):
    """Every setting of a node. See docs/configuration.md for the full list."""

    model_config = SettingsConfigDict(env_prefix="AENV_", extra="forbid")

    host: str = "127.0.0.1"
    port: int = 3000
    data_dir: Path = DEFAULT_DATA_DIR
    api_key: str | None = None
    domain: str | None = None  # returned to SDKs for get_host(); None = derive from the request
    # Serve HTTPS with this PEM certificate and key (both or neither), e.g. a wildcard for `domain`.
    tls_cert: Path | None = None
    tls_key: Path | None = None

    # "fake" runs sandboxes as host processes with no isolation, without runsc or root: for tests
    # (./scripts/test --fast), never a default (aenv/runtime/fake.py). "qemu" boots each sandbox
    # as a QEMU microvm with its own kernel: boots, checkpoints, restores (aenv/runtime/qemu.py).
    driver: Literal["gvisor", "fake", "qemu"] = "gvisor"
    # The gVisor driver's alone.
    runsc: str = "runsc"
    # "auto": the platform this host ran a probe of agent work fastest on, measured at the first
    # node start and kept in runsc_calibration for every node of the host (aenv/runtime/platforms.py);
    # "ptrace", "systrap" or "kvm": that one, unmeasured.
    runsc_platform: Literal["auto", "ptrace", "systrap", "kvm"] = "auto"
    runsc_calibration: Path = Path("/var/cache/aenv/runsc-platform.json")
    # How a sandbox's cpu_count holds: "share" (default) weighs it as that many cores against busy
    # neighbours and lets it use idle ones; "cap" also limits it to that many cores' time, gVisor's
    # own kernel work included (it cost agent work ~25% in a run with in-memory file work, docs/performance.md).
    cpu_limit: Literal["share", "cap"] = "share"
    runsc_debug: bool = False
    # Extra runsc global flags (space-separated), after aenv's own: for measuring options
    # (bench/workload.py) and for an operator's host. A checkpoint image records them.
    runsc_flags: str = ""
    # The qemu driver's alone: its QEMU, the kernel it boots ("": the newest that scripts/install
    # unpacked, else of /boot) and its accelerator (auto: KVM where it boots, TCG elsewhere).
    qemu: str = "qemu-system-x86_64"
    qemu_kernel: str = ""
    qemu_accel: Literal["auto", "kvm", "tcg"] = "auto"

    # Lifecycle events and webhooks (aenv/events): how long events are kept; whether a webhook may
    # point at a loopback, private or link-local address ("auto": only on a node that listens on
    # loopback alone, where whoever registers one already reaches the host); a delivery's deadline
    # and its retries (each wait twice the one before, from webhook_retry_delay seconds).
    # Where volumes' directories are ("": <data_dir>/volumes); in a cluster, one shared directory
    # (NFS or similar) at the same path on every node (aenv/volumes).
    volumes_dir: Path | None = None
    # Each volume's size on a node alone: its own ext4 image (0: plain directories, no limit).
    volume_size_mb: int = Field(10240, ge=0, le=16 * 2**20)
    # The key secrets' values are encrypted with ("": <data_dir>/secrets.key, made at first use on
    # a node alone); in a cluster, the same file on every node, kept apart from etcd (aenv/secrets).
    secrets_key_file: Path | None = None
    events_retention_days: float = Field(7.0, gt=0, le=365)
    webhook_private_urls: Literal["auto", "allow", "deny"] = "auto"
    webhook_timeout: float = Field(10.0, gt=0, le=120)
    webhook_retries: int = Field(5, ge=0, le=20)
    webhook_retry_delay: float = Field(1.0, ge=0, le=600)

    default_timeout: int = DEFAULT_TIMEOUT
    max_timeout: int = 24 * 3600
    # The longest grace period a create may ask for: seconds after its timeout a sandbox is held
    # for scoring commands only (aenv/node/grace.py).
    max_grace: int = Field(3600, ge=0)
    # Rollout logs (aenv/node/rollout.py): the KiB each sandbox's log keeps (its oldest commands
    # go first; 0 turns the logs off), and the KiB of each stream of each command kept in it.
    rollout_log_kb: int = Field(1024, ge=0)
    rollout_output_kb: int = Field(16, ge=0)
    max_fork: int = Field(DEFAULT_MAX_FORK, ge=1)
    max_sandboxes: int = 1000
    # A create is refused (429, Retry-After) while the host has less memory available than this:
    # a burst of creates must not take the host's last memory (sandboxes' limits are overcommitted).
    min_free_memory_mb: int = Field(1024, ge=0)
    # Internet access of sandboxes created without allow_internet_access: E2B's default is on.
    # RL deployments usually turn it off (AENV_INTERNET_BY_DEFAULT=false) and allow-list instead.
    internet_by_default: bool = True
    # The node-local cache (pulled image layers, Dockerfile-step layers, and the layers and images
    # of templates and snapshots the repository holds): evicted (least recently used, never in
    # use) above this many MiB, down to layer_cache_low_ratio of it.
    layer_cache_mb: int = Field(20 * 1024, ge=0)
    layer_cache_low_ratio: float = Field(0.8, gt=0, le=1)
    # Where oci:/oci-archive:/docker-archive: image references may point (besides <data-dir>/imports):
    # API clients must not get to read arbitrary host files as images.
    image_import_dirs: list[str] = []
    # Registries spoken to over plain HTTP (besides localhost / 127.0.0.1), "host:port" each.
    insecure_registries: list[str] = []
    # Registry logins of the node (a Docker config.json: the JSON itself, or its path, read at each
    # pull), used for every pull whose client gave none; unset: $DOCKER_CONFIG or ~/.docker's.
    registry_auth: str | None = Field(None, repr=False)
    # Seconds a registry may go without sending a byte of an answer (504 past it).
    registry_read_timeout: float = Field(60.0, gt=0)
    # What an image's layers may unpack to (from a registry, oci: and docker-archive: alike), counted
    # as they decompress, a sparse file at its full size: 413 past a bound, before much is written.
    # A layer, and an image's layers together, at most this many MiB (SWE-bench's largest layers
    # are a few GiB) and entries (a layer of node_modules has a few hundred thousand), and past
    # layer_ratio_floor_mb at most max_layer_ratio times their compressed size: real layers compress
    # 2-10x (text 20x), a gzip bomb 1000x, a zstd one far more.
    max_layer_unpacked_mb: int = Field(64 * 1024, ge=1)
    max_image_unpacked_mb: int = Field(128 * 1024, ge=1)
    max_layer_ratio: float = Field(100.0, ge=1)
    layer_ratio_floor_mb: int = Field(256, ge=0)
    max_layer_entries: int = Field(2_000_000, ge=1)
    max_image_entries: int = Field(4_000_000, ge=1)

    @property
    def volumes_root(self) -> Path:
        return self.volumes_dir or self.data_dir / "volumes"

    @field_validator("registry_auth")
    @classmethod
    def _registry_auth(cls, value: str | None) -> str | None:
        import json

        if value is not None and value.strip().startswith("{"):
            try:
                body = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from None
            if not isinstance(body, dict) or not isinstance(body.get("auths", {}), dict):
                raise ValueError('must be a Docker config: {"auths": {"REGISTRY": {"auth": ...}}}')
        return value

    # Mirrors asked before a registry, in order (aenv/images/mirrors.py, which reads it, and
    # checks it at a node's start): AENV_REGISTRY_MIRRORS is
    # "docker.io=http://127.0.0.1:5000,ghcr.io=https://m.lan" or a JSON object of URLs or URL lists.
    registry_mirrors: Annotated[str | dict[str, Any], NoDecode] = ""

    reaper_interval: float = 1.0
    # A running sandbox with nothing running in it but its agent and nothing on its channel for
    # this many seconds is frozen on the host until its next request (aenv/node/doze.py): an idle
    # sandbox then costs no CPU. 0 turns that off.
    doze_after: float = Field(10.0, ge=0)
    # Usage samples of running sandboxes (E2B's sandbox metrics): seconds between two, and how many
    # each sandbox keeps (36 bytes each: 360 at 5 s are the last half hour, 13 KiB).
    metrics_interval: float = Field(5.0, gt=0)
    metrics_history: int = Field(360, ge=1, le=100_000)
    # Control-plane request bodies (JSON) past this many KiB are refused with 413 as they arrive.
    # Template build contexts and template file uploads are streamed to disk up to max_upload_mb;
    # envd's /files uploads stream into the sandbox, bounded by its disk quota.
    max_body_kb: int = Field(1024, ge=1)

    # What clients send to build from (a Dockerfile build's context, an E2B file upload), as sent.
    # Contexts of several GiB exist (datasets, model weights, vendored trees), most are MiBs; the
    # disk headroom below, not this, keeps the node's disk from filling.
    max_upload_mb: int = Field(10 * 1024, ge=1)
    # What one context or upload may unpack to (its tar after decompression, and the files it
    # writes): a well compressed upload of the largest size fits; a small gzip bomb stops here.
    max_unpacked_mb: int = Field(20 * 1024, ge=1)
    max_upload_entries: int = Field(1_000_000, ge=1)  # files, directories and links of one context
    # E2B uploads are kept by files hash (the SDK skips uploading what is present): removed once
    # unused for this many seconds (a presence check or a build using one renews it).
    upload_ttl: float = Field(24 * 3600.0, ge=0)
    # Uploads, builds, pulls and repository fetches are refused (507) rather than leave less than
    # this free on the data dir's filesystem: the host's disk never fills, sandboxes keep room.
    disk_headroom_mb: int = Field(4 * 1024, ge=0)
    # How long the node waits for a sandbox's agent to answer a call (or to show it is alive while
    # a stream is quiet); a wedged agent's calls then fail with 504 agent_timeout.
    agent_timeout: float = Field(30.0, gt=0)
    # Longest any lifecycle operation (create, pause, resume, snapshot, fork) may take: past it the
    # operation is cancelled and the sandbox goes back to where it was, or is killed.
    operation_timeout: float = Field(600.0, gt=0)
    # The port proxy (get_host URLs): seconds a sandbox's port has to take a request's bytes and to
    # start its answer (the response head, the WebSocket handshake) before the proxy gives up
    # (504), and the largest WebSocket message relayed either way (a larger one closes with 1009).
    port_response_timeout: float = Field(300.0, gt=0)
    port_ws_max_message_mb: int = Field(16, ge=1)
    # Seconds an idle keep-alive connection stays open. Longer than any client pool reuses one
    # (the E2B Python SDK: 300 s; undici: at most 600 s): a pool that reuses a connection the server
    # is closing at that moment fails the request (RemoteProtocolError).
    http_keepalive: int = Field(610, ge=1)
    # Slow clients (a slowloris holds a connection and a file descriptor): seconds a request's head
    # may take, and seconds a body may go without a byte (control-plane bodies: to arrive whole).
    http_head_timeout: float = Field(30.0, gt=0)
    http_body_timeout: float = Field(60.0, gt=0)
    # A request's head (request line and header lines), bounded while it arrives (431): signed
    # envd URLs carry a path of up to 4 KiB percent-encoded three times; Go's servers take 1 MiB.
    http_max_head_kb: int = Field(64, ge=1, le=1024)
    http_max_headers: int = Field(256, ge=16, le=10_000)
    # Connections still sending a head, in all and per client address, and kept-alive connections
    # idle between requests: past one, its oldest stalled connection is closed (a flood of half-sent
    # heads costs the flood, not the health check that comes next). Nodes and gateways alike.
    http_max_pending: int = Field(1024, ge=1)
    http_max_pending_per_ip: int = Field(256, ge=1)
    http_max_idle: int = Field(4096, ge=1)

    # The snapshot repository templates and snapshots are committed to: "" = <data-dir>/repo,
    # a path or file:// URL (e.g. a shared mount), s3://bucket/prefix, or "none" (node-local only).
    repo: str = ""
    repo_s3_endpoint: str | None = None  # for S3-compatible stores (MinIO, Ceph, R2, ...)
    repo_s3_region: str | None = None
    # Explicit S3 credentials; otherwise boto3's chain (AWS_* variables, ~/.aws, instance roles).
    repo_s3_access_key_id: str | None = None
    repo_s3_secret_access_key: str | None = None
    repo_gc_interval: float = Field(3600.0, ge=0)  # seconds between repository collections; 0 = never

    cpu_count: float = 1.0
    memory_mb: int = 1024
    # Tasks (processes and threads) of one user inside a sandbox. A fork bomb held at this limit
    # is killed by the node before the host stops the sandbox: at 512 the bomb starved the agent
    # of CPU for longer than the host's limit took to reach (see aenv/guest/runaway.py).
    nproc: int = Field(256, ge=16, le=MAX_NPROC)
    disk_mb: int = 2048
    # Blank uppers kept formatted and mounted, so creates and forks need not make theirs:
    # None = max_fork + 1 (a whole fork's worth); 0 = none.
    spare_uppers: int | None = Field(None, ge=0)
    # Warm pools (aenv/node/warmpool.py): idle sandboxes kept restored per template, taken by creates.
    # The most each template keeps unless set per template (0: none; its recent demand decides how
    # many below that), the memory all pools may hold together, the host's available memory below
    # which members are dropped, and the window (seconds) recent demand is counted over.
    warm_pool: int = Field(0, ge=0, le=1000)
    warm_pool_memory_mb: int = Field(2048, ge=0)
    warm_pool_min_free_mb: int = Field(2048, ge=0)
    warm_pool_window: float = Field(300.0, gt=0)
    # How long a new image's first sandbox (its template snapshotted from it, left running) waits
    # for the create that waited for the build; 0: image templates are built in a build sandbox
    # and the create restores the snapshot, as any other.
    first_sandbox_seconds: float = Field(30.0, ge=0, le=3600)

    # Cluster membership (docs/cluster.md): the etcd members (etcd://H1:P1,H2:P2,...), the URL
    # gateways reach this node at (default: http://host:port), and its id (default: made once
    # and kept in <data-dir>/node-id). Without `cluster` the node stands alone.
    cluster: str | None = None
    advertise: str | None = None
    node_id: str | None = None
    # PEM files for an etcds:// cluster: the members' CA (else the system's roots), and this node's
    # certificate and key when etcd checks clients' certificates.
    cluster_ca: str | None = None
    cluster_cert: str | None = None
    cluster_key: str | None = None
    # The etcd user this node logs in as when etcd's auth is on (aenv etcd-auth makes aenv-node),
    # and its password: a file holding it, or the value itself. Not needed with a client
    # certificate: etcd takes the user from its common name.
    cluster_user: str | None = None
    cluster_password_file: str | None = None
    cluster_password: str | None = Field(None, repr=False)
    cluster_lease_ttl: int = Field(10, ge=2, le=300)  # seconds a dead node stays registered
    # Seconds between two checks that the directory still gives this node its sandboxes (one read
    # of their entries, 64 to a transaction): a copy the directory gave to another node is killed.
    cluster_reconcile_interval: float = Field(10.0, gt=0)
    # Seconds a node stopped with SIGTERM spends draining itself first (its running sandboxes
    # paused durably and resumed on other nodes; cluster and repository needed); what is left is
    # then paused here, as a node alone does. 0 = no drain.
    drain_timeout: float = Field(90.0, ge=0)

    debian_mirror: str | None = None  # None = the host's apt sources
    debian_suite: str = "bookworm"
    build_base: bool = True  # build the `base` template on start if it is missing
    # The built-in `desktop` template (aenv/templates/desktop.py): its browser, and whether a create
    # from it before it exists starts its build (the create gets a 503 with Retry-After meanwhile)
    desktop_browser: Literal["chromium", "firefox-esr", "none"] = "chromium"  # firefox aborts under runsc 20240729
    desktop_on_first_use: bool = True
    # A template build's RUN steps reach public addresses (apt-get, pip install: as docker build
    # and E2B's builds do), never private ones or the node's own; false = no network in builds
    build_internet: bool = True
    # What builds may reach besides (a private package mirror): allowOut entries as a sandbox's
    # (CIDRs, addresses, domains), JSON, e.g. ["10.0.0.5/32", "pypi.internal"]; checked at a node's
    # start by the rules a sandbox's allowOut is read by (aenv/node/egress.py)
    build_allow_out: list[str] = []
