"""``kiln tasks synth``: SWE-smith-style tasks from a real Python package and its own test
suite (project issue 22).

For each package (an sdist ``NAME==VERSION`` from the index, or a local folder):

1. an environment: the repository (sdist at that version, or the folder), a venv with the
   project installed editable plus the test dependencies it declares
   (``kiln.shared.tasks.testdeps``: test extras, requirements files and dependency groups,
   else dev ones, else tox's deps, else the third-party modules its tests import), and
   pytest; built with the node's ``EnvironmentCache``;
2. its tests, run once (``pytest -rA``, no network) in a copy of the repository: the
   passing set (tests failing on the original are dropped);
3. procedural bugs (``kiln.shared.tasks.mutate``) in the package's own modules (never
   tests), sampled deterministically from the seed, one per function, each run against the
   passing tests: kept when some passing tests now fail (and none disappears, as a broken
   import would make them);
4. a task per kept bug: ``files`` = the mutated file, ``solution`` = the original,
   ``fail_to_pass`` = the tests it breaks, ``pass_to_pass`` = a sample of the other passing
   tests of the same files, ``test_files`` = those test files, ``test_command`` = pytest
   ``-rA`` on those files, a problem statement written from the failing tests' output;
   every task is then checked as ``kiln tasks validate`` does and dropped if it fails.

Splits by module (by function when the package has one module): a deterministic share
``held_out_fraction`` of the modules is ``heldout`` (what ``eval.split`` evaluates), the
rest ``train``, so held-out tasks are bugs in code no training task touches.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import re
import shlex
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kiln.envpool.environments.cache import EnvironmentCache
from kiln.envpool.environments.layers import BuiltEnvironment
from kiln.envpool.environments.unpack import materialize_repository
from kiln.ops.tasks_validate import prepare_workspace, run_tests, validate_task
from kiln.shared.contracts import CaseStatus
from kiln.shared.environments import (
    DirRepository,
    EnvironmentSpec,
    PythonSpec,
    RepositorySpec,
    SdistRepository,
)
from kiln.shared.tasks import Task, write_suite
from kiln.shared.tasks.mutate import Mutation, Site, sites
from kiln.shared.tasks.report import parse_test_report
from kiln.shared.tasks.testdeps import TEST_DIRS, DirTree, is_test_path, test_dependencies

log = logging.getLogger(__name__)

PYTEST = "PYTHONDONTWRITEBYTECODE=1 python -m pytest -rA -p no:cacheprovider --color=no"
"""How synthesized tasks run their tests (restricted to their test files)."""
TRAIN, HELDOUT = "train", "heldout"
_NOT_SOURCE_DIRS = TEST_DIRS | {
    "docs",
    "doc",
    "examples",
    "example",
    "benchmarks",
    "bench",
    "scripts",
    "tools",
    "ci",
    "ci_tools",
    "build",
    "dist",
    ".tox",
    ".nox",
}
_NOT_SOURCE_FILES = {
    "setup.py",
    "conftest.py",
    "noxfile.py",
    "versioneer.py",
    "_version.py",
    "version.py",
    "__main__.py",
    "fabfile.py",
    "tasks.py",
}


# -- sources and their environments -----------------------------------------------------------


@dataclass
class Source:
    name: str
    """Distribution (or folder) name."""
    version: str
    repository: RepositorySpec

    @property
    def env_name(self) -> str:
        return f"{re.sub(r'[^a-z0-9]+', '-', self.name.lower()).strip('-')}-{self.version}"

    @classmethod
    def parse(cls, text: str) -> Source:
        """``NAME==VERSION`` (an sdist)."""
        name, sep, version = text.partition("==")
        if not sep or not name.strip() or not version.strip():
            raise ValueError(f"a package is NAME==VERSION, not {text!r}")
        return cls(name.strip(), version.strip(), SdistRepository(name=name.strip(), version=version.strip()))

    @classmethod
    def folder(cls, path: str | Path) -> Source:
        p = Path(path).resolve()
        return cls(p.name, "local", DirRepository(path=str(p)))


def source_modules(repo: Path) -> list[str]:
    """The package's own modules (relative paths): under ``src/`` when there is one, else
    in the top-level packages (folders with ``__init__.py``) and top-level modules;
    never tests, docs, examples, setup or version files."""
    roots = [repo / "src"] if (repo / "src").is_dir() else [repo]
    out = []
    for root in roots:
        for p in sorted(root.rglob("*.py")):
            rel = p.relative_to(repo).as_posix()
            parts = p.relative_to(root).parts
            if set(parts[:-1]) & _NOT_SOURCE_DIRS or parts[-1] in _NOT_SOURCE_FILES or is_test_path(rel):
                continue
            if root == repo and len(parts) > 1 and not (repo / parts[0] / "__init__.py").is_file():
                continue  # a folder that is no package (tooling)
            if any(part.startswith(".") or part.endswith(".egg-info") for part in parts):
                continue
            out.append(rel)
    return out


def environment_for(source: Source, repo: Path, interpreter: str = "python3.11") -> EnvironmentSpec:
    """The package's environment: its repository, editable install with its test
    dependencies, and pytest."""
    deps = test_dependencies(DirTree(repo))
    return EnvironmentSpec(
        name=source.env_name,
        repository=source.repository,
        python=PythonSpec(
            interpreter=interpreter,
            install_project=True,
            extras=deps.extras,
            requirements_files=deps.requirements_files,
            packages=[*deps.packages, "pytest"],
        ),
    )


# -- test runs --------------------------------------------------------------------------------


@dataclass
class TestRun:
    returncode: int | None
    timed_out: bool
    output: str
    status: dict[str, CaseStatus]
    seconds: float


def _unique_ids(output: str) -> dict[str, CaseStatus]:
    """The run's statuses, without ids reported twice or cut at a space (a parameter id
    with spaces: the report format cannot name it)."""
    report = parse_test_report(output)
    seen: dict[str, int] = {}
    for m in re.finditer(r"^(?:PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", output, re.M):
        seen[m.group(1)] = seen.get(m.group(1), 0) + 1
    return {t: s for t, s in report.items() if "::" in t and seen.get(t, 0) <= 1 and t.count("[") == t.count("]")}


async def run_pytest(built: BuiltEnvironment, workspace: Path, args: list[str], timeout_s: float) -> TestRun:
    cmd = f"{PYTEST} {' '.join(shlex.quote(a) for a in args)}".strip()
    rc, timed_out, output, seconds = await run_tests(built, workspace, cmd, timeout_s, env={"COLUMNS": "200"})
    return TestRun(rc, timed_out, output, _unique_ids(output), seconds)


# -- problem statements -----------------------------------------------------------------------


def _failure_sections(output: str) -> dict[str, list[str]]:
    """``E`` lines of each failure section of pytest's output, by the section's title."""
    sections: dict[str, list[str]] = {}
    current = None
    for line in output.splitlines():
        m = re.match(r"^_{3,} (.+?) _{3,}$", line)
        if m:
            current = sections.setdefault(m.group(1), [])
            continue
        if re.match(r"^={3,} ", line):
            current = None
        elif current is not None and line.startswith("E "):
            current.append(line[1:].strip())
    return sections


def problem_statement(package: str, failing: list[str], output: str, hide: list[str]) -> str:
    """An issue report from the failing tests: which fail, and what they report (the
    assertion and exception lines; never a line naming the changed code)."""
    hidden = [h.strip() for text in hide for h in text.splitlines() if len(h.strip()) >= 4]
    sections = _failure_sections(output)
    shown = failing[:12]
    lines = [
        f"Some of {package}'s own tests fail",
        "",
        f"Running the package's test suite, {len(failing)} test{'s' if len(failing) != 1 else ''} "
        f"that should pass {'fail' if len(failing) != 1 else 'fails'}:",
        "",
    ]
    lines += [f"- `{t}`" for t in shown]
    if len(failing) > len(shown):
        lines.append(f"- ... and {len(failing) - len(shown)} more")
    details = []
    for t in failing[:3]:
        title = ".".join(t.split("::")[1:])
        got = list(dict.fromkeys(x for x in sections.get(title, []) if x and not any(h in x for h in hidden)))[:8]
        if got:
            details += ["", f"`{t}`:", "", "```", *got, "```"]
    if details:
        lines += ["", "What they report:", *details]
    lines += [
        "",
        "The tests are right: the package's code is what misbehaves. Please fix it so that these "
        "tests pass, without breaking the rest of the test suite.",
    ]
    return "\n".join(lines)


# -- synthesis --------------------------------------------------------------------------------


@dataclass
class PackageReport:
    source: str
    environment: str
    passing: int = 0
    candidates: int = 0
    kept: int = 0
    seconds: float = 0.0
    error: str = ""
    by_split: dict[str, int] = field(default_factory=dict)


def split_units(units: list[str], fraction: float, seed: int, salt: str) -> set[str]:
    """The held-out units: a deterministic ``fraction`` of them (at least one and never all,
    when there are two or more and the fraction is positive)."""
    units = sorted(units)
    if fraction <= 0 or len(units) < 2:
        return set()
    rng = random.Random(f"{seed}:{salt}:split")
    rng.shuffle(units)
    n = min(len(units) - 1, max(1, round(fraction * len(units))))
    return set(units[:n])


def _order(candidates: list[Site], rng: random.Random) -> list[Site]:
    """Shuffled, then one site per function before any second one (variety first)."""
    candidates = list(candidates)
    rng.shuffle(candidates)
    rank: dict[tuple[str, str], int] = {}
    keyed = []
    for i, s in enumerate(candidates):
        k = (s.file.path, s.function)
        keyed.append((rank.get(k, 0), i, s))
        rank[k] = rank.get(k, 0) + 1
    return [s for _, _, s in sorted(keyed, key=lambda x: (x[0], x[1]))]


async def synthesize_package(
    source: Source,
    cache: EnvironmentCache,
    *,
    max_tasks: int,
    seed: int,
    held_out_fraction: float,
    jobs: int = 2,
    interpreter: str = "python3.11",
    max_candidates: int | None = None,
    scratch_root: Path | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> tuple[EnvironmentSpec | None, list[Task], PackageReport]:
    """Tasks from one package (see the module's doc). Deterministic for ``seed`` (given
    deterministic tests)."""
    t0 = time.monotonic()
    rep = PackageReport(f"{source.name}=={source.version}", source.env_name)
    with tempfile.TemporaryDirectory(prefix="kiln-synth-", dir=scratch_root) as tmp:
        scratch = Path(tmp)
        probe = scratch / "probe"
        await asyncio.to_thread(materialize_repository, source.repository, probe)
        spec = environment_for(source, probe, interpreter)
        built = await cache.get(spec)
        say(
            f"{source.env_name}: environment {built.digest[:12]} ({', '.join(spec.python.requirements_files + spec.python.packages + [f'[{e}]' for e in spec.python.extras])})"
        )
        base = scratch / "base"
        empty = Task(id="base", problem_statement="", files={}, fail_to_pass=["-"])
        await asyncio.to_thread(prepare_workspace, built, empty, base)

        async def in_copy(files: dict[str, str], args: list[str], timeout_s: float, name: str) -> TestRun:
            ws = scratch / name
            await asyncio.to_thread(shutil.copytree, base, ws, symlinks=True)
            for rel, text in files.items():
                (ws / rel).write_text(text)
            try:
                return await run_pytest(built, ws, args, timeout_s)
            finally:
                await asyncio.to_thread(shutil.rmtree, ws, True)

        first = await in_copy({}, ["--continue-on-collection-errors"], 900, "baseline")
        modules = source_modules(base)
        passing = {
            t
            for t, s in first.status.items()
            if s == CaseStatus.PASSED and is_test_path(t.split("::")[0]) and t.split("::")[0] not in modules
        }
        rep.passing = len(passing)
        say(
            f"{source.env_name}: {len(passing)} passing tests of {len(first.status)} reported in {first.seconds:.1f}s; "
            f"{len(modules)} source modules"
        )
        if first.timed_out:
            rep.error = f"the test suite did not finish in {900}s"
            rep.seconds = time.monotonic() - t0
            return spec, [], rep
        if not passing:
            rep.error = f"no passing tests (pytest exited {first.returncode}): {first.output[-800:]}"
            rep.seconds = time.monotonic() - t0
            return spec, [], rep
        test_files = sorted({t.split("::")[0] for t in passing})
        timeout = max(60.0, 5 * first.seconds)

        all_sites = [s for m in modules for s in sites(m, (base / m).read_text(errors="replace"))]
        one_module = len({s.file.path for s in all_sites}) == 1
        unit = (lambda s: f"{s.file.path}::{s.function}") if one_module else (lambda s: s.file.path)
        held = split_units(list({unit(s) for s in all_sites}), held_out_fraction, seed, source.env_name)
        quota = {HELDOUT: min(max_tasks, round(max_tasks * held_out_fraction)) if held else 0}
        if held and held_out_fraction > 0 and max_tasks > 1:
            quota[HELDOUT] = max(1, quota[HELDOUT])
        quota[TRAIN] = max_tasks - quota[HELDOUT]
        rng = random.Random(f"{seed}:{source.env_name}:order")
        order = _order(all_sites, rng)
        tasks: list[Task] = []
        used_functions: set[tuple[str, str]] = set()
        limit = max_candidates if max_candidates is not None else 10 * max_tasks + 10
        for split in (HELDOUT, TRAIN):
            pool = [s for s in order if (unit(s) in held) == (split == HELDOUT)]
            kept, tried = 0, 0
            pos = 0
            while kept < quota[split] and pos < len(pool) and tried < limit:
                batch: list[Mutation] = []
                while len(batch) < max(1, jobs) and pos < len(pool):
                    site = pool[pos]
                    pos += 1
                    if (site.file.path, site.function) in used_functions:
                        continue
                    m = await asyncio.to_thread(site.render)
                    if m is not None:
                        batch.append(m)
                if not batch:
                    break
                tried += len(batch)
                rep.candidates += len(batch)
                runs = await asyncio.gather(
                    *(in_copy({m.path: m.mutated}, test_files, timeout, f"cand-{i}") for i, m in enumerate(batch))
                )
                for m, run in zip(batch, runs):
                    if kept >= quota[split] or (m.path, m.function) in used_functions:
                        continue
                    task = _task(source, spec, m, run, passing, split, seed, base)
                    if task is None:
                        continue
                    verdict = await validate_task(built, task, scratch)
                    if not verdict.ok:
                        say(f"  dropped {task.id}: {verdict.reasons[0] if verdict.reasons else '?'}")
                        continue
                    tasks.append(task)
                    used_functions.add((m.path, m.function))
                    kept += 1
                    say(
                        f"  kept {task.id} ({split}): {len(task.fail_to_pass)} fail-to-pass, {len(task.pass_to_pass)} pass-to-pass"
                    )
            rep.by_split[split] = kept
    rep.kept = len(tasks)
    rep.seconds = time.monotonic() - t0
    return spec, tasks, rep


MAX_TEST_FILES = 3
MAX_F2P = 50
MAX_P2P = 20


def _task(
    source: Source,
    spec: EnvironmentSpec,
    m: Mutation,
    run: TestRun,
    passing: set[str],
    split: str,
    seed: int,
    base: Path,
) -> Task | None:
    if run.timed_out:
        return None
    if any(t not in run.status for t in passing):
        return None  # tests vanished: a collection error (broken import), not a bug to fix
    broken = sorted(t for t in passing if run.status[t] in (CaseStatus.FAILED, CaseStatus.ERROR))
    if not broken:
        return None
    files = sorted({t.split("::")[0] for t in broken})
    if len(files) > MAX_TEST_FILES:
        return None
    key = hashlib.sha256(f"{m.path}\0{m.mutated}".encode()).hexdigest()[:8]
    rng = random.Random(f"{seed}:{key}")
    f2p = broken if len(broken) <= MAX_F2P else sorted(rng.sample(broken, MAX_F2P))
    others = sorted(t for t in passing if t.split("::")[0] in files and run.status[t] == CaseStatus.PASSED)
    p2p = others if len(others) <= MAX_P2P else sorted(rng.sample(others, MAX_P2P))
    module = Path(m.path).with_suffix("").as_posix()
    for prefix in ("src/",):
        module = module.removeprefix(prefix)
    module = module.replace("/", ".").removesuffix(".__init__")
    task_id = f"{source.env_name}.{module}.{m.function}.{m.kind}-{key}"
    statement = problem_statement(f"{source.name}", f2p, run.output, [m.before, m.after])
    return Task(
        id=task_id,
        problem_statement=statement,
        files={m.path: m.mutated},
        solution={m.path: m.original},
        test_files={f: (base / f).read_text() for f in files},
        test_command=f"{PYTEST} {' '.join(shlex.quote(f) for f in files)}",
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        split=split,
        timeout_s=max(60.0, round(5 * run.seconds)),
        environment=spec.name,
        metadata={
            "package": source.name,
            "version": source.version,
            "module": module,
            "path": m.path,
            "function": m.function,
            "mutation": m.kind,
            "change": m.description,
            "line": m.lineno,
            "generator": "kiln tasks synth",
            "seed": seed,
        },
    )


async def synthesize(
    sources: list[Source],
    out: Path,
    cache: EnvironmentCache,
    *,
    max_per_package: int = 6,
    seed: int = 0,
    held_out_fraction: float = 0.3,
    jobs: int = 2,
    interpreter: str = "python3.11",
    max_candidates: int | None = None,
    say: Callable[[str], None] = lambda s: None,
) -> list[PackageReport]:
    """Synthesize every source's tasks into the suite ``out`` (``suite.toml`` + ``tasks.jsonl``)."""
    specs, tasks, reports = [], [], []
    for source in sources:
        try:
            spec, got, rep = await synthesize_package(
                source,
                cache,
                max_tasks=max_per_package,
                seed=seed,
                held_out_fraction=held_out_fraction,
                jobs=jobs,
                interpreter=interpreter,
                max_candidates=max_candidates,
                say=say,
            )
        except Exception as e:  # noqa: BLE001 - one package's failure is reported; the others go on
            rep = PackageReport(f"{source.name}=={source.version}", source.env_name, error=f"{type(e).__name__}: {e}")
            spec, got = None, []
        reports.append(rep)
        if got and spec is not None:
            specs.append(spec)
            tasks += got
    write_suite(tasks, specs, out, "written by kiln tasks synth")
    return reports
