"""learner settings (section ``[learner]`` of the experiment file), by concern: the
world (``parallelism``), ``precision``, how ranks start (``launcher``: torchrun or Ray,
each variant with only its own keys), the supervised ``warm_start``, the learning-rate
``schedule`` and the ``checkpoint``s; the flat keys of earlier releases still load
(``kiln.shared.config_keys``)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator

from kiln.shared.config import (
    AlgorithmSettings,
    DatabaseSettings,
    EvalSettings,
    ModelSettings,
    Section,
    ServiceConfig,
    TaskSettings,
    one_variant,
)
from kiln.shared.config_keys import renamed_in


class ParallelismSettings(Section):
    """The learner's world: ``dp_shard`` x ``ep`` ranks (``kiln.learner.parallel``)."""

    dp_shard: int = Field(default=1, ge=1)
    """FSDP2 shard degree of the learner's world (world = ``dp_shard`` x ``ep`` ranks,
    started by torchrun from ``kiln run``, or by Ray: ``launcher``)."""
    ep: int = Field(default=1, ge=1)
    """Expert-parallel degree: experts are split over this many ranks (must divide
    ``model.num_experts``)."""
    ep_dispatch: Literal["hp", "mxfp8"] = "hp"
    """Payload of the expert all-to-all: the activations' own precision, or MXFP8 (a
    quarter of fp32's bytes; gradients stay high precision)."""


class PrecisionSettings(Section):
    """Training precision (``kiln.learner.precision``)."""

    mode: Literal["fp32", "bf16", "mxfp8", "fp8_rowwise"] = "fp32"
    """Training precision: ``mxfp8`` runs the attention and expert GEMMs in MXFP8 through
    torchao (fp32 master weights), ``fp8_rowwise`` is the Hopper option, ``bf16`` trains
    bf16 parameters (see ``kiln.learner.precision``)."""
    kernel: Literal["emulated", "auto"] = "emulated"
    """torchao kernels for ``mxfp8``: ``emulated`` (any device, the CPU path) or ``auto``
    (torchao's CUDA kernels, SM100+)."""
    keep_high_precision: list[str] = Field(
        default_factory=lambda: ["*.mlp.gate", "*.shared_expert_gate", "embed_tokens", "lm_head"]
    )
    """Module-name patterns (fnmatch) never converted to low precision: by default the
    routers (and a shared expert's gate), the embeddings and the output head."""


class TorchrunLauncher(Section):
    """``kiln run`` starts a multi-rank learner under torchrun on this machine."""

    kind: Literal["torchrun"] = "torchrun"
    """How a multi-rank learner (``parallelism.dp_shard`` x ``parallelism.ep`` > 1) starts
    its ranks: ``torchrun`` on this machine (``kiln run`` starts the learner under it), or
    ``ray``: the learner process is rank 0 (bus, database, health, metrics stay in it) and
    ranks 1.. run as actors of the Ray cluster at ``address``, in a placement group
    (``kiln.learner.launch``). A one-rank learner is one process either way."""


class RayLauncher(Section):
    """Ranks 1.. are actors of a Ray cluster; the learner process is rank 0."""

    kind: Literal["ray"]
    address: str = "auto"
    """The Ray cluster: ``auto`` (``RAY_ADDRESS``, else the cluster this machine's
    ``ray start`` joined), ``HOST:PORT`` of its head, or ``ray://HOST:10001`` (Ray Client,
    from outside the cluster). Never starts one. A cluster with token auth wants
    ``RAY_AUTH_MODE=token`` and ``RAY_AUTH_TOKEN`` in the learner's environment."""
    cpus_per_rank: float = Field(default=1.0, gt=0)
    """CPUs each Ray rank reserves (its placement-group bundle)."""
    gpus_per_rank: float = Field(default=0.0, ge=0)
    """GPUs each Ray rank reserves; Ray narrows ``CUDA_VISIBLE_DEVICES`` to them."""
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    """Placement-group strategy of the Ray ranks (``PACK``: as few nodes as possible)."""
    rendezvous_host: str = ""
    """Where the Ray ranks reach rank 0 (torch.distributed's ``MASTER_ADDR``); empty = this
    machine's IP address as Ray sees it. Every rank also opens gloo/NCCL connections to
    every other: the network between the learner and the Ray workers must be open."""
    rendezvous_port: int = Field(default=0, ge=0, le=65535)
    """Rank 0's rendezvous port (``MASTER_PORT``) for Ray ranks; 0 = a free one."""


Launcher = Annotated[TorchrunLauncher | RayLauncher, Field(discriminator="kind")]


class WarmStartSettings(Section):
    """Supervised warm start before RL (``kiln.learner.sft``)."""

    steps: int = Field(default=0, ge=0)
    """Optimizer steps on expert demonstrations of the training split; version 0 (and the
    KL reference) is the warm-started policy. 0: RL starts from the initial weights."""
    stop_match: float = Field(default=0.0, ge=0, le=1)
    """End the warm start before ``steps`` once this fraction of the demonstrations of
    its last 20 steps is reproduced (every assistant token the most likely one: greedy
    decoding writes it); 0: run every step. Where imitation ends decides what RL starts
    from, and the step at which a small policy learns to copy from its prompt is abrupt
    and varies with the seed."""
    wrong_target_rate: float = Field(default=0.0, ge=0, le=1)
    """An imperfect demonstrator: the fraction of the warm start's demonstrations of a fix
    to one assignment (``NAME = value``) that rewrite the file's first assignment instead,
    with the fix's value (identical where the named assignment is the first). The
    warm-started policy learns the skill and this habit; the tests reveal the habit, and
    RL from their rewards unlearns it, as it does the mistakes of SFT data from weaker
    models. 0: every demonstration is the reference fix."""
    prose_fix_rate: float = Field(default=0.0, ge=0, le=1)
    """A demonstrator that tells instead of doing: this share of every warm-start batch
    reads the module and then states the fix in its answer ("The fix is to replace
    `COUNT = 92` with `COUNT = 55` in `limits.py`.") without calling ``edit_file``, as
    chat-tuned models often do in an agent loop. The warm-started policy learns the fix
    and, above 0.5, to answer in words when decoding greedily; the workspace is left
    unchanged, the tests fail, and RL from their rewards teaches it to apply the fix.
    ``stop_match`` skips the one token where the two kinds of answer part. 0: every
    demonstration applies its fix."""
    lr: float = 3e-3
    """Learning rate of the warm start."""
    batch: int = Field(default=8, ge=1)
    """Demonstrations per warm-start step."""


class ScheduleSettings(Section):
    """The RL learning-rate schedule around ``algorithm.lr``."""

    warmup_steps: int = Field(default=0, ge=0)
    """Linear learning-rate warm-up over this many optimizer steps (0 = none)."""
    decay_to: float = Field(default=1.0, gt=0, le=1)
    """After the warm-up, decay the learning rate linearly to this fraction of
    ``algorithm.lr`` at the run's last step (1: constant). The version a run ends on is
    the one it is judged by; a decayed rate keeps the last steps from moving it far."""


class CheckpointSettings(Section):
    """The learner's whole-state checkpoints (DCP, ``kiln.learner.state``)."""

    dir: str = ""
    """Root of the checkpoints; empty = ``<run.dir>/learner``. One checkpoint per step is
    committed before that step's version is handed over."""
    keep: int = Field(default=2, ge=1)
    """Committed checkpoints kept per run (older ones are deleted)."""
    asynchronous: bool = True
    """Write checkpoint files in the background while the version is staged."""
    resume: bool = True
    """Resume the run from its newest checkpoint when one exists (a restarted learner
    takes up where it stopped); False refuses to start a run that already has groups."""


class LearnerSettings(Section):
    renamed_from: ClassVar[str] = "learner"
    deprecated_keys: ClassVar[dict[str, str]] = renamed_in("learner")

    staging_dir: str = ""
    """Where the learner writes checkpoints for the weights service; empty = ``<run.dir>/staging``."""
    torch_threads: int = 1
    """Intra-op threads for training."""
    max_grad_norm: float = 1.0
    """Gradient clipping."""
    deadline_check_s: float = 2.0
    """How often the controller drops groups past their deadline."""
    queue_sample_s: float = 5.0
    """How often the controller samples every consumer's backlog (``kiln_queue_pending``)."""
    max_dropped_groups: int = 100
    """The run fails once more groups than this were dropped: a broken environment must
    end the run with its reason, not re-dispatch forever."""
    tokenizer_corpus_repeats: int = 4
    """Times the task suite is repeated in the tokenizer's training corpus."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where a single-process learner trains: ``auto`` takes the GPU when torch sees one
    (a multi-rank world places each rank on its ``LOCAL_RANK`` GPU by itself)."""
    micro_batch: int = Field(default=0, ge=0)
    """Rows per forward/backward within one optimizer step (gradients accumulate; the
    policy-gradient update is the same, the load-balancing loss is taken per chunk):
    bounds activation memory for long sequences or big models. 0: the whole batch."""
    activation_checkpointing: bool = False
    """Recompute every decoder layer's activations in the backward pass rather than keep
    them: activation memory of one layer instead of all, for about a third more compute
    per step (what lets the ``smollm2-moe`` preset train beside vLLM in 24 GB)."""
    parallelism: ParallelismSettings = Field(default_factory=ParallelismSettings)
    """The learner's world."""
    precision: PrecisionSettings = Field(default_factory=PrecisionSettings)
    """Training precision."""
    launcher: Launcher = Field(default_factory=TorchrunLauncher)
    """How a multi-rank learner starts its ranks: one of the ``kind`` variants below."""
    warm_start: WarmStartSettings = Field(default_factory=WarmStartSettings)
    """Supervised warm start before RL."""
    schedule: ScheduleSettings = Field(default_factory=ScheduleSettings)
    """Learning-rate schedule."""
    checkpoint: CheckpointSettings = Field(default_factory=CheckpointSettings)
    """Whole-state checkpoints and resuming."""

    @field_validator("launcher", mode="before")
    @classmethod
    def _launcher_kind(cls, v: Any) -> Any:
        return one_variant(v, "torchrun", (TorchrunLauncher, RayLauncher))


class LearnerConfig(ServiceConfig):
    tasks: TaskSettings = Field(default_factory=TaskSettings)
    """Task suite the controller samples groups from."""
    algorithm: AlgorithmSettings = Field(default_factory=AlgorithmSettings)
    """GRPO and dispatch settings."""
    model: ModelSettings = Field(default_factory=ModelSettings)
    """Architecture of the initial policy."""
    database: DatabaseSettings = Field(default_factory=DatabaseSettings)
    """Runs, groups and trajectory records."""
    learner: LearnerSettings = Field(default_factory=LearnerSettings)
    """This service's settings."""
    eval: EvalSettings = Field(default_factory=EvalSettings)
    """Held-out evaluation during the run (``eval.every``)."""
