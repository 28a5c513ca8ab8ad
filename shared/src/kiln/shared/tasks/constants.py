"""The ``constants`` suite: a procedurally generated family of configuration fixes.

Each task is a one-module repository of constants (``LIMIT = 7``, ``WIDTH = 30``) with a
unittest file that pins their values; one constant has the wrong value and the problem
statement says which one and what it must be. The fix is derivable from the prompt and
the file alone (no knowledge of Python semantics beyond the edit), so a small policy
trained from scratch can learn it, and a held-out task is the same skill on names,
files and values it has not been trained on: the family the ``tiny`` preset learns.

Invariants: generation is a pure function of ``seed`` (every process that loads the
suite sees the same tasks); every task's bug breaks exactly its ``fail_to_pass`` test
and its ``solution`` passes all tests (checked by running them in
``tests/test_tasks.py``); no (module, constant, old, new) combination is in both splits.
"""

from __future__ import annotations

import random

from kiln.shared.tasks import Task

MODULES = ("config", "settings", "limits", "params", "defaults", "options", "tuning", "sizes")
NAMES = (
    "LIMIT",
    "TIMEOUT",
    "RETRIES",
    "WIDTH",
    "HEIGHT",
    "DEPTH",
    "PORT",
    "SIZE",
    "COUNT",
    "LEVEL",
    "SCALE",
    "OFFSET",
    "BATCH",
    "WORKERS",
    "STEPS",
    "RATE",
)
TRAIN = 480
HELDOUT = 48
SEED = 1234


def generate(train: int = TRAIN, heldout: int = HELDOUT, seed: int = SEED) -> list[Task]:
    rng = random.Random(seed)
    seen: set[tuple] = set()
    tasks = []
    while len(tasks) < train + heldout:
        module = rng.choice(MODULES)
        target, other = rng.sample(NAMES, 2)
        old, new, other_value = rng.sample(range(1, 100), 3)
        key = (module, target, old, new)
        if key in seen:
            continue
        seen.add(key)
        split = "heldout" if len(tasks) >= train else "train"
        tasks.append(_task(len(tasks), split, module, target, old, new, other, other_value))
    return tasks


def _task(index: int, split: str, module: str, target: str, old: int, new: int, other: str, other_value: int) -> Task:
    lines = [f"{target} = {old}\n", f"{other} = {other_value}\n"]
    if index % 2:
        lines.reverse()  # the constant to fix is not always the first line
    source = "".join(lines)
    fixed = source.replace(f"{target} = {old}\n", f"{target} = {new}\n")
    test_file = f"test_{module}.py"
    cls = f"Test{module.capitalize()}"
    tests = (
        f"import unittest\n\nimport {module}\n\n\nclass {cls}(unittest.TestCase):\n"
        f"    def test_{target.lower()}(self):\n        self.assertEqual({module}.{target}, {new})\n\n"
        f"    def test_{other.lower()}(self):\n        self.assertEqual({module}.{other}, {other_value})\n\n"
        "\nif __name__ == '__main__':\n    unittest.main()\n"
    )
    stem = test_file[:-3]
    return Task(
        id=f"const-{index:04d}-{module}-{target.lower()}",
        problem_statement=f"`{target}` in `{module}.py` is {old} but must be {new}. "
        f"Fix `{module}.py` so that the tests in `{test_file}` pass.",
        files={f"{module}.py": source, test_file: tests},
        test_files={test_file: tests},
        test_command=f"python3 -m unittest -v {stem}",
        fail_to_pass=[f"{stem}.{cls}.test_{target.lower()}"],
        pass_to_pass=[f"{stem}.{cls}.test_{other.lower()}"],
        split=split,
        solution={f"{module}.py": fixed},
        timeout_s=30.0,
        metadata={
            "family": "constants",
            "module": f"{module}.py",
            "constant": target,
            "old": old,
            "new": new,
            "target_line": 2 if index % 2 else 1,
        },
    )
