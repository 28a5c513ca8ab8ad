"""SWE-style instances' raw material, for ``kiln tasks import`` (``importing.py``): local
git repositories at a commit, unified patches applied in a scratch worktree, and test ids
converted to kiln's format (pytest ``path::test``, unittest ``module.Class.test``, as
``kiln.shared.tasks.report`` parses them).

Every failure is a ``Skip`` with its reason: the importer reports the instance and goes on.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import tempfile
from collections.abc import Iterable
from datetime import UTC
from pathlib import Path
from typing import Any


class Skip(Exception):
    """An instance that cannot be mapped; the message is the reason, ``kind`` the reason
    without what is particular to the instance (the import's summary counts by it)."""

    def __init__(self, reason: str, kind: str | None = None):
        super().__init__(reason)
        self.kind = kind or reason_kind(reason)


def reason_kind(reason: str) -> str:
    """A reason without its particulars: cut at its first ``:`` or `` (``, quoted text,
    commit ids and numbers replaced by ``...``."""
    head = re.split(r": | \(", reason, maxsplit=1)[0]
    head = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "...", head)
    return re.sub(r"\b[0-9a-f]{7,40}\b|\b\d+\b", "...", head).strip()


# -- git -------------------------------------------------------------------------------------


def _git(repo: Path | str, *args: str, input: bytes | None = None, check: bool = True) -> subprocess.CompletedProcess:
    out = subprocess.run(["git", "-C", str(repo), *args], input=input, capture_output=True)
    if check and out.returncode != 0:
        raise Skip(f"git {' '.join(args[:2])} failed: {out.stderr.decode(errors='replace').strip()[-300:]}")
    return out


class GitRepo:
    def __init__(self, path: Path):
        self.path = path

    def resolve(self, rev: str) -> str | None:
        out = _git(self.path, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
        return out.stdout.decode().strip() if out.returncode == 0 else None

    def read(self, commit: str, path: str) -> bytes | None:
        out = _git(self.path, "cat-file", "blob", f"{commit}:{path}", check=False)
        return out.stdout if out.returncode == 0 else None

    def commit_date(self, commit: str) -> str:
        """The commit's committer date, as a UTC timestamp (``2023-01-07T11:08:11Z``)."""
        from datetime import datetime

        out = _git(self.path, "show", "-s", "--format=%ct", commit)
        return datetime.fromtimestamp(int(out.stdout.decode().strip()), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")

    def changed(self, a: str, b: str) -> list[tuple[str, str]]:
        """``(status letter, path)`` of ``git diff --name-status a b`` (renames as delete + add)."""
        out = _git(self.path, "diff", "--name-status", "--no-renames", "-z", a, b).stdout.decode()
        parts = out.split("\0")
        return [(parts[i][0], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]


def find_repository(repos: Path, names: Iterable[str]) -> Path | None:
    """The first of ``DIR/owner__name``, ``DIR/owner/name`` (and ``.git`` variants) that is a
    git repository, for each candidate name."""
    for name in names:
        for cand in (name.replace("/", "__"), name, name.lower().replace("/", "__"), name.lower()):
            for p in (repos / cand, repos / f"{cand}.git"):
                if p.is_dir() and _git(p, "rev-parse", "--git-dir", check=False).returncode == 0:
                    return p.resolve()
    for name in names:  # R2E-Gym names a repository without its owner
        if "/" not in name:
            for p in sorted(
                [
                    *repos.glob(f"*__{name}"),
                    *repos.glob(f"*__{name}.git"),
                    *repos.glob(f"*/{name}"),
                    *repos.glob(f"*/{name}.git"),
                ]
            ):
                if p.is_dir() and _git(p, "rev-parse", "--git-dir", check=False).returncode == 0:
                    return p.resolve()
    return None


# -- patches ---------------------------------------------------------------------------------

_DIFF_GIT = re.compile(r"^diff --git a/(.+) b/(.+)$")


def patch_paths(patch: str) -> list[tuple[str | None, str | None]]:
    """``(old path, new path)`` of each file a git diff touches (None: created / deleted)."""
    files: list[list[str | None]] = []
    in_header = False
    for line in patch.splitlines():
        if line.startswith("diff --git "):
            m = _DIFF_GIT.match(line)
            if not m:
                raise Skip(f"unparsed diff header {line[:120]!r}")
            files.append([m.group(1), m.group(2)])
            in_header = True
        elif line.startswith("@@"):
            in_header = False
        elif in_header and files:
            if line.startswith("GIT binary patch") or (line.startswith("Binary files ") and line.endswith(" differ")):
                raise Skip("binary patch (tasks hold text files only)")
            if line.startswith("new file mode"):
                files[-1][0] = None
            elif line.startswith("deleted file mode"):
                files[-1][1] = None
            elif line.startswith("rename from "):
                files[-1][0] = line[len("rename from ") :]
            elif line.startswith("rename to "):
                files[-1][1] = line[len("rename to ") :]
            elif line.startswith("--- "):
                p = line[4:].rstrip("\t")
                files[-1][0] = None if p == "/dev/null" else p.removeprefix("a/")
            elif line.startswith("+++ "):
                p = line[4:].rstrip("\t")
                files[-1][1] = None if p == "/dev/null" else p.removeprefix("b/")
    if patch.strip() and not files:
        raise Skip("patch is not a git diff (no 'diff --git' header)")
    return [(a, b) for a, b in files]


class PatchDoesNotApply(Skip):
    """``reversed``: the patch does apply in reverse (the commit already has it)."""

    def __init__(self, reason: str, reversed: bool):
        super().__init__(reason, "patch does not apply")
        self.reversed = reversed


def apply_patch(
    repo: GitRepo, commit: str, patch: str, what: str, reverse: bool = False
) -> tuple[dict[str, str | None], dict[str, str | None]]:
    """Apply ``patch`` (in reverse with ``reverse``) to the files it touches at ``commit``;
    ``(before, after)``: path -> text (None where the file does not exist on that side).
    ``PatchDoesNotApply`` says whether it would have applied the other way."""
    paths = patch_paths(patch)
    if reverse:
        paths = [(b, a) for a, b in paths]
    before: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="kiln-import-") as tmp:
        _git(tmp, "init", "-q")
        for old, new in paths:
            for p in (old, new):
                if p is None or p in before:
                    continue
                data = repo.read(commit, p)
                before[p] = _text(data, p) if data is not None else None
                if data is not None:
                    dest = Path(tmp, p)
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    dest.write_bytes(data)
        patch_file = Path(tmp, ".git", "kiln-import.patch")
        patch_file.write_text(patch if patch.endswith("\n") else patch + "\n")
        direction = ["-R"] if reverse else []
        out = _git(tmp, "apply", "--whitespace=nowarn", *direction, str(patch_file), check=False)
        if out.returncode != 0:
            other = _git(tmp, "apply", "--check", *([] if reverse else ["-R"]), str(patch_file), check=False)
            raise PatchDoesNotApply(
                f"{what} does not apply{' in reverse' if reverse else ''} at {commit[:12]}: "
                f"{out.stderr.decode(errors='replace').strip()[-300:]}",
                other.returncode == 0,
            )
        after: dict[str, str | None] = {}
        for old, new in paths:
            if old is not None and old != new:
                after.setdefault(old, None)
            if new is not None:
                f = Path(tmp, new)
                after[new] = _text(f.read_bytes(), new) if f.is_file() else None
    return before, after


def _text(data: bytes, path: str) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise Skip(f"{path} is not UTF-8 text (tasks hold text files only)") from None


# -- test ids --------------------------------------------------------------------------------

_UNITTEST_ID = re.compile(r"^(\w+) \(([\w.]+)\)")
_NAME = re.compile(r"[A-Za-z_]\w*")


def convert_id(raw: str, test_sources: dict[str, str]) -> tuple[str, str]:
    """``(runner, id)`` in kiln's format: pytest ``path::test`` ids stay; unittest's
    ``test_x (module.Class)`` (SWE-bench's Django ids, the pre-3.11 verbose form) becomes
    ``module.Class.test_x``; a bare name (sympy's ``bin/test`` ids) becomes
    ``path::name`` of the test file that defines it."""
    raw = raw.strip()
    if "::" in raw:
        return "pytest", raw
    if m := _UNITTEST_ID.match(raw):
        name, where = m.groups()
        return "unittest", where if where.endswith(f".{name}") else f"{where}.{name}"
    if _NAME.fullmatch(raw):
        pattern = re.compile(rf"^\s*(?:async\s+)?def {re.escape(raw)}\s*\(", re.M)
        for path in sorted(test_sources):
            if path.endswith(".py") and pattern.search(test_sources[path] or ""):
                return "pytest", f"{path}::{raw}"
        raise Skip(f"test id {raw!r}: none of the instance's test files defines it")
    raise Skip(f"unsupported test id format {raw[:80]!r} (pytest path::test and unittest 'test (module.Class)' only)")


def _id_list(value: Any, name: str) -> list[str]:
    if value is None or value == "":
        return []
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise Skip(f"{name} is neither a list nor a JSON-encoded list") from None
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise Skip(f"{name} is not a list of test ids")
    return value


def _convert_ids(
    f2p: list[str], p2p: list[str], test_sources: dict[str, str]
) -> tuple[str, list[str], list[str], list[str]]:
    """(runner, fail_to_pass, pass_to_pass, dropped pass_to_pass): ids with whitespace
    (pytest parameters with spaces) cannot be matched by the report parser; a
    FAIL_TO_PASS one skips the instance, PASS_TO_PASS ones are dropped."""
    runners, out_f, out_p, dropped = set(), [], [], []
    for raw in f2p:
        runner, tid = convert_id(raw, test_sources)
        if re.search(r"\s", tid):
            raise Skip(f"FAIL_TO_PASS id {tid[:80]!r} has whitespace, which the test report parser cannot match")
        runners.add(runner)
        out_f.append(tid)
    for raw in p2p:
        try:
            runner, tid = convert_id(raw, test_sources)
        except Skip:
            dropped.append(raw)
            continue
        if re.search(r"\s", tid):
            dropped.append(raw)
            continue
        runners.add(runner)
        out_p.append(tid)
    if not out_f:
        raise Skip("no FAIL_TO_PASS tests")
    if len(runners) > 1:
        raise Skip("mixes pytest and unittest ids")
    return runners.pop(), list(dict.fromkeys(out_f)), list(dict.fromkeys(out_p)), dropped


def _module(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def test_command(runner: str, repo: str, test_paths: list[str], ids: list[str], python: str = "python") -> str:
    """The verbose test command of an instance: pytest ``-rA`` on the test files, or
    ``unittest -v`` on their modules. Django's instances are skipped (its ``runtests.py``
    is no runner kiln's reward can read: docs/reward.md)."""
    py = shlex.quote(python)
    if runner == "pytest":
        files = dict.fromkeys([*test_paths, *(i.split("::", 1)[0] for i in ids)])
        return f"{py} -m pytest -rA -p no:cacheprovider " + " ".join(shlex.quote(f) for f in files)
    modules = [_module(p) for p in test_paths if p.endswith(".py")]
    if repo.lower() == "django/django":
        # Its tests need runtests.py's settings and setup; kiln scores only through its
        # runner, which reads results from unittest or pytest themselves (docs/reward.md).
        raise Skip("Django's tests/runtests.py is not a runner kiln's reward can take results from")
    if not modules:
        raise Skip("unittest ids but no test file to name its module")
    return f"{py} -m unittest -v " + " ".join(modules)


# -- formats' conventions ------------------------------------------------------------------

CONVENTIONS = {
    "swe-bench": "the repository at `base_commit` holds the bug, `patch` fixes it (applies forwards there) and "
    "`test_patch` adds the tests (empty or absent: the tests are already in the repository)",
    "swe-smith": "the repository at the commit is clean and `patch` introduces the bug (applies forwards there); "
    "`repo` is 'swesmith/owner__name.<commit8>'",
    "r2e-gym": "`commit_hash` is the fix, its parent the start, and the tests come in `execution_result_content`",
}
"""What each format (family: SWE-Gym's is SWE-bench's) means by its fields."""
FAMILY = {"swe-bench": "swe-bench", "swe-gym": "swe-bench", "swe-smith": "swe-smith", "r2e-gym": "r2e-gym"}
_SMITH_REPO = re.compile(r"(?:swesmith/)?[^/\s]+__[^/\s]+\.[0-9a-f]{7,8}")


def shape_of(row: dict[str, Any]) -> tuple[str, str] | None:
    """(format family, the evidence) when the instance's own fields say which format's
    conventions it follows; None when they do not tell."""
    repo = row.get("repo")
    if "execution_result_content" in row or ("repo_name" in row and "commit_hash" in row and "repo" not in row):
        return "r2e-gym", "it has R2E-Gym's execution_result_content / repo_name and commit_hash"
    if isinstance(repo, str) and (repo.startswith("swesmith/") or _SMITH_REPO.fullmatch(repo)):
        return "swe-smith", f"repo {repo!r} is SWE-smith's 'swesmith/owner__name.<commit8>'"
    for key in ("test_patch", "environment_setup_commit"):
        if key in row:
            return "swe-bench", f"it has SWE-bench's {key!r} field"
    if isinstance(repo, str) and re.fullmatch(r"[^/\s]+/[^/\s]+", repo) and "__" not in repo and row.get("base_commit"):
        return (
            "swe-bench",
            f"repo {repo!r} with a base_commit is SWE-bench's (SWE-smith's is 'swesmith/owner__name.<commit8>')",
        )
    return None


def format_mismatch(fmt: str, row: dict[str, Any]) -> Skip | None:
    """A ``Skip`` naming both conventions when the instance follows another format's than
    ``fmt`` (importing it as ``fmt`` would make tasks whose tests contradict them)."""
    shape = shape_of(row)
    if shape is None or shape[0] == FAMILY[fmt]:
        return None
    family, evidence = shape
    return Skip(
        f"this instance follows {family}'s conventions ({evidence}), not {fmt}'s. In {fmt}'s, "
        f"{CONVENTIONS[FAMILY[fmt]]}; in {family}'s, {CONVENTIONS[family]}. Imported as {fmt} its tasks "
        f"would be inverted or broken: use --format {family}",
        kind=f"format mismatch: looks like {family}",
    )
