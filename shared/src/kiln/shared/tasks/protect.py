"""Protected paths: what of a trajectory's changes never reaches the clean room.

A task's tests are the judge, so the judge's files stay the task's:

- its test files, and, for each, the whole test directory it lives in: the topmost
  ancestor named like a test folder (``test``, ``tests``, ``testing``, ``test_*``,
  ``*_tests``); a test file beside the code (a repository root, a package) protects
  the test modules of its folder (``test_*.py``, ``*_test.py``) instead of the folder;
- test configuration anywhere in the repository: ``conftest.py`` and ``pytest.ini``
  always; ``pyproject.toml`` (``[tool.pytest...]``), ``setup.cfg`` (``[tool:pytest]``)
  and ``tox.ini`` (``[pytest]``) when the change touches those sections;
- whatever the task marks protected (``Task.protected``: glob patterns);
- everything under a protected path, and a path whose ancestor is one.

``plan`` splits a ``WorkspaceDiff`` into what the clean room applies and what it
reverts (the paths are recorded in the score). Nothing that is not text reaches the
clean room (links, binaries, modes, files left out of the diff for size): those are
listed as ``not_reproduced``, so a link cannot point a test file anywhere and a file
the diff could not carry cannot fill the quota.
"""

from __future__ import annotations

import configparser
import fnmatch
import tomllib
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from kiln.shared.contracts import WorkspaceDiff

TEST_MODULE_GLOBS = ("test_*.py", "*_test.py")
ALWAYS = ("conftest.py", "pytest.ini", ".pytest.ini")
SECTIONED = ("pyproject.toml", "setup.cfg", "tox.ini")


def _is_test_dir(name: str) -> bool:
    return name in ("test", "tests", "testing") or name.startswith("test_") or name.endswith("_tests")


@dataclass
class Protection:
    """A task's protected paths (``protection(task)``)."""

    files: set[str]
    dirs: set[str]
    module_dirs: set[str]
    """Folders whose test modules are protected (a test file that sits beside code)."""
    patterns: tuple[str, ...]

    def reason(self, path: str) -> str | None:
        """Why ``path`` (relative to the repository) is protected, or None."""
        p = PurePosixPath(path)
        chain = [p, *p.parents][:-1]  # the path and its ancestors, without "."
        for q in chain:
            s = str(q)
            if s in self.files:
                return f"test file {s}"
            if s in self.dirs:
                return f"test directory {s}/"
            if any(fnmatch.fnmatchcase(s, pat) for pat in self.patterns):
                return f"marked protected by the task ({s})"
            if q.name in ALWAYS:
                return f"test configuration {s}"
        parent = str(p.parent) if str(p.parent) != "." else ""
        if parent in self.module_dirs and any(fnmatch.fnmatchcase(p.name, g) for g in TEST_MODULE_GLOBS):
            return f"test module {path} beside the task's tests"
        return None


def protection(test_files: list[str], patterns: list[str] = ()) -> Protection:
    files, dirs, module_dirs = set(test_files), set(), set()
    for f in test_files:
        parts = PurePosixPath(f).parts[:-1]
        top = next((i for i, name in enumerate(parts) if _is_test_dir(name)), None)
        if top is not None:
            dirs.add(str(PurePosixPath(*parts[: top + 1])))
        else:
            module_dirs.add(str(PurePosixPath(*parts)) if parts else "")
    return Protection(files, dirs, module_dirs, tuple(patterns))


MAX_CONFIG_CHARS = 1 << 20
"""A config file longer than this is not parsed: it counts as unreadable."""


def test_sections(name: str, text: str | None) -> object:
    """The part of a config file pytest reads (None: the file is absent or has none);
    an unreadable file is its own text (so any change to it counts). Unreadable includes
    what a parser cannot bound: a file past ``MAX_CONFIG_CHARS``, or nesting deeper than
    the interpreter's recursion limit (``tomllib`` recurses per ``[``)."""
    if text is None:
        return None
    if len(text) > MAX_CONFIG_CHARS:
        return ("unreadable", text)
    try:
        if name == "pyproject.toml":
            return tomllib.loads(text).get("tool", {}).get("pytest")
        section = "tool:pytest" if name == "setup.cfg" else "pytest"
        cp = configparser.RawConfigParser(strict=False, interpolation=None)
        cp.read_string(text)
        return dict(cp.items(section)) if cp.has_section(section) else None
    except (tomllib.TOMLDecodeError, configparser.Error, AttributeError, RecursionError, MemoryError):
        return ("unreadable", text)


def sectioned(path: str) -> bool:
    return PurePosixPath(path).name in SECTIONED


@dataclass
class CleanRoomPlan:
    changed: dict[str, str] = field(default_factory=dict)
    """Text files the clean room writes (path -> content)."""
    deleted: list[str] = field(default_factory=list)
    protected: dict[str, str] = field(default_factory=dict)
    """Paths of the diff that were reverted to the task's state -> why they are protected."""
    not_reproduced: list[str] = field(default_factory=list)
    """Changes the diff does not carry as text (links, binaries, modes, too large)."""
    config_checks: list[str] = field(default_factory=list)
    """Config files whose test sections must be compared with the pristine copy."""


def plan(p: Protection, diff: WorkspaceDiff) -> CleanRoomPlan:
    out = CleanRoomPlan()
    for path, text in sorted(diff.changed.items()):
        why = p.reason(path)
        if why:
            out.protected[path] = why
        else:
            out.changed[path] = text
            if sectioned(path):
                out.config_checks.append(path)
    for path in sorted(diff.deleted):
        why = p.reason(path)
        if why:
            out.protected[path] = why
        else:
            out.deleted.append(path)
            if sectioned(path):
                out.config_checks.append(path)
    for path in sorted({*diff.binary, *diff.patch_left_out, *diff.omitted}):
        why = p.reason(path)
        if why:
            out.protected[path] = why
        elif path not in out.changed and path not in out.deleted:
            out.not_reproduced.append(path)
    return out


def revert_config_changes(out: CleanRoomPlan, pristine: dict[str, str | None]) -> None:
    """Revert the config files of ``out.config_checks`` whose test sections differ from
    the pristine copies (``pristine``: path -> text, None when the task has no such file)."""
    for path in out.config_checks:
        name = PurePosixPath(path).name
        new = out.changed.get(path)  # None: deleted
        try:
            differs = test_sections(name, new) != test_sections(name, pristine.get(path))
        except RecursionError:  # parsed, but too deep to compare: a change like any other
            differs = True
        if differs:
            out.protected[path] = (
                f"test configuration {path} (its [{'tool.pytest' if name == 'pyproject.toml' else 'pytest'}] section)"
            )
            out.changed.pop(path, None)
            if path in out.deleted:
                out.deleted.remove(path)
    out.config_checks = []
