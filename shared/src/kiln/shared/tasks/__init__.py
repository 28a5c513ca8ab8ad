"""Coding tasks: the documented task format and the suite loader (docs/tasks.md).

A task is a small repository with a problem, SWE-bench style:

- ``files``: the repository the agent starts from (path -> text);
- ``test_files``: tests written over the workspace right before scoring, so an agent
  that edits the tests cannot change its own score;
- ``test_command``: runs the tests verbosely (unittest ``-v`` format, or pytest ``-rA``);
- ``fail_to_pass``: test ids that fail on ``files`` and must pass after the fix;
- ``pass_to_pass``: test ids that pass on ``files`` and must still pass;
- ``protected``/``protected_touch``: more protected paths, and whether touching one
  costs the reward (docs/reward.md);
- ``solution``: optional reference contents of the files a correct fix changes
  (used to validate the task and to build demonstrations).

- ``environment``: optional name of an environment the suite declares
  (``kiln.shared.environments``: a base system, a uv-built virtualenv and the
  repository at its commit); the task's ``files`` are then written over that repository
  (a synthesized bug, an instance's own state), and its tests run with that
  environment's interpreter and packages.

A suite is a JSONL file (one task per line), a directory of task folders
(``<id>/task.toml``, ``<id>/repo/``, ``<id>/tests/``, optional ``<id>/solution/``), a
TOML suite file (``tasks = "tasks.jsonl"`` and ``[[environments]]``), or ``builtin``
(the JSONL shipped in this package), or ``constants`` (a procedurally generated family of
configuration fixes: ``kiln.shared.tasks.constants``). A directory suite declares its
environments in ``environments.toml``. Every environment a task names must be declared.
"""

from __future__ import annotations

import json
import os
import tomllib
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiln.shared.environments import EnvironmentSpec, parse_environments

BUILTIN = Path(__file__).parent / "builtin.jsonl"


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    problem_statement: str
    files: dict[str, str]
    test_files: dict[str, str] = Field(default_factory=dict)
    test_command: str = "python3 -m unittest -v"
    fail_to_pass: list[str]
    pass_to_pass: list[str] = Field(default_factory=list)
    split: str = "train"
    solution: dict[str, str] | None = None
    timeout_s: float = 60.0
    metadata: dict = Field(default_factory=dict)
    environment: str | None = None
    protected: list[str] = Field(default_factory=list)
    """Glob patterns of more paths the agent's changes never reach the tests through,
    beside the test files, their folders and the test configuration (``protect.py``)."""
    protected_touch: Literal["revert", "fail"] = "revert"
    """What touching a protected path costs: ``revert`` puts it back and records it;
    ``fail`` also scores the trajectory 0 (failure ``protected``)."""

    @field_validator("files", "test_files", "solution")
    @classmethod
    def _relative_paths(cls, v):
        for path in v or {}:
            p = Path(path)
            if p.is_absolute() or ".." in p.parts or not path.strip():
                raise ValueError(f"task file path {path!r} must be relative and stay inside the repository")
        return v

    @field_validator("fail_to_pass")
    @classmethod
    def _has_target(cls, v):
        if not v:
            raise ValueError("a task needs at least one FAIL_TO_PASS test")
        return v


class TaskSuite:
    def __init__(self, tasks: list[Task], source: str, environments: list[EnvironmentSpec] = ()):
        self.source = source
        self.tasks = tasks
        self.environments = {e.name: e for e in environments}
        self._by_id = {}
        for t in tasks:
            if t.id in self._by_id:
                raise ValueError(f"duplicate task id {t.id!r} in {source}")
            if t.environment and t.environment not in self.environments:
                raise ValueError(f"task {t.id!r} names environment {t.environment!r}, which {source} does not declare")
            self._by_id[t.id] = t

    def get(self, task_id: str) -> Task:
        try:
            return self._by_id[task_id]
        except KeyError:
            raise KeyError(f"task {task_id!r} is not in suite {self.source}") from None

    def split(self, name: str) -> list[Task]:
        tasks = [t for t in self.tasks if t.split == name]
        if not tasks:
            raise ValueError(f"suite {self.source} has no tasks in split {name!r}")
        return tasks

    def __len__(self) -> int:
        return len(self.tasks)


def load_suite(spec: str) -> TaskSuite:
    """``builtin``, ``constants``, a ``.jsonl`` file, or a directory of task folders."""
    if spec == "constants":
        return _constants()
    return _load(str(BUILTIN) if spec == "builtin" else str(Path(spec).resolve()))


@lru_cache(maxsize=1)
def _constants() -> TaskSuite:
    from kiln.shared.tasks.constants import generate

    return TaskSuite(generate(), "constants")


@lru_cache(maxsize=8)
def _load(path: str) -> TaskSuite:
    p = Path(path)
    if p.is_dir():
        envs = p / "environments.toml"
        environments = parse_environments(tomllib.loads(envs.read_text()), p) if envs.is_file() else []
        return TaskSuite(
            [_load_dir_task(d) for d in sorted(p.iterdir()) if (d / "task.toml").exists()], path, environments
        )
    if not p.is_file():
        raise FileNotFoundError(f"task suite not found: {path}")
    if p.suffix == ".toml":
        manifest = tomllib.loads(p.read_text())
        if "tasks" not in manifest:
            raise ValueError(f'{path}: a TOML suite names its tasks file (tasks = "tasks.jsonl")')
        return TaskSuite(
            _read_jsonl((p.parent / manifest["tasks"]).resolve()), path, parse_environments(manifest, p.parent)
        )
    return TaskSuite(_read_jsonl(p), path)


def _read_jsonl(p: Path) -> list[Task]:
    path = str(p)
    tasks = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(Task.model_validate(json.loads(line)))
            except Exception as e:
                raise ValueError(f"{path}:{n}: invalid task: {e}") from e
    return tasks


def _read_tree(root: Path) -> dict[str, str]:
    if not root.is_dir():
        return {}
    return {str(f.relative_to(root)): f.read_text() for f in sorted(root.rglob("*")) if f.is_file()}


def _load_dir_task(d: Path) -> Task:
    meta = tomllib.loads((d / "task.toml").read_text())
    meta.setdefault("id", d.name)
    meta["files"] = _read_tree(d / "repo")
    meta["test_files"] = _read_tree(d / "tests")
    if (d / "solution").is_dir():
        meta["solution"] = _read_tree(d / "solution")
    return Task.model_validate(meta)


def _toml(v) -> str:
    """A value as inline TOML (``render_toml`` writes no arrays of tables)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False).replace("\x7f", "\\u007f")
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"no TOML for {v!r}")


def write_suite_file(path: str | Path, tasks_file: str, environments: list[EnvironmentSpec], comment: str = "") -> Path:
    """A TOML suite file naming ``tasks_file`` (beside it) and declaring ``environments``."""
    lines = [f"# {comment}"] if comment else []
    lines += [f"tasks = {json.dumps(tasks_file)}", ""]
    for env in environments:
        lines.append("[[environments]]")
        for k, v in env.model_dump(mode="json").items():
            if v is not None and v != []:
                lines.append(f"{k} = {_toml(v)}")
        lines.append("")
    Path(path).write_text("\n".join(lines))
    return Path(path)


def write_suite(tasks: list[Task], environments: list[EnvironmentSpec], out: str | Path, comment: str = "") -> Path:
    """A TOML suite: ``OUT/suite.toml`` (``tasks = "tasks.jsonl"`` and the
    ``[[environments]]``) and ``OUT/tasks.jsonl``; returns the suite file."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "tasks.jsonl.partial"
    with open(tmp, "w") as f:
        for t in tasks:
            f.write(t.model_dump_json() + "\n")
    os.replace(tmp, out / "tasks.jsonl")
    return write_suite_file(out / "suite.toml", "tasks.jsonl", environments, comment)
