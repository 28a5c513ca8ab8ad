"""Synthesized tasks and their validation (issue 22): AST mutations splice byte-exactly;
``kiln tasks synth`` makes tasks from a real PyPI package (itsdangerous 2.2.0, whose tests
need freezegun: a real uv-built environment) that all validate, with held-out modules
no training task touches, problem statements that never show the changed line, and the
same tasks for the same seed; ``kiln tasks validate`` rejects broken tasks with reasons and
exit code 1, and names an environment that cannot be built."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.shared.tasks import Task, load_suite
from kiln.shared.tasks.mutate import KINDS, mutations, sites

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

SOURCE = '''"""A module."""
import math  # a comment that must survive


def clamp(x, lo=0, hi=10):
    """Docstring stays."""
    if x < lo:  # below
        return lo
    total = x + 1
    total -= 1
    print(f"x={x}")
    while x > hi and hi is not None:
        x = x - 1
    flag = True
    name = "n"
    return total if x in (1, 2) else x * 2


class K:
    def m(self, a):
        b = a // 2   # keep me
        return b == a
'''


def _region(a: str, b: str) -> tuple[int, int, int]:
    """Length of the common prefix and suffix of two texts (bytes), and b's changed length."""
    x, y = a.encode(), b.encode()
    i = 0
    while i < min(len(x), len(y)) and x[i] == y[i]:
        i += 1
    j = 0
    while j < min(len(x), len(y)) - i and x[-1 - j] == y[-1 - j]:
        j += 1
    return i, j, len(y) - i - j


def test_mutations_cover_every_kind_and_keep_the_rest_of_the_file():
    ms = mutations("pkg/mod.py", SOURCE)
    assert {m.kind for m in ms} == set(KINDS)
    descriptions = {m.description for m in ms}
    for d in (
        "comparison Lt -> LtE",
        "comparison In -> NotIn",
        "comparison IsNot -> Is",
        "operator Add -> Sub",
        "operator FloorDiv -> Mult",
        "boolean And -> Or",
        "constant True -> False",
        "constant 'n' -> ''",
        "constant 1 -> 2",
        "condition of if negated",
        "return statement removed",
        "augassign statement removed",
    ):
        assert d in descriptions, d
    for m in ms:
        assert m.original == SOURCE and m.mutated != SOURCE
        ast.parse(m.mutated)
        head, tail, _ = _region(m.original, m.mutated)
        lines = [x.encode() for x in SOURCE.splitlines(keepends=True)]
        src, new = SOURCE.encode(), m.mutated.encode()
        # only the mutated node's text changed: every line before and after it is byte-identical
        if m.kind == "remove":  # exactly the statement's lines are gone
            assert new == b"".join(lines[: m.lineno - 1] + lines[m.end_lineno :]) and m.after == ""
        else:
            assert head >= len(b"".join(lines[: m.lineno - 1])) and tail >= len(b"".join(lines[m.end_lineno :]))
            assert src[head : len(src) - tail].decode() in m.before and new[head : len(new) - tail].decode() in m.after
        assert "# a comment that must survive" in m.mutated
        assert "# keep me" in m.mutated or "# keep me" in m.before  # a removed line goes with its comment
        assert '"""Docstring stays."""' in m.mutated  # docstrings and f-strings are never mutated
        assert 'f"x={x}"' in m.mutated or m.description == "expr statement removed"
    # a mutation is exactly the original with one region replaced
    m = next(m for m in ms if m.description == "operator FloorDiv -> Mult")
    assert m.mutated == SOURCE.replace("b = a // 2   # keep me", "b = a * 2   # keep me")
    m = next(m for m in ms if m.description == "condition of while negated")
    assert "while not (x > hi and hi is not None):" in m.mutated


def test_sites_are_listed_in_file_order_the_same_every_time():
    a = [(s.function, s.kind, s.description) for s in sites("m.py", SOURCE)]
    assert a == [(s.function, s.kind, s.description) for s in sites("m.py", SOURCE)]
    assert {f for f, _, _ in a} == {"clamp", "K.m"}
    assert sites("broken.py", "def (:\n") == []


# -- a real package ---------------------------------------------------------------------------

PACKAGE = "itsdangerous==2.2.0"


def _synth(out: Path, root: Path, seed: int = 0) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "kiln.ops.cli",
        "tasks",
        "synth",
        "--package",
        PACKAGE,
        "--out",
        str(out),
        "--max-per-package",
        "3",
        "--seed",
        str(seed),
        "--root",
        str(root),
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def synthesized(tmp_path_factory) -> tuple[Path, Path, str]:
    root = tmp_path_factory.mktemp("env-cache")
    out = tmp_path_factory.mktemp("synth")
    run = _synth(out, root)
    assert run.returncode == 0, run.stdout + run.stderr
    return out / "suite.toml", root, run.stdout


@needs_bwrap
async def test_synthesized_tasks_validate_and_split_by_module(synthesized):
    from kiln.envpool.environments import EnvironmentCache
    from kiln.ops.tasks_validate import validate_suite

    path, root, log = synthesized
    suite = load_suite(str(path))
    assert len(suite) == 3, log
    (env,) = suite.environments.values()
    assert env.repository.kind == "sdist" and env.python.install_project
    assert "requirements/tests.txt" in env.python.requirements_files  # pulls freezegun, which the host lacks
    verdicts = await validate_suite(suite, EnvironmentCache(root, 10 << 30), jobs=2)
    assert all(v.ok for v in verdicts), "\n".join(v.describe() for v in verdicts)

    splits = {t.split for t in suite.tasks}
    assert splits == {"train", "heldout"}, splits
    held = {t.metadata["module"] for t in suite.tasks if t.split == "heldout"}
    train = {t.metadata["module"] for t in suite.tasks if t.split == "train"}
    assert held and train and not held & train
    for t in suite.tasks:
        assert t.environment == env.name and set(t.files) == set(t.solution) == {t.metadata["path"]}
        assert t.metadata["package"] == "itsdangerous" and t.metadata["version"] == "2.2.0"
        assert t.metadata["mutation"] in KINDS and t.metadata["function"]
        assert t.test_files and all(f.startswith("tests/") for f in t.test_files)
        assert "-rA" in t.test_command and all(f in t.test_command for f in t.test_files)
        assert all(x.split("::")[0] in t.test_files for x in t.fail_to_pass + t.pass_to_pass)
        assert not set(t.fail_to_pass) & set(t.pass_to_pass) and len(t.pass_to_pass) <= 20
        # the bug is one region of one file; the rest is byte-identical
        (rel,) = t.files
        bugged, original = t.files[rel], t.solution[rel]
        head, tail, changed = _region(original, bugged)
        assert 0 < head and changed < 400
        before = original.encode()[head : len(original.encode()) - tail].decode(errors="replace")
        after = bugged.encode()[head : len(bugged.encode()) - tail].decode(errors="replace")
        # the problem statement names failing tests, never the changed code
        assert t.fail_to_pass[0] in t.problem_statement
        changed_lines = [x.strip() for x in original.splitlines()[t.metadata["line"] - 1 :][:1] if len(x.strip()) >= 6]
        for text in (*changed_lines, before.strip(), after.strip()):
            if len(text) >= 6:
                assert text not in t.problem_statement, (t.id, text)


@needs_bwrap
async def test_synthesized_tasks_score_through_env_pool_and_reward(synthesized, nats_server, bus, pg_url, run_dir):
    """Every synthesized task through a real env-pool (its environment's copy-on-write
    sandboxes) and a real reward: the unchanged repository scores 0, the reference
    solution written with the agent's tool scores 1."""
    from harness import score_unchanged_and_solved

    path, root, _ = synthesized
    got, want = await score_unchanged_and_solved(nats_server, bus, pg_url, run_dir, path, root)
    assert len(want) == 2 * 3 and got == want


@needs_bwrap
def test_the_same_seed_makes_the_same_tasks(synthesized, tmp_path):
    path, root, _ = synthesized
    run = _synth(tmp_path / "again", root)
    assert run.returncode == 0, run.stdout + run.stderr
    first = (path.parent / "tasks.jsonl").read_text()
    assert (tmp_path / "again" / "tasks.jsonl").read_text() == first
    assert (tmp_path / "again" / "suite.toml").read_text() == path.read_text()


@needs_bwrap
def test_validate_rejects_broken_tasks_with_reasons(synthesized, tmp_path):
    path, root, _ = synthesized
    suite = load_suite(str(path))
    good = suite.tasks[0]
    rel = next(iter(good.files))
    already_passes = good.model_copy(update={"id": "f2p-already-passes", "fail_to_pass": [good.pass_to_pass[0]]})
    no_fix = good.model_copy(update={"id": "solution-does-not-fix", "solution": {rel: good.files[rel]}})
    host = load_suite("builtin").tasks[0]
    broken_env = Task(
        id="env-broken",
        problem_statement="x",
        files={},
        fail_to_pass=["t"],
        environment="cannot-build",
        test_command="true",
    )
    tasks = [good, already_passes, no_fix, host, broken_env]
    (tmp_path / "tasks.jsonl").write_text("".join(t.model_dump_json() + "\n" for t in tasks))
    envs = [e.model_dump(mode="json") for e in suite.environments.values()]
    (tmp_path / "repo").mkdir()
    envs.append(
        {
            "name": "cannot-build",
            "repository": {"kind": "dir", "path": str(tmp_path / "repo")},
            "setup": ["echo no such luck; exit 3"],
        }
    )
    (tmp_path / "suite.json").write_text(json.dumps({"tasks": "tasks.jsonl", "environments": envs}))
    # a TOML suite, written through the suite writer
    from kiln.shared.environments import EnvironmentSpec
    from kiln.shared.tasks import write_suite_file

    write_suite_file(tmp_path / "suite.toml", "tasks.jsonl", [EnvironmentSpec.model_validate(e) for e in envs])
    cmd = [
        sys.executable,
        "-m",
        "kiln.ops.cli",
        "tasks",
        "validate",
        "--suite",
        str(tmp_path / "suite.toml"),
        "--root",
        str(root),
        "--write-valid",
        str(tmp_path / "valid" / "tasks.jsonl"),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 1, out.stdout + out.stderr
    text = out.stdout
    assert f"ok {good.id}" in text and f"ok {host.id}" in text
    assert "REJECTED f2p-already-passes" in text
    assert f"unchanged: FAIL_TO_PASS test {good.pass_to_pass[0]} passes before the fix (it must fail)" in text
    assert "REJECTED solution-does-not-fix" in text
    assert f"solution: FAIL_TO_PASS test {good.fail_to_pass[0]} is failed with the reference solution" in text
    assert "output tail:" in text
    assert "REJECTED env-broken" in text and "environment 'cannot-build' cannot be built: setup step failed" in text
    assert "no such luck" in text
    assert "5 tasks of" in text and "2 valid, 3 rejected (1 environment failed to build)" in text
    valid = load_suite(str(tmp_path / "valid" / "tasks.toml"))
    assert [t.id for t in valid.tasks] == [good.id, host.id] and set(valid.environments) == {good.environment}

    ok = subprocess.run(cmd[:-2] + ["--task", good.id], capture_output=True, text=True, timeout=600)
    assert ok.returncode == 0 and "1 valid, 0 rejected" in ok.stdout, ok.stdout + ok.stderr


# -- three packages (slow tier) -----------------------------------------------------------------

THREE = ("itsdangerous==2.2.0", "humanize==4.11.0", "python-dateutil==2.9.0.post0")


@pytest.mark.slow
@needs_bwrap
def test_three_packages(tmp_path):
    """The suite docs/tasks.md describes: three packages whose tests need third-party
    modules the host lacks (freezegun; freezegun; six, freezegun and hypothesis)."""
    cmd = [
        sys.executable,
        "-m",
        "kiln.ops.cli",
        "tasks",
        "synth",
        "--out",
        str(tmp_path / "out"),
        "--max-per-package",
        "3",
        "--seed",
        "0",
        "--root",
        str(tmp_path / "envs"),
    ]
    for p in THREE:
        cmd += ["--package", p]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=3000)
    assert run.returncode == 0, run.stdout + run.stderr
    suite = load_suite(str(tmp_path / "out" / "suite.toml"))
    assert len(suite.environments) == 3
    for env in suite.environments:
        tasks = [t for t in suite.tasks if t.environment == env]
        assert tasks, env
        assert {t.split for t in tasks} == {"train", "heldout"}, env
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.ops.cli",
            "tasks",
            "validate",
            "--suite",
            str(tmp_path / "out" / "suite.toml"),
            "--root",
            str(tmp_path / "envs"),
        ],
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert out.returncode == 0, out.stdout
