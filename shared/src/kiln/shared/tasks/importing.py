"""Import public task sets: ``kiln tasks import`` (SWE-bench, SWE-Gym, SWE-smith, R2E-Gym).

Each instance of a public JSONL export becomes a kiln ``Task`` over an environment
(``kiln.shared.environments``) whose repository is a local git repository at the
instance's starting commit; the suite is written as ``OUT/suite.toml`` (``tasks =
"tasks.jsonl"`` and the environments) + ``OUT/tasks.jsonl``, loadable by ``load_suite``.

- ``files``: ``{}`` (SWE-bench, SWE-Gym, R2E-Gym: the repository at the commit is the
  starting point) or the buggy files (SWE-smith: its ``patch`` introduces the bug);
- ``test_files``: post-``test_patch`` contents of the files the test patch touches
  (SWE-bench/SWE-Gym; with an empty or absent test patch the tests are in the repository:
  the files the ids name, at the commit), R2E-Gym's own test files (``r2e_tests/``), the
  clean contents of the files SWE-smith's FAIL_TO_PASS ids name;
- ``solution``: post-gold-patch contents of the files the fix changes;
- ids in kiln's format (``path::test`` for pytest, ``module.Class.test`` for unittest),
  the test command built from the files the ids and the test patch name.

Repositories come from ``--repos DIR`` (``owner__name`` or ``owner/name``, bare or not),
images from ``--images DIR`` (OCI/docker archives named after the image, ``/`` and ``:``
replaced by ``_``); environments are inferred from the repository at the commit as of the
instance's era (``importenv``). An instance that cannot be mapped, or whose own fields
show another format's conventions, is skipped with its reason.
docs/tasks.md ("Importing public sets") has the field mapping of each format.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiln.shared.environments import EnvironmentSpec, GitRepository, HostBase, OciBase, PythonSpec
from kiln.shared.tasks import Task, write_suite
from kiln.shared.tasks.importenv import (
    DEFAULT_INTERPRETER,
    check_era,
    image_archive,
    inferred_python,
    load_env_specs,
    moment,
    override,
    swebench_images,
)
from kiln.shared.tasks.swe import (
    _UNITTEST_ID,
    CONVENTIONS,
    GitRepo,
    PatchDoesNotApply,
    Skip,
    _convert_ids,
    _id_list,
    _text,
    apply_patch,
    find_repository,
    format_mismatch,
    test_command,
)
from kiln.shared.tasks.testdeps import GitTree, is_test_path

__all__ = ["FORMATS", "ImportResult", "Importer", "cmd_import", "load_env_specs", "read_rows", "r2e_parse_log"]

FORMATS = ("swe-bench", "swe-gym", "swe-smith", "r2e-gym")
DEFAULT_TIMEOUT_S = 300.0


@dataclass
class ImportResult:
    tasks: list[Task] = field(default_factory=list)
    environments: list[EnvironmentSpec] = field(default_factory=list)
    skipped: list[tuple[str, str, str]] = field(default_factory=list)
    """(instance id, reason, kind of reason)"""

    def by_reason(self) -> list[tuple[str, int]]:
        """(kind, count) of the skipped instances, most frequent first."""
        counts: dict[str, int] = {}
        for _, _, kind in self.skipped:
            counts[kind] = counts.get(kind, 0) + 1
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))


# -- instances -------------------------------------------------------------------------------


@dataclass
class _Mapped:
    """One instance, before its environment is named."""

    env_key: str
    env: dict[str, Any]
    task: dict[str, Any]


@dataclass
class Importer:
    fmt: str
    repos: Path
    images: Path | None = None
    env_specs: dict[str, dict[str, Any]] = field(default_factory=dict)
    interpreter: str = DEFAULT_INTERPRETER
    image_python: str = "python"
    split: str = "train"
    timeout_s: float = DEFAULT_TIMEOUT_S
    exclude_newer: str = "auto"
    """The environments' resolution cut-off: ``auto`` (the instance's ``created_at``, else
    its commit's date), ``commit``, ``none``, or a date / UTC timestamp for all."""

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown format {self.fmt!r}; one of {', '.join(FORMATS)}")
        check_era(self.exclude_newer)

    def run(self, rows: Iterable[dict[str, Any]]) -> ImportResult:
        result = ImportResult()
        mapped: list[_Mapped] = []
        seen: set[str] = set()
        for n, row in enumerate(rows, 1):
            iid = str(row.get("instance_id") or row.get("docker_image") or f"line {n}")
            if iid in seen:
                result.skipped.append((iid, "duplicate instance_id", "duplicate instance_id"))
                continue
            try:
                if mismatch := format_mismatch(self.fmt, row):
                    raise mismatch
                m = {"swe-smith": self._swe_smith, "r2e-gym": self._r2e_gym}.get(self.fmt, self._swe_bench)(row, iid)
                Task.model_validate({**m.task, "environment": "x"})
            except Skip as e:
                result.skipped.append((iid, str(e), e.kind))
                continue
            except Exception as e:  # noqa: BLE001 - one bad instance must not stop the import
                result.skipped.append((iid, f"{type(e).__name__}: {e}", type(e).__name__))
                continue
            seen.add(iid)
            mapped.append(m)
        # Environments: one per distinct spec; the name is the repository at its commit,
        # with a spec hash only where one repository@commit has several specs.
        specs: dict[str, dict[str, dict[str, Any]]] = {}
        for m in mapped:
            specs.setdefault(m.env_key, {})[_spec_hash(m.env)] = m.env
        names: dict[tuple[str, str], str] = {}
        for key, by_hash in specs.items():
            for h, env in sorted(by_hash.items()):
                name = key if len(by_hash) == 1 else f"{key}-{h[:8]}"
                names[key, h] = name
                result.environments.append(EnvironmentSpec.model_validate({"name": name, **env}))
        for m in mapped:
            result.tasks.append(Task.model_validate({**m.task, "environment": names[m.env_key, _spec_hash(m.env)]}))
        return result

    # -- helpers --

    def _repo(self, names: list[str]) -> GitRepo:
        path = find_repository(self.repos, names)
        if path is None:
            raise Skip(
                f"repository {names[0]!r} not in {self.repos} (looked for {', '.join(dict.fromkeys(n.replace('/', '__') for n in names))})",
                kind="repository not in --repos",
            )
        return GitRepo(path)

    def _commit(self, repo: GitRepo, *revs: str | None) -> str:
        for rev in revs:
            if rev and (full := repo.resolve(rev)):
                return full
        raise Skip(f"commit {next((r for r in revs if r), '?')!r} not found in {repo.path}", kind="commit not found")

    def _env(
        self, repo: GitRepo, commit: str, image: Path | None, python: PythonSpec | None, setup: list[str]
    ) -> dict[str, Any]:
        env: dict[str, Any] = {"repository": GitRepository(url=str(repo.path), commit=commit).model_dump()}
        if image is not None:
            env["base"] = OciBase(archive=str(image)).model_dump()
        else:
            env["base"] = HostBase().model_dump()
            env["python"] = python.model_dump() if python else None
        if setup:
            env["setup"] = setup
        return env

    def _era(self, row: dict[str, Any], repo: GitRepo, commit: str) -> str | None:
        if self.exclude_newer == "none":
            return None
        if self.exclude_newer == "auto" and (when := moment(row.get("created_at"))):
            return when
        if self.exclude_newer in ("auto", "commit"):
            return repo.commit_date(commit)
        return self.exclude_newer

    def _python(
        self, row: dict[str, Any], repo_name: str, repo: GitRepo, commit: str, runner: str
    ) -> tuple[PythonSpec, list[str]]:
        """What the repository at ``commit`` declares for its tests, as of the instance's
        era, with the ``--env-specs`` table of ``repo@version`` or ``repo`` over it."""
        spec, setup, _ = inferred_python(
            GitTree(repo.path, commit), self.interpreter, runner, self._era(row, repo, commit)
        )
        version = str(row.get("version") or "")
        for key in (f"{repo_name}@{version}", repo_name):
            if key in self.env_specs:
                return override(spec, setup, self.env_specs[key])
        return spec, setup

    def _task(
        self,
        iid: str,
        row: dict[str, Any],
        *,
        files,
        test_files,
        solution,
        runner,
        repo_name,
        test_paths,
        f2p,
        p2p,
        dropped,
        image,
        metadata,
    ) -> dict[str, Any]:
        python = self.image_python if image is not None else "python"
        meta = {"instance_id": iid, "repo": repo_name, "format": self.fmt, **metadata}
        if image is not None:
            meta["image"] = str(image)
        if dropped:
            meta["dropped_pass_to_pass"] = dropped
        return {
            "id": iid,
            "problem_statement": str(row.get("problem_statement") or ""),
            "files": files,
            "test_files": test_files,
            "solution": solution or None,
            "test_command": test_command(runner, repo_name, test_paths, f2p + p2p, python),
            "fail_to_pass": f2p,
            "pass_to_pass": p2p,
            "split": self.split,
            "timeout_s": self.timeout_s,
            "metadata": meta,
        }

    # -- SWE-bench and SWE-Gym: gold patch + test patch at base_commit --

    def _swe_bench(self, row: dict[str, Any], iid: str) -> _Mapped:
        repo_name = _required(row, "repo")
        repo = self._repo([repo_name])
        commit = self._commit(repo, _required(row, "base_commit"))
        tree = GitTree(repo.path, commit)
        extra: dict[str, Any] = {}
        tests_after: dict[str, str | None] = {}
        if str(row.get("test_patch") or "").strip():
            try:
                _, tests_after = apply_patch(repo, commit, str(row["test_patch"]), "test_patch")
            except PatchDoesNotApply as e:
                if not e.reversed:
                    raise
                extra["test_patch_already_applied"] = True  # its tests are in the repository at the commit
        try:
            _, gold_after = apply_patch(repo, commit, _required(row, "patch"), "patch")
        except PatchDoesNotApply as e:
            if not e.reversed:
                raise
            raise Skip(
                f"patch (the fix) applies only in reverse at {commit[:12]}: the repository there already has it. "
                f"--format {self.fmt} expects {CONVENTIONS['swe-bench']}: give the commit with the bug as "
                "base_commit (a set whose `patch` introduces the bug into a clean commit is SWE-smith's: "
                "--format swe-smith)",
                kind="format mismatch: patch applies in reverse",
            ) from None
        test_files = {p: t for p, t in tests_after.items() if t is not None}
        f2p_raw = _id_list(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
        p2p_raw = _id_list(row.get("PASS_TO_PASS"), "PASS_TO_PASS")
        runner, f2p, p2p, dropped = _convert_ids(
            f2p_raw, p2p_raw, test_files or _bare_id_sources(tree, f2p_raw + p2p_raw)
        )
        if test_files:
            test_paths = [p for p in test_files if p.endswith(".py") and _is_test_path(p)]
        else:  # no test patch: the tests are in the repository at base_commit, and protected from there
            test_files = _files_of_ids(tree, runner, f2p, p2p)
            test_paths = list(test_files)
            extra["tests_in_repository"] = True
        image = image_archive(self.images, [row.get("image_name"), row.get("docker_image"), *swebench_images(iid)])
        python, setup = self._python(row, repo_name, repo, commit, runner)
        task = self._task(
            iid,
            row,
            files={},
            test_files=test_files,
            runner=runner,
            repo_name=repo_name,
            solution={p: t for p, t in gold_after.items() if t is not None},
            test_paths=test_paths,
            f2p=f2p,
            p2p=p2p,
            dropped=dropped,
            image=image,
            metadata={
                "base_commit": commit,
                "version": str(row.get("version") or ""),
                "environment_setup_commit": row.get("environment_setup_commit") or "",
                **extra,
            },
        )
        return _Mapped(
            f"{repo_name.replace('/', '__')}@{commit[:12]}", self._env(repo, commit, image, python, setup), task
        )

    # -- SWE-smith: the repository is clean, ``patch`` introduces the bug --

    def _swe_smith(self, row: dict[str, Any], iid: str) -> _Mapped:
        raw_repo = _required(row, "repo")  # "swesmith/owner__name.commit8"
        short = raw_repo.split("/", 1)[-1]
        base, _, suffix = short.rpartition(".")
        if not base:
            base, suffix = short, ""
        repo_name = base.replace("__", "/", 1) if "__" in base else base
        repo = self._repo([raw_repo, short, base, repo_name])
        commit = self._commit(repo, row.get("base_commit"), suffix)
        try:
            clean, buggy = apply_patch(repo, commit, _required(row, "patch"), "patch (the bug)")
        except PatchDoesNotApply as e:
            if not e.reversed:
                raise
            raise Skip(
                f"patch (the bug) applies only in reverse at {commit[:12]}: the repository there already holds "
                f"it. --format swe-smith expects {CONVENTIONS['swe-smith']}; a commit that holds the bug with "
                f"`patch` as its fix follows SWE-bench's conventions ({CONVENTIONS['swe-bench']}): "
                "--format swe-bench",
                kind="format mismatch: patch applies in reverse",
            ) from None
        if any(t is None for t in buggy.values()):
            raise Skip("the bug patch deletes or renames a file (task files cannot delete)")
        f2p_raw = _id_list(row.get("FAIL_TO_PASS"), "FAIL_TO_PASS")
        p2p_raw = _id_list(row.get("PASS_TO_PASS"), "PASS_TO_PASS")
        id_paths = sorted({i.split("::", 1)[0] for i in f2p_raw + p2p_raw if "::" in i})
        sources = {p: (repo.read(commit, p) or b"").decode("utf-8", "replace") for p in id_paths}
        runner, f2p, p2p, dropped = _convert_ids(f2p_raw, p2p_raw, sources)
        f2p_files = sorted({i.split("::", 1)[0] for i in f2p if "::" in i})
        test_files = {}
        for p in f2p_files:
            if (data := repo.read(commit, p)) is not None:
                test_files[p] = _text(data, p)
        image = image_archive(self.images, [row.get("image_name"), row.get("docker_image")])
        python, setup = self._python(row, repo_name, repo, commit, runner)
        task = self._task(
            iid,
            row,
            files={p: t for p, t in buggy.items() if t is not None},
            test_files=test_files,
            solution={p: t for p, t in clean.items() if t is not None},
            runner=runner,
            repo_name=repo_name,
            test_paths=f2p_files,
            f2p=f2p,
            p2p=p2p,
            dropped=dropped,
            image=image,
            metadata={
                "base_commit": commit,
                "version": "",
                "swe_smith_repo": raw_repo,
                "image_name": row.get("image_name") or "",
            },
        )
        return _Mapped(f"{base}@{commit[:12]}", self._env(repo, commit, image, python, setup), task)

    # -- R2E-Gym: commit_hash is the fix; its parent the start; tests in r2e_tests/ --

    def _r2e_gym(self, row: dict[str, Any], iid: str) -> _Mapped:
        repo_name = _required(row, "repo_name")
        repo = self._repo([repo_name])
        fix = self._commit(repo, _required(row, "commit_hash"))
        commit = self._commit(repo, f"{fix}^")
        execution = _json_field(row, "execution_result_content")
        names, codes = execution.get("test_file_names") or [], execution.get("test_file_codes") or []
        if not names or len(names) != len(codes):
            raise Skip("execution_result_content has no test_file_names/test_file_codes")
        test_files = {f"r2e_tests/{n}": c for n, c in zip(names, codes)}
        expected = {k.split(" - ")[0]: v for k, v in _json_field(row, "expected_output_json").items()}
        if "old_commit_res_stdout" not in execution:
            raise Skip("execution_result_content has no old_commit_res_stdout (FAIL_TO_PASS cannot be derived)")
        old = r2e_parse_log(execution.get("old_commit_res_stdout") or "")
        f2p_names = sorted(k for k, v in expected.items() if v == "PASSED" and old.get(k) != "PASSED")
        p2p_names = sorted(k for k, v in expected.items() if v == "PASSED" and old.get(k) == "PASSED")
        f2p = [_r2e_id(k, test_files) for k in f2p_names]
        p2p = [_r2e_id(k, test_files) for k in p2p_names]
        runner, f2p, p2p, dropped = _convert_ids(f2p, p2p, test_files)
        solution = {}
        for status, path in repo.changed(commit, fix):
            if status != "D" and not _is_test_path(path):
                data = repo.read(fix, path)
                if data is not None:
                    solution[path] = _text(data, path)
        image = image_archive(self.images, [row.get("docker_image")])
        python, setup = self._python(row, repo_name, repo, commit, runner)
        task = self._task(
            iid,
            row,
            files={},
            test_files=test_files,
            solution=solution,
            runner=runner,
            repo_name=repo_name,
            test_paths=sorted(test_files),
            f2p=f2p,
            p2p=p2p,
            dropped=dropped,
            image=image,
            metadata={
                "base_commit": commit,
                "version": "",
                "commit_hash": fix,
                "docker_image": row.get("docker_image") or "",
            },
        )
        return _Mapped(
            f"{repo_name.replace('/', '__')}@{commit[:12]}", self._env(repo, commit, image, python, setup), task
        )


def r2e_parse_log(log: str) -> dict[str, str]:
    """R2E-Gym's reading of a pytest ``-rA`` log: the short test summary's lines, keyed by
    the id without its file (``Class.test``), as its ``expected_output_json`` is."""
    out: dict[str, str] = {}
    if "short test summary info" not in log:
        return out
    for line in log.split("short test summary info", 1)[1].strip().splitlines():
        for status in ("PASSED", "FAILED", "ERROR"):
            if line.startswith(status + " ") and "::" in line:
                out[".".join(line.split(" ", 1)[1].split("::")[1:]).split(" - ")[0]] = status
                break
    return out


def _r2e_id(name: str, test_files: dict[str, str]) -> str:
    """``Class.test`` -> ``r2e_tests/<file>::Class::test``: the file that defines it."""
    parts = name.split(".")
    func = parts[-1].split("[")[0]
    for path in sorted(test_files):
        src = test_files[path]
        if re.search(rf"^\s*(?:async\s+)?def {re.escape(func)}\s*\(", src, re.M) and all(
            re.search(rf"^\s*class {re.escape(c)}\b", src, re.M) for c in parts[:-1]
        ):
            return f"{path}::{'::'.join(parts)}"
    raise Skip(f"R2E test {name!r}: no test file defines it")


_is_test_path = is_test_path


def _bare_id_sources(tree: GitTree, raw_ids: list[str]) -> dict[str, str]:
    """The repository's test files at the commit, read only when some id is a bare name
    (sympy's ``bin/test`` ids), which only the file defining it can place."""
    if all("::" in i or _UNITTEST_ID.match(i.strip()) for i in raw_ids):
        return {}
    paths = [f for f in tree.files() if f.endswith(".py") and is_test_path(f)]
    return {p: d.decode("utf-8", "replace") for p, d in tree.read_many(paths).items() if d is not None}


def _files_of_ids(tree: GitTree, runner: str, f2p: list[str], p2p: list[str]) -> dict[str, str]:
    """The test files the ids name (pytest's ``path::``, unittest's module), at the commit:
    the files the clean room writes last."""
    files = set(tree.files())
    out: dict[str, str] = {}
    for which, ids in (("FAIL_TO_PASS", f2p), ("PASS_TO_PASS", p2p)):
        for tid in ids:
            if runner == "pytest":
                path = tid.split("::", 1)[0]
                found = path in files
            else:  # module.Class.test: the longest dotted prefix that is a file
                parts = tid.split(".")
                path = next(
                    (
                        p
                        for n in range(len(parts) - 1, 0, -1)
                        for p in ("/".join(parts[:n]) + ".py", "/".join(parts[:n]) + "/__init__.py")
                        if p in files
                    ),
                    "",
                )
                found = bool(path)
            if not found:
                raise Skip(
                    f"{which} test {tid!r} names a file that is not in the repository at {tree.commit[:12]} "
                    "(and there is no test_patch to add it)",
                    kind="test file not in the repository",
                )
            if path not in out:
                out[path] = _text(tree.read(path) or b"", path)
    return out


def _required(row: dict[str, Any], key: str) -> str:
    v = row.get(key)
    if not isinstance(v, str) or not v:
        raise Skip(f"missing field {key!r}")
    return v


def _json_field(row: dict[str, Any], key: str) -> dict[str, Any]:
    v = row.get(key)
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError:
            raise Skip(f"{key} is not JSON") from None
    if not isinstance(v, dict):
        raise Skip(f"missing field {key!r}")
    return v


def _spec_hash(env: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(env, sort_keys=True).encode()).hexdigest()


# -- files -----------------------------------------------------------------------------------


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """A JSONL file (one instance a line) or a JSON list."""
    text = Path(path).read_text()
    if text.lstrip().startswith("["):
        return json.loads(text)
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{n}: not JSON: {e}") from e
    return rows


def cmd_import(a) -> int:
    """``kiln tasks import``: one line per skipped instance, then the summary (imported,
    skipped, skipped by reason) and the next step; exit 1 only when nothing was imported."""
    import sys

    try:
        rows = read_rows(a.file)
        env_specs = load_env_specs(a.env_specs) if a.env_specs else {}
        importer = Importer(
            a.format,
            Path(a.repos),
            Path(a.images) if a.images else None,
            env_specs,
            a.interpreter or DEFAULT_INTERPRETER,
            a.image_python or "python",
            a.split,
            a.timeout_s,
            getattr(a, "exclude_newer", "") or "auto",
        )
    except (OSError, ValueError) as e:
        print(f"kiln tasks import: {e}", file=sys.stderr)
        return 2
    result = importer.run(rows)
    for iid, reason, _ in result.skipped:
        print(f"skipped {iid}: {reason}")
    out = sys.stdout if result.tasks else sys.stderr
    if result.tasks:
        suite = write_suite(result.tasks, result.environments, a.out, "written by kiln tasks import")
        print(
            f"imported {len(result.tasks)} tasks over {len(result.environments)} environments into {suite}; "
            f"skipped {len(result.skipped)}"
        )
    else:
        print(f"imported 0 tasks; skipped {len(result.skipped)}", file=out)
    if result.skipped:
        print("skipped by reason:", file=out)
        for kind, n in result.by_reason():
            print(f"  {n:5d}  {kind}", file=out)
    if result.tasks:
        print(
            f"next: kiln tasks validate --suite {suite}   (each task's tests in its environment: FAIL_TO_PASS "
            "fails unchanged, everything passes with the gold patch, the tests import the repository's own code)"
        )
        return 0
    return 1
