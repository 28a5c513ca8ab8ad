"""env-pool settings (section ``[envpool]`` of the experiment file); the built
environments are ``[envpool.environments]``, their layer store a union on ``kind`` whose
variants carry only their own keys. The flat keys of earlier releases still load
(``kiln.shared.config_keys``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from kiln.shared.config import ListenAddress, Section, ServiceConfig, TaskSettings, one_variant
from kiln.shared.config_keys import renamed_in

MiB = 1024 * 1024


class NatsLayers(Section):
    """Built layers in the ``kiln-environments`` JetStream object store."""

    kind: Literal["nats"] = "nats"
    """Where built layers are shared between nodes, so each is built once per cluster:
    ``nats``: the ``kiln-environments`` JetStream object store; ``s3``: a bucket of any
    S3-compatible service (needs ``kiln-envpool[s3]``); ``none``: every node builds its own."""


class S3Layers(Section):
    """Built layers in a bucket of any S3-compatible service."""

    kind: Literal["s3"]
    bucket: str = ""
    """The bucket (required; it must exist). Credentials come from the standard AWS chain
    (``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, an instance or pod
    role), never from this file."""
    prefix: str = "kiln/environments"
    """Key prefix of the layers: one ``<prefix>/<digest>.tar.gz`` object per layer."""
    endpoint_url: str = ""
    """S3 endpoint; empty = AWS. Any other (MinIO, Ceph RGW, R2...) is addressed path-style."""
    region: str = ""
    """S3 region; empty = the AWS chain's (``AWS_REGION``, the profile)."""

    @model_validator(mode="after")
    def _needs_a_bucket(self):
        if not self.bucket:
            raise ValueError('envpool.environments.store.kind = "s3" needs envpool.environments.store.bucket')
        return self


class NoLayers(Section):
    """No sharing: every node builds its own layers."""

    kind: Literal["none"]


LayerStore = Annotated[NatsLayers | S3Layers | NoLayers, Field(discriminator="kind")]


class EnvironmentsSettings(Section):
    """This node's built environments (layers, uv cache; see docs/environments.md)."""

    root: str = "/var/tmp/kiln-environments"
    """Folder of this node's built environments. On disk, not tmpfs: environments are
    large. Shared by every env-pool process of the node."""
    budget_bytes: int = Field(default=64 * 1024 * MiB, ge=0)
    """Disk the built environments may take; past it the least recently used ones not in use
    are removed."""
    store: LayerStore = Field(default_factory=NatsLayers)
    """Where built layers are shared between nodes: one of the ``kind`` variants below."""

    @field_validator("store", mode="before")
    @classmethod
    def _store_kind(cls, v: Any) -> Any:
        return one_variant(v, "nats", (NatsLayers, S3Layers, NoLayers))


class EnvPoolSettings(Section):
    renamed_from: ClassVar[str] = "envpool"
    deprecated_keys: ClassVar[dict[str, str]] = renamed_in("envpool")

    node_id: str = ""
    """This node's id in its own subjects; empty = the service instance id."""
    backend: Literal["bwrap", "process"] = "bwrap"
    """``bwrap``: each command in a bubblewrap sandbox (no network, private pid/ipc/uts, read-only
    system, writable workspace only, unprivileged uid). ``process``: a plain subprocess with
    rlimits and a timeout, NO isolation; for development only (logged loudly)."""
    workspace_root: str = ""
    """Where workspaces live; empty = ``/dev/shm/kiln-envpool`` (tmpfs: fast, and charged to each
    sandbox's memory cgroup, which bounds its disk use) when usable, else the system temp dir.
    Each env-pool process works in its own ``<node id>-<pid>`` folder under it and removes it
    when it stops."""
    max_sandboxes: int = Field(default=1024, ge=0)
    """Sandboxes (leased + warm + being created) this node holds at once; beyond it ``create``
    fails at once with ``pool_exhausted``."""
    max_creating: int = Field(default=16, ge=1)
    """Sandboxes being created at once; further creates wait for a slot up to ``create_wait_s``."""
    create_wait_s: float = 10.0
    """How long a create may wait for a creation slot before it fails with ``busy``."""
    warm_per_task: int = Field(default=2, ge=0)
    """Idle sandboxes kept ready for each recently used task (0 = no warm pool)."""
    warm_tasks: int = Field(default=16, ge=0)
    """How many recently used tasks get a warm pool."""
    default_ttl_s: float = 900.0
    """Lease length when a request gives none."""
    reap_interval_s: float = 5.0
    """How often expired leases are destroyed and warm pools refilled."""
    output_limit_bytes: int = 64 * 1024
    """Captured stdout/stderr per command: head and tail kept, the cut marked."""
    output_kill_bytes: int = 16 * MiB
    """A command that writes more than this (per stream) is killed: output is not a disk."""
    max_command_timeout_s: float = 600.0
    """Upper bound on any command's wall-clock timeout."""
    cpu_seconds: int = 120
    """RLIMIT_CPU of each command."""
    address_space_bytes: int = 4096 * MiB
    """RLIMIT_AS of each command."""
    max_file_bytes: int = 64 * MiB
    """RLIMIT_FSIZE: the largest file a command may write."""
    open_files: int = 512
    """RLIMIT_NOFILE of each command."""
    processes: int = 512
    """RLIMIT_NPROC (per sandbox uid when env-pool runs as root, else per env-pool's uid)."""
    memory_bytes: int = 1024 * MiB
    """Memory cgroup limit per sandbox (includes its tmpfs workspace and /tmp)."""
    pids: int = 256
    """pids cgroup limit per sandbox (fork bombs stop here)."""
    tmp_bytes: int = 64 * MiB
    """Size of the private tmpfs mounted at /tmp for each command."""
    workspace_quota_bytes: int = 256 * MiB
    """A workspace above this after a command is reported and refuses further commands."""
    sandbox_uid_base: int = 200_000
    """As root, sandbox slot ``n`` runs as host uid/gid ``base + n`` (one uid per sandbox)."""
    seccomp: bool = True
    """``bwrap`` backend: a seccomp filter on every sandboxed command (``kiln.envpool.isolation.seccomp``,
    compiled with libseccomp once per node): ptrace and other processes' memory, mount
    syscalls, new namespaces (``unshare``, ``setns``, namespace flags of ``clone``, ``clone3``),
    keyring, BPF, perf, io_uring, userfaultfd, modules, kexec, reboot, swap, clock setting and
    file handles fail with EPERM (``clone3`` with ENOSYS, so glibc falls back to ``clone``); a
    foreign ABI (x32, i386) kills the process. Off only to debug a tool the filter breaks."""
    ro_binds: list[str] = Field(
        default_factory=lambda: ["/usr", "/etc/alternatives", "/etc/ld.so.cache", "/etc/ssl", "/etc/localtime"]
    )
    """Host paths mounted read-only into every sandbox (missing ones are skipped)."""
    max_read_bytes: int = 256 * 1024
    """read_file refuses files larger than this."""
    grep_max_matches: int = 200
    """grep returns at most this many matching lines."""
    diff_max_files: int = Field(default=10_000, ge=1)
    """Changed files, links and folders one workspace diff carries; a workspace with more
    gets a diff marked ``truncated`` at once (reward scores it ``not_applied``)."""
    diff_max_text_bytes: int = Field(default=32 * MiB, ge=0)
    """Text one workspace diff carries; more marks it ``truncated``."""
    max_path_chars: int = Field(default=1024, ge=16, le=3000)
    """Longest workspace path (relative) the file tools accept and a diff walks; a folder
    or file past it is listed in the diff's ``omitted`` (far below the host's PATH_MAX,
    which the workspace's host prefix would otherwise push a sandbox's paths past)."""
    max_path_depth: int = Field(default=128, ge=2)
    """Deepest workspace path (in levels) the file tools accept and a diff walks."""
    semantic_mode: Literal["auto", "embedding", "bm25"] = "auto"
    """semantic_search ranking: ``embedding`` (all-MiniLM-L6-v2, offline), ``bm25``, or ``auto``
    (embeddings once the model is loaded, BM25 until then or if it is not installed)."""
    snapshot_ttl_s: float = 7 * 24 * 3600
    """How long snapshots stay in the ``kiln-snapshots`` object store."""
    http: ListenAddress = Field(default_factory=ListenAddress)
    """The operator HTTP API (-1: off)."""
    environments: EnvironmentsSettings = Field(default_factory=EnvironmentsSettings)
    """This node's built environments (see docs/environments.md)."""


class EnvPoolConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite the sandboxes are created from."""
    envpool: EnvPoolSettings = Field(default_factory=EnvPoolSettings)
    """This service's settings."""
