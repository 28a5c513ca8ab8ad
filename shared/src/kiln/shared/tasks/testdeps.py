"""What a repository's tests need, read from the repository itself: the declared test
dependencies (``kiln tasks synth`` and ``kiln tasks import`` build environments from them,
so nobody writes them by hand), the repository's own top-level modules, and the modules
its tests import.

A repository is read through a ``Tree``: a folder (``DirTree``: synth's unpacked sdist) or
one commit of a git repository (``GitTree``: an imported instance's ``base_commit``, read
with ``git cat-file``, no checkout). Nothing is installed or run here.

Where test dependencies come from, the first stage that finds any wins (so a project that
declares them is never second-guessed from its imports):

1. extras named ``test``/``tests``/``testing`` (pyproject, setup.cfg, setup.py), test
   requirements files (``requirements/test*.txt``, ``requirements-test*.txt``,
   ``test-requirements.txt``, ``tests/requirements.txt``, ...), and the first PEP 735
   dependency group of ``test``/``tests``/``testing``/``dev`` (``include-group`` followed);
2. a dev requirements file (``requirements-dev.txt``, ...), else a ``dev`` extra;
3. the ``deps`` of tox's ``[testenv]`` (tox.ini, or setup.cfg's ``[testenv]``);
4. the third-party top-level modules the tests import (``IMPORT_DISTRIBUTIONS`` maps the
   few whose distribution is named differently).
"""

from __future__ import annotations

import configparser
import fnmatch
import re
import subprocess
import sys
import tomllib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Protocol

TEST_EXTRAS = ("test", "tests", "testing")
TEST_GROUPS = (*TEST_EXTRAS, "dev")
TEST_REQUIREMENTS = (
    "requirements/tests.txt",
    "requirements/test.txt",
    "requirements/testing.txt",
    "requirements-tests.txt",
    "requirements-test.txt",
    "requirements_test.txt",
    "test-requirements.txt",
    "test_requirements.txt",
    "tests/requirements.txt",
    "test/requirements.txt",
    "testing/requirements.txt",
)
"""Test requirements files, in order; ``TEST_REQUIREMENT_GLOBS`` adds the variants."""
TEST_REQUIREMENT_GLOBS = ("requirements/test*.txt", "requirements-test*.txt", "requirements_test*.txt")
DEV_REQUIREMENTS = ("requirements-dev.txt", "requirements/dev.txt", "dev-requirements.txt", "requirements_dev.txt")
IMPORT_DISTRIBUTIONS = {
    "yaml": "PyYAML",
    "dateutil": "python-dateutil",
    "attr": "attrs",
    "PIL": "Pillow",
    "sklearn": "scikit-learn",
    "bs4": "beautifulsoup4",
    "Crypto": "pycryptodome",
}
TEST_DIRS = {"test", "tests", "testing"}
_NOT_MODULE_FILES = {"setup.py", "conftest.py", "noxfile.py", "fabfile.py", "versioneer.py"}
_IMPORT = re.compile(r"^\s*(?:import|from)\s+([A-Za-z_]\w*)", re.M)
_IMPORT_LIST = re.compile(r"^\s*import\s+([A-Za-z_][\w.]*(?:\s*,\s*[A-Za-z_][\w.]*)+)", re.M)


class Tree(Protocol):
    def files(self) -> list[str]:
        """Every file's path, relative, ``/``-separated."""

    def read(self, path: str) -> bytes | None:
        """The file's bytes, None when there is no such file."""


class DirTree:
    def __init__(self, root: Path):
        self.root = Path(root)
        self._files: list[str] | None = None

    def files(self) -> list[str]:
        if self._files is None:
            self._files = sorted(
                p.relative_to(self.root).as_posix()
                for p in self.root.rglob("*")
                if p.is_file() and ".git" not in p.relative_to(self.root).parts[:1]
            )
        return self._files

    def read(self, path: str) -> bytes | None:
        p = self.root / path
        return p.read_bytes() if p.is_file() else None


class GitTree:
    """One commit of a git repository (bare or not); files are read lazily, once."""

    def __init__(self, repo: Path, commit: str):
        self.repo, self.commit = Path(repo), commit
        self._files: list[str] | None = None
        self._cache: dict[str, bytes | None] = {}

    def files(self) -> list[str]:
        if self._files is None:
            out = subprocess.run(
                ["git", "-C", str(self.repo), "ls-tree", "-r", "-z", "--name-only", self.commit],
                capture_output=True,
                check=True,
            )
            self._files = sorted(x for x in out.stdout.decode(errors="replace").split("\0") if x)
        return self._files

    def read(self, path: str) -> bytes | None:
        if path not in self._cache:
            self.read_many([path])
        return self._cache[path]

    def read_many(self, paths: Iterable[str]) -> dict[str, bytes | None]:
        """Many files through one ``git cat-file --batch``."""
        want = [p for p in dict.fromkeys(paths) if p not in self._cache]
        if want:
            query = "".join(f"{self.commit}:{p}\n" for p in want).encode()
            out = subprocess.run(
                ["git", "-C", str(self.repo), "cat-file", "--batch"], input=query, capture_output=True, check=True
            ).stdout
            pos = 0
            for p in want:
                end = out.index(b"\n", pos)
                header = out[pos:end].split()
                pos = end + 1
                if len(header) == 3 and header[1] == b"blob":
                    size = int(header[2])
                    self._cache[p] = out[pos : pos + size]
                    pos += size + 1
                else:  # "<query> missing", or not a blob
                    self._cache[p] = None
        return {p: self._cache[p] for p in paths}


def _text(tree: Tree, path: str) -> str | None:
    data = tree.read(path)
    return data.decode("utf-8", "replace") if data is not None else None


def is_test_path(rel: str) -> bool:
    parts = PurePosixPath(rel).parts
    name = parts[-1]
    return (
        bool(set(parts[:-1]) & TEST_DIRS)
        or name.startswith("test_")
        or name.endswith("_test.py")
        or name == "conftest.py"
    )


# -- the project and its declarations ---------------------------------------------------------


def _pyproject(tree: Tree) -> dict:
    raw = _text(tree, "pyproject.toml")
    if raw is None:
        return {}
    try:
        return tomllib.loads(raw)
    except tomllib.TOMLDecodeError:
        return {}


def _setup_cfg(tree: Tree) -> configparser.ConfigParser | None:
    raw = _text(tree, "setup.cfg")
    if raw is None:
        return None
    cp = configparser.ConfigParser(interpolation=None)
    try:
        cp.read_string(raw)
    except configparser.Error:
        return None
    return cp


def is_installable(tree: Tree) -> bool:
    """A project pip can install: a ``pyproject.toml`` with a project, build system or
    poetry table, a ``setup.py``, or a ``setup.cfg`` with ``[metadata]``."""
    py = _pyproject(tree)
    if "project" in py or "build-system" in py or "poetry" in py.get("tool", {}):
        return True
    if tree.read("setup.py") is not None:
        return True
    cp = _setup_cfg(tree)
    return cp is not None and cp.has_section("metadata")


def declared_extras(tree: Tree) -> set[str]:
    """Every extra the project declares (pyproject, poetry, setup.cfg; setup.py's
    ``extras_require`` keys among ``TEST_EXTRAS`` and ``dev``)."""
    py = _pyproject(tree)
    found = set((py.get("project") or {}).get("optional-dependencies") or {})
    found |= set(((py.get("tool") or {}).get("poetry") or {}).get("extras") or {})
    cp = _setup_cfg(tree)
    if cp is not None and cp.has_section("options.extras_require"):
        found |= set(cp.options("options.extras_require"))
    if (setup := _text(tree, "setup.py")) is not None and (
        m := re.search(r"extras_require\s*=\s*\{(.*?)\}", setup, re.S)
    ):
        found |= {e for e in TEST_GROUPS if re.search(rf"['\"]{e}['\"]\s*:", m.group(1))}
    return found


def _group(groups: dict, name: str, seen: frozenset[str] = frozenset()) -> list[str]:
    """A PEP 735 dependency group's requirements, ``include-group`` entries expanded."""
    out: list[str] = []
    for item in groups.get(name) or []:
        if isinstance(item, str):
            out.append(item)
        elif (
            isinstance(item, dict) and isinstance(item.get("include-group"), str) and item["include-group"] not in seen
        ):
            out += _group(groups, item["include-group"], seen | {name})
    return out


def _tox_deps(tree: Tree) -> list[str]:
    """``deps`` of tox's ``[testenv]``: plain requirement lines only (no ``-r``/``-c``
    files, no ``{...}`` substitutions, no factor-conditional lines, no paths)."""
    for path, section in (("tox.ini", "testenv"), ("setup.cfg", "testenv")):
        raw = _text(tree, path)
        if raw is None:
            continue
        cp = configparser.ConfigParser(interpolation=None, strict=False)
        try:
            cp.read_string(raw)
        except configparser.Error:
            continue
        if cp.has_option(section, "deps"):
            deps = []
            for line in cp.get(section, "deps").splitlines():
                line = line.split("#", 1)[0].strip()
                if line and not line.startswith(("-", ".", "/")) and "{" not in line and ":" not in line.split(";")[0]:
                    deps.append(line)
            return deps
    return []


@dataclass
class TestDependencies:
    extras: list[str] = field(default_factory=list)
    requirements_files: list[str] = field(default_factory=list)
    packages: list[str] = field(default_factory=list)
    source: str = ""
    """Where they were found (for messages): ``extras``, ``requirements``, ``group dev``,
    ``tox``, ``imports``, or empty when nothing was found."""

    def describe(self) -> str:
        parts = [f"[{e}]" for e in self.extras] + self.requirements_files + self.packages
        return ", ".join(parts) or "nothing"


def test_dependencies(tree: Tree) -> TestDependencies:
    """What the tests need, as the repository declares it (the module's doc has the order)."""
    files = tree.files()
    extras_declared = declared_extras(tree)
    extras = [e for e in TEST_EXTRAS if e in extras_declared]
    reqs = [r for r in TEST_REQUIREMENTS if tree.read(r) is not None]
    for pattern in TEST_REQUIREMENT_GLOBS:
        reqs += sorted(
            f for f in files if fnmatch.fnmatch(f, pattern) and f.count("/") == pattern.count("/") and f not in reqs
        )
    groups = _pyproject(tree).get("dependency-groups") or {}
    packages: list[str] = []
    group = next((g for g in TEST_GROUPS if g in groups), None)
    if group is not None:
        packages = _group(groups, group)
    if extras or reqs or packages:
        source = ", ".join(
            x
            for x in ("extras" if extras else "", "requirements" if reqs else "", f"group {group}" if packages else "")
            if x
        )
        return TestDependencies(extras, reqs, packages, source)
    if dev := [r for r in DEV_REQUIREMENTS if tree.read(r) is not None][:1]:
        return TestDependencies([], dev, [], "dev requirements")
    if "dev" in extras_declared:
        return TestDependencies(["dev"], [], [], "extra dev")
    if tox := _tox_deps(tree):
        return TestDependencies([], [], tox, "tox")
    if imported := imported_distributions(tree):
        return TestDependencies([], [], imported, "imports")
    return TestDependencies()


# -- modules ------------------------------------------------------------------------------------


def own_modules(tree: Tree) -> set[str]:
    """The repository's own top-level import names: under ``src/`` (a src layout) every
    folder holding Python files and every module; otherwise packages (folders with
    ``__init__.py``) and top-level ``.py`` modules. Never tests, setup scripts or hidden
    folders."""
    names: set[str] = set()
    for f in tree.files():
        parts = PurePosixPath(f).parts
        if not f.endswith(".py"):
            continue
        if parts[0] == "src" and len(parts) > 1:
            parts = parts[1:]
            if len(parts) > 1:
                names.add(parts[0])
                continue
        elif len(parts) > 1:
            if len(parts) == 2 and parts[1] == "__init__.py":
                names.add(parts[0])
            continue
        if parts[0] not in _NOT_MODULE_FILES and not is_test_path(parts[0]):
            names.add(parts[0][:-3])
    return {n for n in names if n.isidentifier() and not n.startswith(".") and n not in TEST_DIRS}


def _top_level_entries(tree: Tree) -> set[str]:
    """Every name at the top of the repository or of ``src/`` (files' stems, folders):
    what a test may import without it being a third-party distribution."""
    names = set()
    for f in tree.files():
        parts = PurePosixPath(f).parts
        if parts[0] == "src" and len(parts) > 1:
            parts = parts[1:]
        names.add(PurePosixPath(parts[0]).stem if len(parts) == 1 else parts[0])
    return names


def imported_names(text: str) -> set[str]:
    """Top-level names a Python source imports (``import a.b``, ``from a import b``,
    ``import a, b``; relative imports are not names)."""
    found = set(_IMPORT.findall(text))
    for m in _IMPORT_LIST.finditer(text):
        found |= {x.strip().split(".")[0] for x in m.group(1).split(",")}
    return found


def imported_distributions(tree: Tree) -> list[str]:
    """Third-party modules the tests import (not stdlib, not the repository's own, not
    pytest), as distribution names."""
    own = _top_level_entries(tree)
    tests = [f for f in tree.files() if f.endswith(".py") and is_test_path(f)]
    own |= {PurePosixPath(f).stem for f in tests}  # helper modules beside the tests
    found: set[str] = set()
    texts = tree.read_many(tests) if isinstance(tree, GitTree) else {f: tree.read(f) for f in tests}
    for data in texts.values():
        if data is not None:
            found |= imported_names(data.decode("utf-8", "replace"))
    third = sorted(
        n
        for n in found
        if n not in sys.stdlib_module_names and n not in own and n not in ("pytest", "_pytest", "__future__")
    )
    return [IMPORT_DISTRIBUTIONS.get(n, n) for n in third]


def tested_modules(tree: Tree, test_sources: Iterable[str]) -> list[str]:
    """The repository's own top-level modules that these test sources import: what must
    resolve to the repository's files, not to an installed copy."""
    own = own_modules(tree)
    found: set[str] = set()
    for text in test_sources:
        found |= imported_names(text)
    return sorted(found & own)
