"""A bug-injection set in SWE-bench's format, as a lab has one, through ``kiln tasks
import`` (issue 36): instances whose tests are already in the repository (empty or absent
``test_patch``), made from a real src-layout package whose test requirements depend on it.

The package is iniconfig 2.3.0 (its sdist ships ``testing/``; pytest depends on iniconfig,
so any environment with pytest from the index holds a copy of the package under test).
The test makes a local bare git mirror from the sdist, injects bugs procedurally
(``kiln.shared.tasks.mutate``, seeded), one parentless commit each, and finds each
instance's FAIL_TO_PASS / PASS_TO_PASS by running the suite itself, independently of kiln's
import and environments (this interpreter's pytest with the mutated checkout's ``src``
first on ``PYTHONPATH``). The instances carry ``created_at`` of the package's era while
their commits are dated now, so the environments must take the era from ``created_at``.

Then: the import writes tasks and environments nobody wrote by hand, every task validates
without ``--env-specs`` (pytest of the era, 8.4.2, not the newest; the tests import the
repository's ``src/iniconfig``), the same instances over an environment that does not
install the project are rejected by name (the tests would import the index's copy), the
set imported with the wrong ``--format`` or with a reversed patch is refused with the
conventions named, and a short ``kiln run`` over the suite records trajectories without
``infra_error``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.ops.cli import main
from kiln.shared.contracts import CaseStatus
from kiln.shared.tasks import load_suite
from kiln.shared.tasks.mutate import sites

REPO = Path(__file__).resolve().parents[1]
NAME, VERSION = "iniconfig", "2.3.0"
ERA = "2025-10-18T21:55:43Z"
"""When iniconfig 2.3.0's sdist was uploaded to PyPI: the instances' created_at."""
ERA_PYTEST = "8.4.2"
"""The newest pytest released before ERA (9.0.0 came on 2025-11-08)."""
TEST_FILE = "testing/test_iniconfig.py"
INSTANCES = 3
CACHE = Path(os.environ.get("KILN_TEST_CACHE", Path.home() / ".cache" / "kiln-tests"))
"""Downloads kept between runs (the sdist, checked against the index's sha256 when fetched)."""

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def git(repo: Path, *args: str, date: str | None = None) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "injector",
        "GIT_AUTHOR_EMAIL": "i@example.org",
        "GIT_COMMITTER_NAME": "injector",
        "GIT_COMMITTER_EMAIL": "i@example.org",
    }
    if date:
        env.update(GIT_AUTHOR_DATE=date, GIT_COMMITTER_DATE=date)
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def cached_sdist(name: str, version: str) -> Path:
    """The sdist from the index once, then from ``CACHE`` (written atomically)."""
    from kiln.envpool.environments.unpack import download_sdist

    folder = CACHE / "sdists" / f"{name}-{version}"
    if found := sorted(folder.glob("*.tar.gz")):
        return found[0]
    partial = folder.with_name(f"{folder.name}.partial-{os.getpid()}")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    download_sdist(name, version, partial)
    try:
        os.rename(partial, folder)
    except OSError:  # another run put it there first
        shutil.rmtree(partial, ignore_errors=True)
    return sorted(folder.glob("*.tar.gz"))[0]


def run_suite(checkout: Path) -> tuple[int, dict[str, CaseStatus]]:
    """The package's tests over ``checkout``, independently of kiln's environments: this
    interpreter's pytest with the checkout's ``src`` first on the path (so pytest's own
    ``import iniconfig`` and the tests' get the checkout's)."""
    env = {**os.environ, "PYTHONPATH": str(checkout / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-rA", "-p", "no:cacheprovider", "-p", "no:xdist", "--color=no", TEST_FILE],
        cwd=checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    statuses = {}
    for line in out.stdout.splitlines():  # -rA's summary, ids with spaces whole (as an exporter writes them)
        for word, status in (("PASSED", CaseStatus.PASSED), ("FAILED", CaseStatus.FAILED), ("ERROR", CaseStatus.ERROR)):
            if line.startswith(word + " ") and "::" in line:
                statuses[line[len(word) + 1 :].split(" - ", 1)[0]] = status
    return out.returncode, statuses


@pytest.fixture(scope="module")
def bugs(tmp_path_factory):
    """The mirror (``repos/pytest-dev__iniconfig.git``) and the JSONL of the instances."""
    from kiln.envpool.environments.unpack import extract_archive

    root = tmp_path_factory.mktemp("injected")
    work = root / "work"
    extract_archive(cached_sdist(NAME, VERSION), work, strip=1)
    git(work, "init", "-q", "-b", "main")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", f"{NAME} {VERSION}", date=ERA)
    clean = git(work, "rev-parse", "HEAD").strip()
    rc, baseline = run_suite(work)
    assert (
        rc == 0
        and f"{TEST_FILE}::test_parse_empty" in baseline
        and f"{TEST_FILE}::test_tokenize[blank line]" in baseline
    ), baseline
    passing = {t for t, s in baseline.items() if s == CaseStatus.PASSED}
    assert (
        str(work / "src" / NAME)
        in subprocess.run(
            [sys.executable, "-c", f"import pytest, {NAME}; print({NAME}.__file__)"],
            cwd=work,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(work / "src")},
        ).stdout
    )  # the check runs the checkout's code

    candidates = [
        s
        for path in ("src/iniconfig/__init__.py", "src/iniconfig/_parse.py")
        for s in sites(path, (work / path).read_text())
    ]
    random.Random(0).shuffle(candidates)
    rows, functions = [], set()
    for site in candidates[:40]:
        m = site.render()
        if m is None or (m.path, m.function) in functions:
            continue
        (work / m.path).write_text(m.mutated)
        rc, got = run_suite(work)
        (work / m.path).write_text(m.original)
        broken = sorted(t for t in passing if got.get(t) in (CaseStatus.FAILED, CaseStatus.ERROR))
        f2p = [t for t in broken if " " not in t]  # an id with a space cannot be named to a runner
        if rc != 1 or not f2p or any(t not in got for t in passing):
            continue  # no test noticed, or a collection error (a broken import, not a bug to fix)
        functions.add((m.path, m.function))
        n = len(rows) + 1
        git(work, "checkout", "-q", "--orphan", f"bug-{n}", clean)
        (work / m.path).write_text(m.mutated)
        git(work, "commit", "-q", "-am", f"inject bug {n}")  # dated now: generation time, not the era
        bug = git(work, "rev-parse", "HEAD").strip()
        assert not git(work, "log", "--format=%P", "-1", bug).strip()  # parentless
        row = {
            "instance_id": f"pytest-dev__iniconfig-{n}",
            "repo": "pytest-dev/iniconfig",
            "base_commit": bug,
            "patch": git(work, "diff", bug, clean, "--", m.path),
            "problem_statement": f"Some of iniconfig's tests fail: {', '.join(f2p[:5])}. Please fix the package.",
            "FAIL_TO_PASS": json.dumps(f2p),
            "PASS_TO_PASS": json.dumps(sorted(passing - set(broken))),
            "created_at": ERA,
            "version": "2.3",
            "hints_text": "",
        }
        if n % 2:
            row["test_patch"] = ""  # odd: an empty test patch; even: none at all
        rows.append(row)
        git(work, "checkout", "-q", "main")
        if len(rows) == INSTANCES:
            break
    assert len(rows) == INSTANCES, f"{len(rows)} bugs from {len(candidates)} sites"
    repos = root / "repos"
    subprocess.run(["git", "clone", "-q", "--mirror", str(work), str(repos / "pytest-dev__iniconfig.git")], check=True)
    return {
        "root": root,
        "repos": repos,
        "rows": rows,
        "clean": clean,
        "test_file": (work / TEST_FILE).read_text(),
        "work": work,
    }


def import_rows(bugs, rows: list[dict], out: Path, *extra: str) -> int:
    src = out.parent / f"{out.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as e:
        main(
            [
                "tasks",
                "import",
                "--format",
                extra[0] if extra else "swe-bench",
                str(src),
                "--repos",
                str(bugs["repos"]),
                "--out",
                str(out),
                *extra[1:],
            ]
        )
    return e.value.code


def validate(suite: Path, root: Path) -> int:
    with pytest.raises(SystemExit) as e:
        main(["tasks", "validate", "--suite", str(suite), "--root", str(root)])
    return e.value.code


@pytest.fixture(scope="module")
def env_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("env-cache")


@needs_bwrap
def test_injected_instances_import_and_validate_without_env_specs(bugs, env_root, tmp_path, capsys):
    out = tmp_path / "suite"
    stranger = {**bugs["rows"][0], "instance_id": "nobody__gone-1", "repo": "nobody/gone"}
    assert import_rows(bugs, [*bugs["rows"], stranger], out) == 0
    printed = capsys.readouterr().out
    assert f"imported {INSTANCES} tasks over {INSTANCES} environments" in printed and "skipped 1" in printed, printed
    assert "skipped by reason:\n      1  repository not in --repos" in printed, printed
    assert f"next: kiln tasks validate --suite {out / 'suite.toml'}" in printed, printed

    suite = load_suite(str(out / "suite.toml"))
    for task, row in zip(suite.tasks, bugs["rows"]):
        env = suite.environments[task.environment]
        assert env.repository.commit == row["base_commit"]
        # nothing written by hand: the repository's own dependency group, as of its era
        assert env.python.install_project and env.python.packages == ["pytest>=8.4.2", "pytest-xdist>=3.8"]
        assert env.python.exclude_newer == ERA  # created_at, not the injected commit's date (today)
        # the tests are in the repository at base_commit: protected from there
        assert task.files == {} and task.test_files == {TEST_FILE: bugs["test_file"]}
        assert task.metadata["tests_in_repository"] is True
        assert task.fail_to_pass == json.loads(row["FAIL_TO_PASS"])
        assert set(task.pass_to_pass) | set(task.metadata.get("dropped_pass_to_pass", [])) == set(
            json.loads(row["PASS_TO_PASS"])
        )
        (path,) = task.solution
        assert task.solution[path] == git(bugs["work"], "show", f"{bugs['clean']}:{path}")

    assert validate(out / "suite.toml", env_root) in (0, 1)  # builds the environments; verdicts: the next test
    capsys.readouterr()
    sites_ = list(env_root.glob("layers/*/opt/kiln/venv/lib/python3*/site-packages"))
    assert len(sites_) == INSTANCES and all((s / f"pytest-{ERA_PYTEST}.dist-info").is_dir() for s in sites_), sites_
    assert not any((s / NAME).exists() for s in sites_)  # no copy of the package beside the editable install
    # the framework's own copy (kiln's runner imports pytest with the workspace on no path)
    assert all((s.parents[2] / "kiln-framework" / NAME / "__init__.py").is_file() for s in sites_)

    # The same instances over a venv that does not install the project: pytest brings
    # iniconfig from the index, and the tests would exercise that copy.
    specs = tmp_path / "specs.toml"
    specs.write_text('["pytest-dev/iniconfig"]\ninstall_project = false\n')
    assert import_rows(bugs, bugs["rows"][:1], tmp_path / "copy", "swe-bench", "--env-specs", str(specs)) == 0
    capsys.readouterr()
    assert validate(tmp_path / "copy" / "suite.toml", env_root) == 1
    printed = capsys.readouterr().out
    assert "REJECTED pytest-dev__iniconfig-1" in printed
    assert (
        "imports: the tests import iniconfig from /opt/kiln/venv/lib/python3.11/site-packages/iniconfig/__init__.py, "
        "not from the repository's files under /workspace"
    ) in printed, printed


@needs_bwrap
def test_every_injected_task_validates(bugs, env_root, tmp_path, capsys):
    out = tmp_path / "suite"
    assert import_rows(bugs, bugs["rows"], out) == 0
    capsys.readouterr()
    code = validate(out / "suite.toml", env_root)
    printed = capsys.readouterr().out
    assert code == 0, printed
    for task in load_suite(str(out / "suite.toml")).tasks:
        assert f"ok {task.id} (" in printed
    assert printed.count("the tests import iniconfig from /workspace/src/iniconfig/__init__.py") == INSTANCES
    assert f"{INSTANCES} valid, 0 rejected" in printed


def test_conventions_that_do_not_fit_the_format_are_named(bugs, tmp_path, capsys):
    """SWE-bench-format instances imported as SWE-smith's (whose ``patch`` introduces the
    bug) are refused with both conventions, not turned into inverted tasks; an instance
    whose base_commit already has its fix is refused as applying in reverse."""
    assert import_rows(bugs, bugs["rows"], tmp_path / "smith", "swe-smith") == 1
    err = capsys.readouterr()
    text = err.out + err.err
    assert text.count("follows swe-bench's conventions") == INSTANCES, text
    assert "use --format swe-bench" in text and "`patch` introduces the bug" in text
    assert f"skipped by reason:\n      {INSTANCES}  format mismatch: looks like swe-bench" in err.err, text

    fixed = {**bugs["rows"][0], "instance_id": "pytest-dev__iniconfig-fixed", "base_commit": bugs["clean"]}
    assert import_rows(bugs, [fixed], tmp_path / "fixed") == 1
    text = "".join(capsys.readouterr())
    assert (
        f"patch (the fix) applies only in reverse at {bugs['clean'][:12]}: the repository there already has it" in text
    )
    assert "format mismatch: patch applies in reverse" in text


@needs_bwrap
@pytest.mark.timeout(600)
def test_a_short_run_over_the_imported_suite(bugs, env_root, tmp_path):
    """``kiln run`` (the smoke preset's services and policy) over the imported suite, its
    environments from the same node cache: every trajectory is scored by the package's
    own tests in its environment, none is an infrastructure error."""
    import psycopg

    from kiln.ops.embedded import PostgresServer

    out = tmp_path / "suite"
    src = tmp_path / "rows.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in bugs["rows"]))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.ops.cli",
            "tasks",
            "import",
            "--format",
            "swe-bench",
            str(src),
            "--repos",
            str(bugs["repos"]),
            "--out",
            str(out),
        ],
        check=True,
        capture_output=True,
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "kiln.ops.cli",
            "run",
            "--config",
            str(REPO / "configs" / "smoke.toml"),
            "--set",
            f"run.root={tmp_path / 'runs'}",
            "--set",
            f"tasks.suite={out / 'suite.toml'}",
            "--set",
            f"envpool.environments.root={env_root}",
            "--set",
            "algorithm.steps=1",
            "--set",
            "algorithm.samples_per_group=2",
            "--set",
            "rollout.max_turns=2",
        ],
        capture_output=True,
        text=True,
        timeout=540,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = [p for p in (tmp_path / "runs").iterdir() if p.is_dir()]
    pg = PostgresServer(run_dir / "db" / "pg").start()
    try:
        with psycopg.connect(pg.url) as conn:
            rows = conn.execute(
                "SELECT task_id, reward, infra_error, failure, test_output FROM trajectories"
            ).fetchall()
    finally:
        pg.stop()
    ids = {r["instance_id"] for r in bugs["rows"]}
    assert rows and all(r[0] in ids for r in rows), rows
    assert all(r[2] is None and r[1] is not None for r in rows), [(r[0], r[2], r[3]) for r in rows]
