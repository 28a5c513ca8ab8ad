"""``kiln tasks import``: public sets (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym) -> a TOML
suite of tasks over git-commit environments (kiln.shared.tasks.importing).

Two small git repositories are made here (a package with bugs, its tests, fix commits);
instances are written in each format's public field names, imported through the CLI
entry, and the suite is loaded back. The imported tasks are also run the way the reward
runs them (the repository at the commit, ``files`` and ``test_files`` written over it,
``test_command``, ``parse_test_report``) without building an environment: unchanged,
FAIL_TO_PASS fails and PASS_TO_PASS passes; with ``solution`` written, all pass.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from kiln.ops.cli import main
from kiln.shared.contracts import CaseStatus
from kiln.shared.environments import GitRepository, HostBase, OciBase
from kiln.shared.tasks import load_suite
from kiln.shared.tasks.importing import r2e_parse_log
from kiln.shared.tasks.report import outcome, parse_test_report
from kiln.shared.tasks.swe import convert_id, patch_paths


def git(repo: Path, *args: str) -> str:
    env = {
        **os.environ,
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env).stdout


def commit_all(repo: Path, msg: str) -> str:
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", msg)
    return git(repo, "rev-parse", "HEAD").strip()


def write(root: Path, files: dict[str, str]) -> None:
    for p, text in files.items():
        (root / p).parent.mkdir(parents=True, exist_ok=True)
        (root / p).write_text(text)


CALC_BUGGY = "def add(a, b):\n    return a - b\n\n\ndef neg(a):\n    return a\n\n\ndef mul(a, b):\n    return a * b\n"
CALC_ADD_FIXED = CALC_BUGGY.replace("a - b", "a + b")
CALC_NEG_FIXED = CALC_BUGGY.replace("    return a\n", "    return -a\n")
TEST_BASE = "from calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n"
TEST_ADD = "from calc import add, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
TEST_NEG = "from calc import neg, mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n\n\ndef test_neg():\n    assert neg(2) == -2\n"
PYPROJECT = (
    '[project]\nname = "calc"\nversion = "0.1"\n[project.optional-dependencies]\ntests = ["pytest"]\n'
    '[build-system]\nrequires = ["setuptools"]\nbuild-backend = "setuptools.build_meta"\n'
)

LIB_BUGGY = "def double(x):\n    return x + 2\n\n\ndef half(x):\n    return x / 2\n"
LIB_FIXED = LIB_BUGGY.replace("x + 2", "x * 2")
LIB_TEST = (
    "import unittest\n\nfrom lib import double, half\n\n\nclass LibTest(unittest.TestCase):\n"
    "    def test_half(self):\n        self.assertEqual(half(4), 2)\n"
)
LIB_TEST_NEW = LIB_TEST + "\n    def test_double(self):\n        self.assertEqual(double(3), 6)\n"

R2E_TEST = (
    "from calc import add, mul\n\n\nclass TestCalc:\n    def test_add(self):\n        assert add(1, 1) == 2\n\n"
    "    def test_mul(self):\n        assert mul(2, 2) == 4\n"
)


def diff(repo: Path, a: str, b: str, *paths: str) -> str:
    return git(repo, "diff", a, b, "--", *paths)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Two repositories under repos/ (one checkout, one bare mirror under owner/name.git),
    an images/ folder, and the commits the instances use."""
    root = tmp_path_factory.mktemp("import")
    repos = root / "repos"
    calc = repos / "acme__calc"
    calc.mkdir(parents=True)
    git(calc, "init", "-q", "-b", "main")
    write(calc, {"pyproject.toml": PYPROJECT, "calc/__init__.py": CALC_BUGGY, "tests/test_calc.py": TEST_BASE})
    base = commit_all(calc, "base")
    write(calc, {"calc/__init__.py": CALC_ADD_FIXED, "tests/test_calc.py": TEST_ADD})
    fix_add = commit_all(calc, "fix add")
    git(calc, "checkout", "-q", "-b", "neg", base)
    write(calc, {"calc/__init__.py": CALC_NEG_FIXED, "tests/test_calc.py": TEST_NEG})
    fix_neg = commit_all(calc, "fix neg")
    git(calc, "checkout", "-q", "main")

    src = root / "lib-src"
    src.mkdir()
    git(src, "init", "-q", "-b", "main")
    write(
        src,
        {
            "setup.py": "from setuptools import setup\nsetup(name='lib', py_modules=['lib'])\n",
            "lib.py": LIB_BUGGY,
            "tests/test_lib.py": LIB_TEST,
        },
    )
    lib_base = commit_all(src, "base")
    write(src, {"lib.py": LIB_FIXED, "tests/test_lib.py": LIB_TEST_NEW})
    lib_fix = commit_all(src, "fix double")
    (repos / "other").mkdir()
    subprocess.run(["git", "clone", "-q", "--bare", str(src), str(repos / "other" / "lib.git")], check=True)

    images = root / "images"
    images.mkdir()
    return {
        "root": root,
        "repos": repos,
        "images": images,
        "calc": calc,
        "src": src,
        "base": base,
        "fix_add": fix_add,
        "fix_neg": fix_neg,
        "lib_base": lib_base,
        "lib_fix": lib_fix,
    }


def swe_bench_rows(w) -> list[dict]:
    calc, src = w["calc"], w["src"]
    add = {
        "repo": "acme/calc",
        "instance_id": "acme__calc-1",
        "base_commit": w["base"],
        "patch": diff(calc, w["base"], w["fix_add"], "calc"),
        "test_patch": diff(calc, w["base"], w["fix_add"], "tests"),
        "problem_statement": "add(a, b) subtracts.",
        "hints_text": "",
        "created_at": "2024-01-01",
        "version": "0.1",
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_add"]),
        "PASS_TO_PASS": json.dumps(["tests/test_calc.py::test_mul"]),
        "environment_setup_commit": w["base"],
    }
    neg = {
        **add,
        "instance_id": "acme__calc-2",
        "problem_statement": "neg(a) returns a.",
        "patch": diff(calc, w["base"], w["fix_neg"], "calc"),
        "test_patch": diff(calc, w["base"], w["fix_neg"], "tests"),
        "FAIL_TO_PASS": json.dumps(["tests/test_calc.py::test_neg"]),
    }
    lib = {
        "repo": "other/lib",
        "instance_id": "other__lib-7",
        "base_commit": w["lib_base"],
        "patch": diff(src, w["lib_base"], w["lib_fix"], "lib.py"),
        "test_patch": diff(src, w["lib_base"], w["lib_fix"], "tests"),
        "problem_statement": "double(x) adds two.",
        "version": "1.0",
        "FAIL_TO_PASS": json.dumps(["test_double (tests.test_lib.LibTest)"]),
        "PASS_TO_PASS": json.dumps(["test_half (tests.test_lib.LibTest)"]),
        "environment_setup_commit": w["lib_base"],
    }
    missing = {**add, "instance_id": "nobody__gone-1", "repo": "nobody/gone"}
    no_commit = {**add, "instance_id": "acme__calc-3", "base_commit": "0123456789" * 4}
    bad_patch = {
        **add,
        "instance_id": "acme__calc-4",
        "patch": add["patch"].replace("-    return a - b", "-    return a ** b"),
    }
    return [add, neg, lib, missing, no_commit, bad_patch]


def run_import(w, fmt: str, rows: list[dict], out: Path, *extra: str) -> int:
    src = out.parent / f"{out.name}.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit) as e:
        main(
            [
                "tasks",
                "import",
                "--format",
                fmt,
                str(src),
                "--repos",
                str(w["repos"]),
                "--images",
                str(w["images"]),
                "--out",
                str(out),
                *extra,
            ]
        )
    return e.value.code


def run_task(task, env, tmp: Path, with_solution: bool) -> dict[str, CaseStatus]:
    """What the reward does, over a plain checkout instead of an environment sandbox: the
    repository at the commit, files and test_files (and the solution) over it, the test
    command with this interpreter (which has pytest) first on PATH."""
    assert isinstance(env.repository, GitRepository)
    work = tmp / f"{task.id}-{int(with_solution)}"
    subprocess.run(["git", "clone", "-q", env.repository.url, str(work)], check=True)
    git(work, "checkout", "-q", env.repository.commit)
    write(work, task.files)
    if with_solution:
        write(work, task.solution)
    write(work, task.test_files)
    bindir = tmp / "bin"
    bindir.mkdir(exist_ok=True)
    if not (bindir / "python").exists():
        (bindir / "python").symlink_to(sys.executable)
    env_vars = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PYTHONPATH": str(work)}
    out = subprocess.run(
        task.test_command, shell=True, cwd=work, capture_output=True, text=True, env=env_vars, timeout=120
    )
    return outcome(parse_test_report(out.stdout + out.stderr), task.fail_to_pass + task.pass_to_pass)


def check_runs(task, env, tmp: Path) -> None:
    before = run_task(task, env, tmp, with_solution=False)
    assert all(before[t] != CaseStatus.PASSED for t in task.fail_to_pass), before
    assert all(before[t] == CaseStatus.PASSED for t in task.pass_to_pass), before
    after = run_task(task, env, tmp, with_solution=True)
    assert all(s == CaseStatus.PASSED for s in after.values()), after


def test_swe_bench_import(world, tmp_path, capsys):
    out = tmp_path / "suite"
    assert run_import(world, "swe-bench", swe_bench_rows(world), out) == 0
    printed = capsys.readouterr().out
    assert "imported 3 tasks over 2 environments" in printed and "skipped 3" in printed
    assert "skipped nobody__gone-1: repository 'nobody/gone' not in" in printed
    assert f"skipped acme__calc-3: commit '{'0123456789' * 4}' not found" in printed
    assert "skipped acme__calc-4: patch does not apply" in printed

    suite = load_suite(str(out / "suite.toml"))
    assert [t.id for t in suite.tasks] == ["acme__calc-1", "acme__calc-2", "other__lib-7"]
    add, neg, lib = suite.tasks
    # one environment per repository@commit: both acme instances share it
    assert add.environment == neg.environment == f"acme__calc@{world['base'][:12]}"
    assert lib.environment == f"other__lib@{world['lib_base'][:12]}"
    env = suite.environments[add.environment]
    assert env.repository == GitRepository(url=str(world["calc"].resolve()), commit=world["base"])
    assert isinstance(env.base, HostBase)
    assert env.python.install_project and env.python.extras == ["tests"] and env.python.packages == ["pytest"]
    lib_env = suite.environments[lib.environment]
    assert lib_env.repository.url == str((world["repos"] / "other" / "lib.git").resolve())
    assert lib_env.python.install_project and lib_env.python.extras == [] and lib_env.python.packages == []

    assert add.files == {} and add.test_files == {"tests/test_calc.py": TEST_ADD}
    assert add.solution == {"calc/__init__.py": CALC_ADD_FIXED}
    assert neg.test_files == {"tests/test_calc.py": TEST_NEG} and neg.solution == {"calc/__init__.py": CALC_NEG_FIXED}
    assert add.fail_to_pass == ["tests/test_calc.py::test_add"] and add.pass_to_pass == ["tests/test_calc.py::test_mul"]
    assert add.test_command == "python -m pytest -rA -p no:cacheprovider tests/test_calc.py"
    assert add.metadata == {
        "instance_id": "acme__calc-1",
        "repo": "acme/calc",
        "format": "swe-bench",
        "base_commit": world["base"],
        "version": "0.1",
        "environment_setup_commit": world["base"],
    }
    assert add.problem_statement == "add(a, b) subtracts."
    # unittest ids converted as report.py reports them
    assert lib.fail_to_pass == ["tests.test_lib.LibTest.test_double"]
    assert lib.pass_to_pass == ["tests.test_lib.LibTest.test_half"]
    assert lib.test_command == "python -m unittest -v tests.test_lib"
    assert lib.solution == {"lib.py": LIB_FIXED}

    for task in (add, neg, lib):
        check_runs(task, suite.environments[task.environment], tmp_path)


def test_env_specs_and_interpreter(world, tmp_path, capsys):
    specs = tmp_path / "specs.toml"
    specs.write_text(
        '["acme/calc@0.1"]\npython = "3.12"\npackages = ["pytest<9"]\nextras = []\n'
        'setup = ["true"]\n\n["other/lib"]\ninstall_project = false\npip_packages = ["six"]\n'
    )
    out = tmp_path / "suite"
    rows = swe_bench_rows(world)[:3]
    assert run_import(world, "swe-bench", rows, out, "--env-specs", str(specs), "--split", "heldout") == 0
    suite = load_suite(str(out / "suite.toml"))
    calc_env = suite.environments[suite.tasks[0].environment]
    assert calc_env.python.interpreter == "python3.12" and calc_env.python.packages == ["pytest<9"]
    assert calc_env.python.install_project and calc_env.setup == ["true"]
    lib_env = suite.environments[suite.tasks[2].environment]
    assert not lib_env.python.install_project and lib_env.python.packages == ["six"]
    assert {t.split for t in suite.tasks} == {"heldout"}

    bad = tmp_path / "bad.toml"
    bad.write_text('["acme/calc"]\npre_install = ["apt-get install x"]\n')
    assert run_import(world, "swe-bench", rows, tmp_path / "x", "--env-specs", str(bad)) == 2
    assert "unknown keys ['pre_install']" in capsys.readouterr().err


def test_nothing_imported_exits_1(world, tmp_path, capsys):
    rows = swe_bench_rows(world)[3:]
    assert run_import(world, "swe-bench", rows, tmp_path / "none") == 1
    assert not (tmp_path / "none").exists()
    assert "imported 0 tasks; skipped 3" in capsys.readouterr().err


def test_swe_gym_lists(world, tmp_path):
    row = swe_bench_rows(world)[0]
    row = {
        **row,
        "instance_id": "acme__calc-gym",
        "FAIL_TO_PASS": json.loads(row["FAIL_TO_PASS"]),
        "PASS_TO_PASS": json.loads(row["PASS_TO_PASS"]),
    }
    assert run_import(world, "swe-gym", [row], tmp_path / "gym") == 0
    (task,) = load_suite(str(tmp_path / "gym" / "suite.toml")).tasks
    assert task.fail_to_pass == ["tests/test_calc.py::test_add"] and task.metadata["format"] == "swe-gym"


def oci_archive(path: Path) -> None:
    """A tiny OCI image layout tar: one layer holding /usr/bin/marker."""
    layer_buf = io.BytesIO()
    with tarfile.open(fileobj=layer_buf, mode="w") as t:
        data = b"marker\n"
        info = tarfile.TarInfo("usr/bin/marker")
        info.size = len(data)
        t.addfile(info, io.BytesIO(data))
    layer = gzip.compress(layer_buf.getvalue())
    config = json.dumps(
        {
            "architecture": "amd64",
            "os": "linux",
            "rootfs": {"type": "layers", "diff_ids": ["sha256:" + hashlib.sha256(layer_buf.getvalue()).hexdigest()]},
        }
    ).encode()

    def desc(media, blob):
        return {"mediaType": media, "digest": "sha256:" + hashlib.sha256(blob).hexdigest(), "size": len(blob)}

    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "config": desc("application/vnd.oci.image.config.v1+json", config),
            "layers": [desc("application/vnd.oci.image.layer.v1.tar+gzip", layer)],
        }
    ).encode()
    index = json.dumps(
        {"schemaVersion": 2, "manifests": [desc("application/vnd.oci.image.manifest.v1+json", manifest)]}
    ).encode()
    with tarfile.open(path, "w") as t:
        for name, blob in [
            ("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'),
            ("index.json", index),
            *((f"blobs/sha256/{hashlib.sha256(b).hexdigest()}", b) for b in (layer, config, manifest)),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            t.addfile(info, io.BytesIO(blob))


def test_swe_smith(world, tmp_path):
    """SWE-smith: the repository is the clean commit, ``patch`` introduces the bug; the
    image archive named after image_name becomes the base."""
    calc, clean = world["calc"], world["fix_add"]
    git(calc, "checkout", "-q", clean)
    write(calc, {"calc/__init__.py": CALC_ADD_FIXED.replace("a + b", "a + b + 1")})
    bug = git(calc, "diff")
    git(calc, "checkout", "-q", "--", ".")
    git(calc, "checkout", "-q", "main")
    image = "jyangballin/swesmith.x86_64.acme_1776_calc.abcd1234"
    oci_archive(world["images"] / (image.replace("/", "_") + ".tar"))
    row = {
        "instance_id": "acme__calc.abcd1234.lm_modify__x1",
        "repo": f"swesmith/acme__calc.{clean[:8]}",
        "patch": bug,
        "FAIL_TO_PASS": ["tests/test_calc.py::test_add"],
        "PASS_TO_PASS": ["tests/test_calc.py::test_mul"],
        "image_name": image,
        "problem_statement": "add is off by one",
    }
    no_image = {**row, "instance_id": "acme__calc.abcd1234.lm_modify__x2", "image_name": "nobody/nothing"}
    out = tmp_path / "smith"
    assert run_import(world, "swe-smith", [row, no_image], out, "--image-python", "/usr/local/bin/python") == 0
    suite = load_suite(str(out / "suite.toml"))
    task, plain = suite.tasks
    env = suite.environments[task.environment]
    assert isinstance(env.base, OciBase) and env.base.archive.endswith("swesmith.x86_64.acme_1776_calc.abcd1234.tar")
    assert env.python is None and env.repository.commit == clean
    # one repository@commit, two specs (image / host + uv): two environments, each named with its spec hash
    assert task.environment.startswith(f"acme__calc@{clean[:12]}-")
    assert task.files == {"calc/__init__.py": CALC_ADD_FIXED.replace("a + b", "a + b + 1")}
    assert task.solution == {"calc/__init__.py": CALC_ADD_FIXED}
    assert task.test_files == {"tests/test_calc.py": TEST_ADD}
    assert task.test_command.startswith("/usr/local/bin/python -m pytest -rA")
    # the instance whose image is not there: host base + a uv python, its own environment
    plain_env = suite.environments[plain.environment]
    assert plain.environment != task.environment and plain.environment.startswith(f"acme__calc@{clean[:12]}-")
    assert isinstance(plain_env.base, HostBase) and plain_env.python.extras == ["tests"]
    assert plain.test_command.startswith("python -m pytest -rA")
    check_runs(plain, plain_env, tmp_path)


def test_r2e_gym(world, tmp_path):
    """R2E-Gym: commit_hash is the fix, its parent the start; tests from
    execution_result_content, FAIL_TO_PASS from its old-commit log and expected_output_json."""
    old_log = (
        "============ short test summary info ============\n"
        "PASSED r2e_tests/test_1.py::TestCalc::test_mul\n"
        "FAILED r2e_tests/test_1.py::TestCalc::test_add - assert 0 == 2\n"
    )
    row = {
        "repo_name": "calc",
        "docker_image": "namanjain12/calc_final:" + world["fix_add"],
        "commit_hash": world["fix_add"],
        "problem_statement": "add subtracts",
        "execution_result_content": json.dumps(
            {"test_file_names": ["test_1.py"], "test_file_codes": [R2E_TEST], "old_commit_res_stdout": old_log}
        ),
        "expected_output_json": json.dumps({"TestCalc.test_add": "PASSED", "TestCalc.test_mul": "PASSED"}),
        "modified_files": ["calc/__init__.py", "tests/test_calc.py"],
    }
    out = tmp_path / "r2e"
    assert run_import(world, "r2e-gym", [row], out) == 0
    (task,) = load_suite(str(out / "suite.toml")).tasks
    env = load_suite(str(out / "suite.toml")).environments[task.environment]
    assert env.repository.commit == world["base"] and task.environment == f"calc@{world['base'][:12]}"
    assert task.id == row["docker_image"]
    assert task.test_files == {"r2e_tests/test_1.py": R2E_TEST}
    assert task.solution == {"calc/__init__.py": CALC_ADD_FIXED}  # the commit's test file is no part of it
    assert task.fail_to_pass == ["r2e_tests/test_1.py::TestCalc::test_add"]
    assert task.pass_to_pass == ["r2e_tests/test_1.py::TestCalc::test_mul"]
    assert task.metadata["commit_hash"] == world["fix_add"]
    check_runs(task, env, tmp_path)


def test_id_and_patch_helpers():
    assert convert_id("tests/a.py::T::test_x[1-2]", {}) == ("pytest", "tests/a.py::T::test_x[1-2]")
    assert convert_id("test_x (mod.Class)", {}) == ("unittest", "mod.Class.test_x")
    assert convert_id("test_x (mod.Class.test_x)\nDoc line", {}) == ("unittest", "mod.Class.test_x")
    # sympy's bin/test ids: a bare name, found in the instance's test files
    assert convert_id(
        "test_sqrt", {"sympy/t/test_a.py": "def test_other():\n    pass\ndef test_sqrt():\n    pass\n"}
    ) == ("pytest", "sympy/t/test_a.py::test_sqrt")
    from kiln.shared.tasks.swe import Skip

    with pytest.raises(Skip, match="defines it"):
        convert_id("test_nowhere", {})
    with pytest.raises(Skip, match="unsupported test id"):
        convert_id("A docstring sentence.", {})
    patch = (
        "diff --git a/x.py b/y.py\nsimilarity index 90%\nrename from x.py\nrename to y.py\n"
        "diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n@@ -0,0 +1 @@\n+--- x\n"
        "diff --git a/old.py b/old.py\ndeleted file mode 100644\n--- a/old.py\n+++ /dev/null\n@@ -1 +0,0 @@\n-x\n"
    )
    assert patch_paths(patch) == [("x.py", "y.py"), (None, "new.py"), ("old.py", None)]
    log = "== short test summary info ==\nPASSED r2e_tests/t.py::C::test_a\nFAILED r2e_tests/t.py::test_b - boom\n"
    assert r2e_parse_log(log) == {"C.test_a": "PASSED", "test_b": "FAILED"}


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_imported_swe_bench_suite_validates(world, tmp_path, capsys):
    """The imported SWE-bench instances validate with `kiln tasks validate` in their real
    environments (a uv venv with the project installed, the repository at its commit):
    FAIL_TO_PASS fails and PASS_TO_PASS passes unchanged; all pass with the gold patch."""
    out = tmp_path / "suite"
    assert run_import(world, "swe-bench", swe_bench_rows(world), out) == 0
    suite = load_suite(str(out / "suite.toml"))
    assert len(suite) == 3 and len(suite.environments) == 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(["tasks", "validate", "--suite", str(out / "suite.toml"), "--root", str(tmp_path / "envs")])
    printed = capsys.readouterr().out
    assert e.value.code == 0, printed
    assert all(t.id in printed for t in suite.tasks), printed
