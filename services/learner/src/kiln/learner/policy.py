"""The trained policy: initialisation, one GRPO optimizer step, checkpoint staging.

A fresh run trains the byte-level BPE tokenizer on the task suite (offline, under a
second), initialises the MoE from ``run.seed`` and stages it as version 0. Every
``train_step`` recomputes the current logprobs of exactly the tokens rollout generated
and applies the configured off-policy-corrected loss of ``grpo.py`` (tokens older than
``max_staleness`` masked out; proximal and reference logprobs computed without grad
only for the variants that need them) plus the MoE load-balancing loss.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kiln.learner.config import LearnerConfig
from kiln.learner.grpo import LossConfig, trained_token_mask
from kiln.learner.parallel import full_state_dict, parallelize, policy_gradient_step
from kiln.learner.precision import apply_precision
from kiln.learner.sft import warm_start
from kiln.learner.state import checkpoint_root
from kiln.learner.world import World
from kiln.shared import chat
from kiln.shared.contracts import Trajectory
from kiln.shared.model import MoEArchitecture, MoEConfig, MoEForCausalLM, save_checkpoint, sequence_logprobs
from kiln.shared.model.checkpoint import load_checkpoint, plain
from kiln.shared.model.tokenizer import load_tokenizer, special_id, train_tokenizer
from kiln.shared.tasks import TaskSuite
from kiln.shared.tools import tool_schemas

log = logging.getLogger("kiln.learner.policy")


def tokenizer_corpus(suite: TaskSuite, repeats: int, tools: list[str] | tuple[str, ...] = ()) -> list[str]:
    texts = [chat.render_system(chat.SYSTEM_PROMPT, tool_schemas(tools))]
    for t in suite.tasks:
        texts.append(chat.render_user(t.problem_statement) + chat.assistant_prefix())
        texts += list(t.files.values()) + list((t.solution or {}).values())
        for path, text in t.files.items():
            texts.append(json.dumps({"name": "read_file", "arguments": {"path": path}}))
            texts.append(chat.render_tool_results([text]))
        texts.append(json.dumps({"name": "run_terminal_cmd", "arguments": {"command": t.test_command}}))
    return texts * repeats


@dataclass
class StepStats:
    loss: float
    aux_loss: float
    tokens: int
    ratio_mean: float
    clip_frac: float
    seconds: float
    stale_tokens: int = 0
    kl: float = 0.0
    tis_capped_frac: float = 0.0
    seq_masked_frac: float = 0.0
    """Trained tokens in sequences ``algorithm.sequence_mask`` rejected (0 when off)."""
    grad_norm: float = 0.0
    lr: float = 0.0


class _Schedule:
    """Learning-rate factor: linear warm-up over ``warmup`` optimizer steps, then constant,
    or with ``decay_to`` < 1 a linear decay to that fraction at step ``total`` (picklable,
    so the scheduler's state round-trips through a checkpoint)."""

    def __init__(self, warmup: int, total: int = 0, decay_to: float = 1.0):
        self.warmup, self.total, self.decay_to = warmup, total, decay_to

    def __call__(self, step: int) -> float:
        if self.warmup and step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        if self.decay_to >= 1.0 or self.total <= self.warmup:
            return 1.0
        done = min(1.0, (step - self.warmup) / max(1, self.total - 1 - self.warmup))
        return 1.0 - (1.0 - self.decay_to) * done


def initial_checkpoint(cfg: LearnerConfig) -> Path:
    """The folder ``model.init_from`` names, built first for ``smollm2-moe``."""
    name = cfg.model.init_from
    if name != "smollm2-moe":
        folder = Path(name).expanduser()
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(
                f"model.init_from = {name!r}: no config.json there (an HF checkpoint folder, or 'smollm2-moe')"
            )
        return folder
    from kiln.shared.model.upcycle import upcycled_smollm2

    dest = Path(cfg.model.cache_dir).expanduser() / f"smollm2-moe-e4k2-s{cfg.run.seed}"
    if not (dest / "config.json").is_file():
        log.info("building %s (SmolLM2-135M-Instruct upcycled to 4 experts)", dest)
        tmp = dest.with_name(dest.name + f".tmp{os.getpid()}")
        upcycled_smollm2(
            tmp, num_experts=4, top_k=2, seed=cfg.run.seed, dense_folder=dest.parent / "smollm2-135m-dense"
        )
        tmp.rename(dest)  # atomic: a concurrent learner sees the whole folder or none
    return dest


class Policy:
    def __init__(self, cfg: LearnerConfig, suite: TaskSuite, world: World | None = None):
        self.cfg = cfg
        self.world = world
        torch.set_num_threads(cfg.learner.torch_threads)
        torch.manual_seed(cfg.run.seed)
        self.init_folder = initial_checkpoint(cfg) if cfg.model.init_from else None
        if self.init_folder is not None:
            self.tokenizer = load_tokenizer(self.init_folder)
            special_id(self.tokenizer, chat.EOS)  # the chat format needs its end-of-turn token
            self.model = load_checkpoint(self.init_folder)
        else:
            self.tokenizer = train_tokenizer(
                tokenizer_corpus(suite, cfg.learner.tokenizer_corpus_repeats, cfg.tasks.tools), cfg.model.vocab_size
            )
            # The settings' architecture is MoEConfig's own; the vocabulary is what BPE reached.
            arch = cfg.model.model_dump(include=set(MoEArchitecture.model_fields))
            self.model = MoEForCausalLM(
                MoEConfig(
                    vocab_size=self.tokenizer.get_vocab_size(),
                    eos_token_id=special_id(self.tokenizer, chat.EOS),
                    **arch,
                )
            ).init_weights(cfg.run.seed)
        lc = cfg.learner
        if world is None:
            want = lc.device if lc.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            self.model.to(want)
        self.model.activation_checkpointing = lc.activation_checkpointing
        if lc.warm_start.steps:
            self.init_folder = self._warm_start(suite)
        self.precision = apply_precision(
            self.model,
            lc.precision.mode,
            kernel=lc.precision.kernel,
            keep_high_precision=tuple(lc.precision.keep_high_precision),
        )
        if world is not None:
            parallelize(self.model, world.meshes, dispatch=lc.parallelism.ep_dispatch)
        a = cfg.algorithm
        # foreach kernels need every parameter on one mesh; a sharded MoE has two.
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=a.lr, weight_decay=a.weight_decay, foreach=False if world is not None else None
        )
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, _Schedule(lc.schedule.warmup_steps, a.steps, lc.schedule.decay_to)
        )
        self._reference: MoEForCausalLM | None = None

    def _warm_start(self, suite: TaskSuite) -> Path:
        """SFT in full precision before the training precision is applied; the result is
        kept as ``<checkpoint root>/sft-init`` so that a resumed learner (and the KL
        reference) starts from the very same policy without training it again."""
        folder = checkpoint_root(self.cfg) / "sft-init"
        if (folder / "config.json").is_file():
            load_checkpoint(folder, self.model)
            log.info("warm start: reusing %s", folder)
            return folder
        ws = self.cfg.learner.warm_start
        losses = warm_start(
            self.model,
            self.tokenizer,
            suite.split(self.cfg.tasks.split),
            steps=ws.steps,
            lr=ws.lr,
            batch=ws.batch,
            seed=self.cfg.run.seed,
            tools=self.cfg.tasks.tools,
            stop_match=ws.stop_match,
            wrong_target_rate=ws.wrong_target_rate,
            prose_fix_rate=ws.prose_fix_rate,
        )
        log.info("warm start: %d steps, loss %.3f -> %.3f", len(losses), losses[0], losses[-1])
        tmp = folder.with_name(f"sft-init.tmp{os.getpid()}")
        save_checkpoint(self.model, tmp, self.tokenizer)
        try:
            os.rename(tmp, folder)  # atomic; another rank of the world may have been first
        except OSError:
            shutil.rmtree(tmp)
        return folder

    def stage(self, folder: Path) -> Path:
        """Write the current policy as an HF folder (rank 0; the followers join the gather)."""
        if self.world is None:
            return save_checkpoint(self.model, folder, self.tokenizer)
        self.world.announce("stage")
        export = MoEForCausalLM(self.model.config)
        export.load_state_dict({k: plain(v) for k, v in self.full_state().items()}, strict=False)
        return save_checkpoint(export, folder, self.tokenizer)

    def loss_config(self) -> LossConfig:
        return LossConfig.of(self.cfg.algorithm)

    def train_step(self, batch: list[tuple[Trajectory, float]], version: int | None = None) -> StepStats:
        """One optimizer step on ``batch`` (trajectory, advantage); ``version`` is the
        policy version being trained (tokens more than ``max_staleness`` older are
        masked out; None trains every generated token). On a multi-rank world this is
        rank 0's call: the batch is announced and every rank trains its rows."""
        a = self.cfg.algorithm
        # A trajectory an external harness split (it rewrote its history) trains each
        # segment as a sequence of its own, every one with the trajectory's advantage.
        rows = [(t, advantage, part) for t, advantage in batch for part in t.sequences()]
        n = max(part.stop - part.start for _, _, part in rows)
        if self.cfg.learner.precision.mode in ("mxfp8", "fp8_rowwise"):
            n = -(-n // 32) * 32  # MX blocks run along the token dimension in the backward
        pad = special_id(self.tokenizer, chat.PAD)
        ids = torch.full((len(rows), n), pad, dtype=torch.long)
        attn = torch.zeros((len(rows), n), dtype=torch.long)
        loss_mask = torch.zeros((len(rows), n), dtype=torch.long)
        versions = torch.full((len(rows), n), -1, dtype=torch.long)
        behaviour = torch.zeros((len(rows), n))
        adv = torch.zeros((len(rows), 1))
        for i, (t, advantage, part) in enumerate(rows):
            k = part.stop - part.start
            ids[i, :k] = torch.tensor(t.token_ids[part])
            attn[i, :k] = 1
            loss_mask[i, :k] = torch.tensor(t.loss_mask[part])
            versions[i, :k] = torch.tensor(t.token_versions[part])
            behaviour[i, :k] = torch.tensor(t.logprobs[part])
            adv[i, 0] = advantage
        mask, stale = trained_token_mask(
            loss_mask, versions, version if version is not None else 0, a.max_staleness if version is not None else None
        )
        tensors = {"ids": ids, "attn": attn, "mask": mask.float(), "behaviour": behaviour, "adv": adv, "stale": stale}
        if self.world is not None:
            if len(rows) < self.world.size:
                raise ValueError(f"a batch of {len(rows)} sequences cannot be split over {self.world.size} ranks")
            self.world.announce("step", tensors)
        return self.step_tensors(tensors)

    def step_tensors(self, t: dict) -> StepStats:
        """The step every rank runs on its rows (``rank::world``) of the batch tensors.
        Each rank's loss is its share of the batch's token-level mean (see
        ``kiln.learner.parallel``), so the update equals the single-process one."""
        t0 = time.monotonic()
        a = self.cfg.algorithm
        rank, size = (self.world.rank, self.world.size) if self.world is not None else (0, 1)
        device = next(self.model.parameters()).device
        rows = {k: v[rank::size].to(device) for k, v in t.items() if isinstance(v, torch.Tensor)}
        global_tokens = float(t["mask"].sum())
        cfg = self.loss_config()
        prox = ref = None
        with torch.no_grad():
            if cfg.loss == "decoupled_ppo":  # the policy this batch starts from
                self.model.eval()
                prox, _ = sequence_logprobs(self.model, rows["ids"], rows["attn"], a.temperature)
            if cfg.kl_coef > 0:
                ref, _ = sequence_logprobs(self.reference(), rows["ids"], rows["attn"], a.temperature)
        out = policy_gradient_step(
            self.model,
            self.optimizer,
            rows,
            global_tokens=global_tokens,
            loss=cfg,
            temperature=a.temperature,
            max_grad_norm=self.cfg.learner.max_grad_norm,
            prox_logp=prox,
            ref_logp=ref,
            micro_batch=self.cfg.learner.micro_batch,
        )
        lr = self.scheduler.get_last_lr()[0]  # the rate this step applied
        self.scheduler.step()
        return StepStats(
            loss=out["loss"],
            aux_loss=out["aux_loss"],
            tokens=int(global_tokens),
            ratio_mean=out["ratio_mean"],
            clip_frac=out["clip_frac"],
            seconds=time.monotonic() - t0,
            stale_tokens=int(t["stale"]),
            kl=out["kl"],
            tis_capped_frac=out["tis_capped_frac"],
            seq_masked_frac=out["seq_masked_frac"],
            grad_norm=out["grad_norm"],
            lr=lr,
        )

    def full_state(self) -> dict[str, torch.Tensor]:
        """Unsharded parameters under the plain model's names (collective on a world)."""
        if self.world is None:
            return {k: plain(v).detach() for k, v in self.model.state_dict().items()}
        return full_state_dict(self.model)

    def reference(self) -> MoEForCausalLM:
        """The frozen initial policy (the KL anchor), rebuilt from the run's seed (or read
        again from ``model.init_from``) in the policy's precision and on its device, so that it is version 0 exactly (the first
        step's KL is 0), after a resume too."""
        if self._reference is None:
            if self.init_folder is not None:
                ref = load_checkpoint(self.init_folder)
            else:
                ref = MoEForCausalLM(self.model.config).init_weights(self.cfg.run.seed)
            lc = self.cfg.learner
            apply_precision(
                ref,
                lc.precision.mode,
                kernel=lc.precision.kernel,
                keep_high_precision=tuple(lc.precision.keep_high_precision),
            )
            ref = ref.to(next(self.model.parameters()).device).eval()
            for p in ref.parameters():
                p.requires_grad_(False)
            self._reference = ref
        return self._reference
