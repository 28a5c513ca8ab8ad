"""Whole-state learner checkpoints (torch.distributed.checkpoint) and resume.

A checkpoint is ``<root>/step-<NNNNNN>/``: a DCP directory (sharded: one file per rank,
written asynchronously where DCP can) holding the model, the optimizer and the LR
scheduler, plus ``meta.json``: step, policy version, the groups that step trained, RNG
states and the data cursor. The RL bookkeeping that the database already holds (groups
dispatched, in flight, dropped) is read back from there on resume, not duplicated.

Invariants:
- ``meta.json`` is written last, after the DCP files are complete, and only a
  directory with one is a checkpoint: a learner killed mid-save resumes from the
  previous one, never from half a state;
- a step's checkpoint is committed before its version is handed over and before its
  groups are marked trained or their messages acked, so every group is trained in
  exactly one step: either the checkpoint has it (resume stamps it trained and ignores
  its redelivered messages) or it does not (its messages are redelivered and it trains
  again in the same step, from the same state);
- resume restores parameters, optimizer moments, scheduler and RNG bit for bit, so a
  resumed run computes the same parameters as an uninterrupted one on the same data.
"""

from __future__ import annotations

import json
import logging
import random
import shutil
import warnings
from concurrent.futures import Future
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from kiln.shared.model.checkpoint import plain

log = logging.getLogger("kiln.learner.state")
# A single-process learner saves without a process group on purpose (``no_dist``); DCP
# still warns about it on every save.
warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)

META = "meta.json"


@dataclass
class Meta:
    step: int
    """Optimizer steps taken; the policy is version ``step``."""
    version: int
    trained_groups: list[str] = field(default_factory=list)
    """Groups the step that produced this state trained (stamped trained on resume)."""
    trained_trajectories: list[str] = field(default_factory=list)
    metrics: dict = field(default_factory=dict)
    """The step's ``StepMetrics`` (JSON): its ``steps`` row, written on resume if the
    learner died between the commit and writing it."""
    torch_rng: list[int] = field(default_factory=list)
    python_rng: list = field(default_factory=list)


def _torch_rng() -> list[int]:
    return torch.get_rng_state().tolist()


def checkpoint_root(cfg) -> Path:
    """Where a run's learner checkpoints live (every rank computes the same path)."""
    ck = cfg.learner.checkpoint
    base = Path(ck.dir) if ck.dir else Path(cfg.run.dir or ".") / "learner"
    return base / cfg.run.id


class Checkpointer:
    """Saves and restores the learner's whole state under one run's checkpoint root."""

    def __init__(self, root: str | Path, keep: int = 2):
        self.root = Path(root)
        self.keep = max(1, keep)
        self._pending: tuple[Future, Path, Meta] | None = None

    def _dir(self, step: int) -> Path:
        return self.root / f"step-{step:06d}"

    def latest(self) -> Meta | None:
        """The newest committed checkpoint's metadata (None for a fresh run)."""
        self.wait()
        if not self.root.is_dir():
            return None
        steps = sorted(p for p in self.root.glob("step-*") if (p / META).is_file())
        if not steps:
            return None
        return Meta(**json.loads((steps[-1] / META).read_text()))

    def save(self, model, optimizer, scheduler, meta: Meta, *, asynchronous: bool = True) -> None:
        """Stage the state and write it; with ``asynchronous`` the files are written in the
        background and committed by the next ``save``/``wait``/``commit`` call."""
        self.wait()
        meta.torch_rng = _torch_rng()
        meta.python_rng = _jsonable(random.getstate())
        msd, osd = get_state_dict(model, optimizer)
        state = _state(model, msd, osd, scheduler)
        target = self._dir(meta.step)
        shutil.rmtree(target, ignore_errors=True)
        if asynchronous:
            # async_save copies the state into staging memory before returning, so the
            # next optimizer step cannot leak into this checkpoint.
            self._pending = (dcp.async_save(state, checkpoint_id=str(target), **_dist()), target, meta)
        else:
            dcp.save(state, checkpoint_id=str(target), **_dist())
            self._commit(target, meta)

    def wait(self) -> None:
        """Block until a background save is on disk, then commit it."""
        if self._pending is None:
            return
        fut, target, meta = self._pending
        self._pending = None
        fut.result()
        self._commit(target, meta)

    def _commit(self, target: Path, meta: Meta) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            tmp = target / (META + ".tmp")
            tmp.write_text(json.dumps(asdict(meta)))
            tmp.replace(target / META)
            for old in sorted(p for p in self.root.glob("step-*") if (p / META).is_file())[: -self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier()
        log.info("checkpoint of step %d committed (%s)", meta.step, target)

    def load(self, model, optimizer, scheduler, meta: Meta) -> None:
        """Restore ``meta``'s checkpoint into the live objects (in place)."""
        msd, osd = get_state_dict(model, optimizer)
        # Loaded in place into the live tensors (under any precision wrapper).
        state = _state(model, msd, osd, scheduler)
        dcp.load(state, checkpoint_id=str(self._dir(meta.step)), **_dist())
        set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)
        if scheduler:
            scheduler.load_state_dict(state["scheduler"])
        torch.set_rng_state(torch.tensor(meta.torch_rng, dtype=torch.uint8))
        random.setstate(_tuple(meta.python_rng))


def _expert_keys(model) -> dict[str, str]:
    """Expert-parallel slices hold different experts under one parameter name on every
    ``ep`` rank; DCP would take them for replicas of one tensor and keep one. Each rank's
    slice gets its own key (``...@ep<rank>``), so every expert is saved and restored by
    the rank that owns it (resuming therefore needs the same ``ep``)."""
    from kiln.learner.parallel import ExpertParallel

    out = {}
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallel):
            rank = m.first_expert // m.local_experts
            for name, _ in m.local.named_parameters():
                fqn = f"{prefix}.local.{name}"
                out[fqn] = f"{fqn}@ep{rank}"
    return out


def _state(model, msd: dict, osd: dict, scheduler) -> dict:
    keys = _expert_keys(model)
    rename = (lambda k: keys.get(k, k)) if keys else (lambda k: k)
    optim = dict(osd)
    if keys:
        optim["state"] = {rename(k): v for k, v in osd.get("state", {}).items()}
        optim["param_groups"] = [{**g, "params": [rename(k) for k in g["params"]]} for g in osd.get("param_groups", [])]
    return {
        "model": _plain({rename(k): v for k, v in msd.items()}),
        "optim": _plain(optim),
        "scheduler": scheduler.state_dict() if scheduler else {},
    }


def _plain(tree):
    """Precision wrappers (torchao's MXFP8 weights) replaced by the tensors they hold, so
    DCP writes and reads plain tensors."""
    if isinstance(tree, dict):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_plain(v) for v in tree]
    return plain(tree) if isinstance(tree, torch.Tensor) else tree


def _dist() -> dict:
    """Every rank writes its own shards in a process group; alone, DCP runs without one."""
    return {"process_group": dist.group.WORLD} if dist.is_initialized() else {"no_dist": True}


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple | list) else x


def _tuple(x):
    return tuple(_tuple(v) for v in x) if isinstance(x, list) else x
