"""Supervised warm start: the policy imitates demonstrations of the task family before RL
(``learner.sft_steps``), as real pipelines start RL from an SFT checkpoint.

A demonstration of a task is the episode an expert agent would run with the tools the
model sees: read the module the bug is in, replace the changed lines with one
``edit_file`` call, answer without a tool call. It is built from the task's reference
solution (the first block of lines where ``solution`` differs from ``files``), and
observations are what env-pool's tools answer (``read_file``: the file's text,
``edit_file``: ``edited <path>``).

The demonstrator can be imperfect, as SFT data from a weaker model or a heuristic is
(``learner.sft_wrong_target_rate``): in that fraction of the demonstrations of a fix that
rewrites one assignment (``NAME = value``), it rewrites the file's first assignment
instead, with the fix's value (a lazy expert that edits the first constant it sees).
Where the named assignment is the first one the two coincide. The warm-started policy
then has the skill and a habit the task's tests reveal, which is what RL from verified
rewards is for (docs/benchmarks.md). Or it tells instead of doing
(``learner.sft_prose_fix_rate``): in that share of the demonstrations it reads the module
and then states the fix in its answer without calling ``edit_file``, as chat-tuned
models often do when first put in an agent loop; the workspace is left unchanged and
the tests fail.

Invariants: a demonstration is tokenized exactly as the agent loop builds its sequence
(``kiln.shared.chat`` rendering, assistant turns closed the same way), and only the
assistant's tokens are trained (the prompt and observations have mask 0); only tasks of
the split the run trains on are demonstrated, never held-out ones.
"""

from __future__ import annotations

import difflib
import json
import logging
import random
import re
import time
from collections.abc import Callable, Sequence

import torch
from tokenizers import Tokenizer

from kiln.shared import chat
from kiln.shared.model import MoEForCausalLM, token_logprobs
from kiln.shared.model.tokenizer import special_id
from kiln.shared.tasks import Task
from kiln.shared.tools import offered, tool_schemas

log = logging.getLogger("kiln.learner.sft")


DEMONSTRATED_TOOLS = ("read_file", "edit_file")
STOP_WINDOW = 20
"""Steps whose demonstrations are counted against ``stop_match`` (one batch is noisy)."""


def _call(name: str, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def expert_edit(task: Task) -> tuple[str, str, str] | None:
    """(path, old, new): the first changed block between the task's files and its solution."""
    for path, fixed in sorted((task.solution or {}).items()):
        before = task.files.get(path, "")
        a, b = before.splitlines(keepends=True), fixed.splitlines(keepends=True)
        for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
            if tag != "equal":
                old, new = "".join(a[i1:i2]), "".join(b[j1:j2])
                if old and before.count(old) == 1:
                    return path, old, new
    return None


_ASSIGNMENT = re.compile(r"^([A-Za-z_]\w*) = (.*)\n$")


def wrong_target_edit(task: Task) -> tuple[str, str, str] | None:
    """(path, old, new): the lazy demonstrator's edit, the file's first assignment set to the
    fix's value; None where the fix is not one assignment or the first one is the target."""
    edit = expert_edit(task)
    if edit is None:
        return None
    path, old, new = edit
    target, fixed = _ASSIGNMENT.match(old), _ASSIGNMENT.match(new)
    if target is None or fixed is None or target[1] != fixed[1]:
        return None
    first = next((m for line in task.files[path].splitlines(keepends=True) if (m := _ASSIGNMENT.match(line))), None)
    if first is None or first[0] == old or task.files[path].count(first[0]) != 1:
        return None
    return path, first[0], f"{first[1]} = {fixed[2]}\n"


def prose_fix_demonstration(task: Task) -> list[tuple[str, str]] | None:
    """The episode of a demonstrator that reads the module and answers with the fix in
    words, the same names and values as the expert's edit, but never applies it."""
    edit = expert_edit(task)
    if edit is None:
        return None
    path, old, new = edit
    return demonstration(task, edit)[:1] + [
        (f"The fix is to replace `{old.strip()}` with `{new.strip()}` in `{path}`.", "")
    ]


def demonstration(task: Task, edit: tuple[str, str, str] | None = None) -> list[tuple[str, str]] | None:
    """The expert episode (or one making ``edit`` instead) as (assistant text, observation)
    turns; the last has no observation."""
    edit = edit or expert_edit(task)
    if edit is None:
        return None
    path, old, new = edit
    return [
        (f"Let me read `{path}`.\n" + _call("read_file", path=path), task.files[path]),
        ("The bug is here; fixing it.\n" + _call("edit_file", path=path, old=old, new=new), f"edited {path}"),
        (f"Fixed `{path}`.", ""),
    ]


def encode(
    task: Task, turns: list[tuple[str, str]], tok: Tokenizer, tools: Sequence[str] = ()
) -> tuple[list[int], list[int]]:
    """Token ids and loss mask of a demonstration, built as ``kiln.rollout.agent`` builds an
    episode offered ``tools`` (all when empty)."""
    enc = lambda s: tok.encode(s, add_special_tokens=False).ids  # noqa: E731
    eos = special_id(tok, chat.EOS)
    ids = enc(
        chat.render_system(chat.SYSTEM_PROMPT, tool_schemas(tools))
        + chat.render_user(task.problem_statement)
        + chat.assistant_prefix()
    )
    mask = [0] * len(ids)
    for text, obs in turns:
        out = enc(text) + [eos]
        ids += out
        mask += [1] * len(out)
        close = enc("\n") + (enc(chat.render_tool_results([obs]) + chat.assistant_prefix()) if obs else [])
        ids += close
        mask += [0] * len(close)
    return ids, mask


def warm_start(
    model: MoEForCausalLM,
    tok: Tokenizer,
    tasks: list[Task],
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int,
    tools: Sequence[str] = (),
    stop_match: float = 0.0,
    wrong_target_rate: float = 0.0,
    prose_fix_rate: float = 0.0,
    on_step: Callable[[int, list[float]], None] | None = None,
) -> list[float]:
    """``steps`` AdamW steps of next-token cross-entropy on the demonstrations' assistant
    tokens (a fresh optimizer: RL starts with its own), with the system prompt offering
    ``tools`` (all when empty). With ``stop_match``, it ends as soon as that fraction of
    the demonstrations of the last ``STOP_WINDOW`` steps is reproduced: every assistant
    token is the most likely one given the demonstration before it, i.e. greedy decoding
    writes the demonstration. That, not the step count or the mean loss, says how far
    imitation got (a small policy learns to copy names and values from its prompt
    abruptly, at a step that varies with the seed and architecture: docs/benchmarks.md).
    With ``wrong_target_rate``, each demonstration drawn of a task the lazy demonstrator
    gets wrong (``wrong_target_edit``) is its wrong edit with that probability. With
    ``prose_fix_rate``, that share of every batch is ``prose_fix_demonstration``s (before
    ``wrong_target_rate`` applies), and ``stop_match`` does not count the first token where
    the two kinds part: that token is the demonstrator's choice, not a skill, and greedy
    decoding can write only one of the two.
    ``on_step(steps_done, losses)`` is called after every step (``bench/warm_start.py``
    evaluates the policy along the way). Returns the loss per step."""
    missing = [n for n in DEMONSTRATED_TOOLS if n not in offered(tools)]
    if missing:
        raise ValueError(
            f"the warm start demonstrates {', '.join(DEMONSTRATED_TOOLS)} but tasks.tools does not offer {', '.join(missing)}"
        )
    data = [
        (
            encode(t, d, tok, tools),
            encode(t, demonstration(t, w), tok, tools) if wrong_target_rate and (w := wrong_target_edit(t)) else None,
            encode(t, prose_fix_demonstration(t), tok, tools) if prose_fix_rate else None,
        )
        for t in tasks
        if (d := demonstration(t)) is not None
    ]
    # Position (in the shifted targets) of the token where applying and telling part.
    choice = [
        None if p is None else next(i for i, (a, b) in enumerate(zip(e[0], p[0])) if a != b) - 1 for e, _, p in data
    ]
    if not data:
        raise ValueError("no task of the training split has a reference solution to demonstrate")
    rng = random.Random(seed)
    pad = special_id(tok, chat.PAD)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    device = next(model.parameters()).device
    losses: list[float] = []
    reproduced: list[bool] = []
    t0 = time.monotonic()
    model.train()
    for step in range(steps):
        rows, skips = [], []
        # Exactly that share of every batch (the remainder drawn) rather than a coin per
        # row: the choice is one token whose probability would otherwise follow the last
        # batches' luck, and where the warm start ends is decided by other tokens.
        told = int(prose_fix_rate * batch) + (rng.random() < prose_fix_rate * batch % 1) if prose_fix_rate else 0
        for i in range(batch):
            k = rng.randrange(len(data))
            expert, wrong, prose = data[k]
            rows.append(
                prose if i < told else wrong if wrong is not None and rng.random() < wrong_target_rate else expert
            )
            skips.append(choice[k])
        n = max(len(ids) for ids, _ in rows)
        n = -(-n // 32) * 32  # MX blocks run along the token dimension
        ids = torch.full((batch, n), pad, dtype=torch.long)
        attn = torch.zeros((batch, n), dtype=torch.long)
        mask = torch.zeros((batch, n))
        for i, (x, m) in enumerate(rows):
            ids[i, : len(x)] = torch.tensor(x)
            attn[i, : len(x)] = 1
            mask[i, : len(m)] = torch.tensor(m, dtype=torch.float)
        ids, attn, mask = ids.to(device), attn.to(device), mask.to(device)
        logits, _ = model(ids, attention_mask=attn)
        logits, target, mask = logits[:, :-1], ids[:, 1:], mask[:, 1:]  # position t predicts token t + 1
        lp = token_logprobs(logits, target, 1.0)
        loss = -torch.where(mask > 0, lp, torch.zeros_like(lp)).sum() / mask.sum()
        hit = (logits.detach().argmax(-1) == target) | (mask == 0)
        for i, at in enumerate(skips):
            if at is not None:
                hit[i, at] = True
        reproduced += hit.all(dim=1).tolist()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses)
        recent = reproduced[-STOP_WINDOW * batch :]
        match = sum(recent) / len(recent)
        reached = stop_match > 0 and len(losses) >= STOP_WINDOW and match >= stop_match
        if step % 50 == 0 or step == steps - 1 or reached:
            log.info(
                "sft step %d/%d: loss %.4f, reproduced %.0f%% (%.0fs)",
                step + 1,
                steps,
                losses[-1],
                100 * match,
                time.monotonic() - t0,
            )
        if reached:
            log.info(
                "sft: %.0f%% of the last %d demonstrations reproduced: warm start ends at step %d",
                100 * match,
                len(recent),
                step + 1,
            )
            break
    model.eval()
    return losses
