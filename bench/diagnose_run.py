"""Where a finished run's policy fails and where its RL signal was, from the run's own records.

    .venv/bin/python bench/diagnose_run.py runs/<run> [--by constant] [--versions 0 80]

Reads the run's database (its embedded PostgreSQL folder) and weights store, and prints:

1. how many training groups had 0, 1, ..., n passing samples: a group whose samples all
   pass or all fail has zero advantage everywhere, so it teaches GRPO nothing;
2. the training samples' pass rate and held-out greedy pass per value of a task
   metadata key (``--by``; for the
   ``constants`` family, ``constant`` is the name the agent must copy) at every
   evaluated version;
3. for the versions given (``--versions``), the demonstration of each held-out task
   teacher-forced through that version: the probability of the demonstration's least
   likely assistant token and whether greedy decoding would write it, and the same at
   every position where the demonstration writes the value of the key itself (the
   constant's name), per value of the key. A token the policy gives ~0.1 at T = 1 is
   sampled rarely at the run's temperature, so RL sees few successes that contain it.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path

import torch
from sqlalchemy import create_engine, text

from kiln.learner.config import LearnerConfig
from kiln.learner.sft import demonstration, encode
from kiln.ops.embedded import PostgresServer
from kiln.shared.config import load_config
from kiln.shared.model.checkpoint import load_checkpoint
from kiln.shared.model.tokenizer import load_tokenizer
from kiln.shared.tasks import load_suite


def teacher_forced(folder: Path, tasks, tools, key: str) -> tuple[list, list]:
    """Per task: (task id, p of its least likely demonstration token, greedy writes it,
    that token, the policy's argmax there); and per demonstration position that writes
    the first token of the task's ``metadata[key]``: (task id, p, greedy writes it, the
    argmax there)."""
    model, tok = load_checkpoint(folder).eval(), load_tokenizer(folder)
    weakest, at_key = [], []
    for t in tasks:
        turns = demonstration(t)
        if turns is None:
            continue
        ids, mask = encode(t, turns, tok, tools)
        with torch.no_grad():
            logits, _ = model(torch.tensor([ids]))
        probs = torch.softmax(logits[0].float(), -1)
        pos = [i for i in range(1, len(ids)) if mask[i]]
        p = torch.stack([probs[i - 1, ids[i]] for i in pos])
        i = pos[int(p.argmin())]
        top = int(probs[i - 1].argmax())
        weakest.append(
            (t.id, float(probs[i - 1, ids[i]]), top == ids[i], tok.id_to_token(ids[i]), tok.id_to_token(top))
        )
        value = tok.encode(str(t.metadata.get(key, "")), add_special_tokens=False).ids[:1]
        for i in (i for i in pos if value and ids[i] == value[0]):
            top = int(probs[i - 1].argmax())
            at_key.append((t.id, float(probs[i - 1, ids[i]]), top == ids[i], tok.id_to_token(top)))
    return weakest, at_key


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="the run's folder (<run.root>/<run id>)")
    ap.add_argument("--by", default="constant", help="task metadata key to break results down by")
    ap.add_argument(
        "--versions", type=int, nargs="*", default=[0], help="versions to teacher-force the demonstrations through"
    )
    args = ap.parse_args()
    cfg = load_config(LearnerConfig, args.run / "config.toml")
    suite = load_suite(cfg.tasks.suite)
    tasks = {t.id: t for t in suite.tasks}
    pg = PostgresServer(args.run / "db" / "pg").start()
    try:
        eng = create_engine(pg.url.replace("postgresql://", "postgresql+psycopg://"))
        with eng.connect() as c:
            train = c.execute(
                text(
                    "select group_id, passed, task_id from trajectories where run_id = :r and purpose = 'train' and infra_error is null"
                ),
                {"r": cfg.run.id},
            ).all()
            evals = c.execute(
                text("select task_id, passed, eval_id from trajectories where run_id = :r and purpose = 'eval'"),
                {"r": cfg.run.id},
            ).all()
    finally:
        pg.stop()
    groups: dict[str, list[bool]] = collections.defaultdict(list)
    for gid, passed, _ in train:
        groups[gid].append(passed)
    hist = collections.Counter(sum(v) for v in groups.values())
    print(f"training groups by passing samples ({len(groups)} groups):")
    print("| passing | " + " | ".join(str(k) for k in sorted(hist)) + " |")
    print("|---|" + "---|" * len(hist))
    print("| groups | " + " | ".join(str(hist[k]) for k in sorted(hist)) + " |")
    key = lambda tid: str(tasks[tid].metadata.get(args.by, "?"))  # noqa: E731
    sampled: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for _, passed, tid in train:
        sampled[key(tid)][0] += passed
        sampled[key(tid)][1] += 1
    print(f"\ntraining samples passing, by {args.by}:")
    print(f"| {args.by} | " + " | ".join(sorted(sampled)) + " |")
    print("|---|" + "---|" * len(sampled))
    print(
        "| passing | "
        + " | ".join(f"{sampled[k][0] / sampled[k][1]:.0%} of {sampled[k][1]}" for k in sorted(sampled))
        + " |"
    )
    per: dict[str, dict[int, list[int]]] = collections.defaultdict(lambda: collections.defaultdict(lambda: [0, 0]))
    for tid, passed, eid in evals:
        v = int(eid.rsplit("-v", 1)[1])
        per[key(tid)][v][0] += passed
        per[key(tid)][v][1] += 1
    versions = sorted({v for d in per.values() for v in d})
    print(f"\nheld-out greedy pass by {args.by}, per evaluated version:")
    print(f"| {args.by} | " + " | ".join(f"v{v}" for v in versions) + " |")
    print("|---|" + "---|" * len(versions))
    for k in sorted(per):
        print(f"| {k} | " + " | ".join(f"{per[k][v][0]}/{per[k][v][1]}" for v in versions) + " |")
    store = next(p for p in (args.run / "weights").iterdir() if p.is_dir())
    heldout = suite.split(cfg.eval.split)
    for v in args.versions:
        weakest, at_key = teacher_forced(store / f"v{v:06d}", heldout, cfg.tasks.tools, args.by)
        agg: dict[str, list] = collections.defaultdict(list)
        for tid, p, ok, want, top in weakest:
            agg[key(tid)].append((p, ok, f"{want} / {top}"))
        _table(
            f"version {v}: the least likely token of each held-out demonstration, by {args.by}",
            args.by,
            "tasks",
            "most common token / argmax there",
            agg,
        )
        agg = collections.defaultdict(list)
        for tid, p, ok, top in at_key:
            agg[key(tid)].append((p, ok, top))
        _table(
            f"version {v}: the demonstration positions that write the task's {args.by}",
            args.by,
            "positions",
            "argmax there",
            agg,
        )


def _table(title: str, by: str, unit: str, what: str, agg: dict[str, list]) -> None:
    print(f"\n{title}:")
    print(f"| {by} | {unit} | mean p (T = 1) | greedy writes it | {what} (most common) |")
    print("|---|---|---|---|---|")
    for k in sorted(agg):
        a = agg[k]
        common = collections.Counter(x[2] for x in a).most_common(2)
        print(
            f"| {k} | {len(a)} | {sum(x[0] for x in a) / len(a):.2f} | {sum(x[1] for x in a)}/{len(a)} | "
            + ", ".join(f"{t} ({n})" for t, n in common)
            + " |"
        )


if __name__ == "__main__":
    main()
