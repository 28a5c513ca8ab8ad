"""kiln's protected test runner: the only source of a score's test results.

Run inside the scoring sandbox as ``python -I -S -c <this file's source> <config>``
(``kiln.shared.tasks.testrun.runner_command`` builds it; ``<config>`` is base64 of zlib
of JSON: ``framework`` (``unittest`` or ``pytest``), ``ids`` (the tests to run), ``args``
(extra pytest arguments), ``timeout_s``). Standard library only, Python 3.8 and later:
it runs under whatever interpreter the task's environment has.

Two processes:
- the *parent* starts before any code of the workspace can run: ``-I`` ignores every
  ``PYTHON*`` variable and the user's site, ``-S`` skips ``site`` (so no
  ``sitecustomize``/``usercustomize`` is imported from anywhere); the parent then adds
  the environment's site-packages itself (``.pth`` files of the environment only, and
  the current directory on no path), imports the test framework from there, makes
  itself non-dumpable (no process of the sandbox's uid may read its memory or its
  ``/proc`` fds), and forks;
- the *child* puts the workspace first on ``sys.path`` (as ``python -m`` would), runs
  exactly the requested tests through kiln's own result collector, and sends one event
  per test over a pipe. Its stdout and stderr are the parent's stderr (people read it);
  it never holds the parent's stdout.

Invariants:
- the report is the parent's stdout and nothing else writes there: one JSON document,
  written once, after the child has ended (or was killed at ``timeout_s``);
- every requested id gets exactly one status: from the child's event for it, or
  ``missing`` (never run, the child died first, a duplicate or malformed event); a
  report never says more than the child showed;
- tampering is detected, not trusted away: the child snapshots the framework's entry
  points (``unittest``'s ``TestCase``/``TestResult``/``TestSuite``/loader, pytest's
  runner, reports, python and main modules, the collector itself) before any test
  module is imported, and compares them after every test and at the end; any change
  is listed in ``tampered``, and so is a framework module loaded from the workspace;
  standard-library names the workspace's modules took are listed in ``shadowed``;
- as pid 1 of its sandbox the parent cannot be signalled by the tested code, and its
  exit ends every process the tests left behind.
"""

import base64
import json
import os
import sys
import time
import zlib

REPORT_VERSION = 1
MESSAGE_CHARS = 400
MESSAGES_CHARS = 12000
"""Failure messages kept in the report, all tests together: the report must fit in the
sandbox's captured stdout (64 KiB by default) whatever the number of tests."""
CODES = {"passed": "P", "failed": "F", "error": "E", "skipped": "S"}
"""One letter per test in ``statuses`` (``M``: missing)."""
PR_SET_DUMPABLE = 4


def _site_packages():
    """The environment's site-packages (and its ``.pth`` files), as ``site.main`` would
    add them, minus user site-packages and the customize hooks."""
    import site

    known = site.removeduppaths()
    if hasattr(site, "venv"):
        known = site.venv(known)
    site.addsitepackages(known)


def _set_dumpable(flag):
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_DUMPABLE, 1 if flag else 0, 0, 0, 0) == 0
    except Exception:
        return False


def _callables(obj):
    out = {}
    for name, value in list(vars(obj).items()):
        if callable(value) or isinstance(value, (staticmethod, classmethod, property)):
            out[name] = id(value)
    return out


FRAMEWORK_MODULES = {"unittest", "pytest", "_pytest", "pluggy"}


class Guard:
    """Identities of the framework's entry points, taken before any tested code runs, and
    the workspace's stand-ins for standard or framework modules."""

    def __init__(self, targets, workspace):
        self.targets = targets
        self.before = {name: _callables(obj) for name, obj in targets}
        self.found = []
        self.shadowed = []
        """Standard-library names the workspace's own modules took (a finding, not
        tampering: a repository may have a top-level ``token.py``)."""
        self.workspace = workspace
        self.stdlib = set(getattr(sys, "stdlib_module_names", ()))
        self.loaded = set(sys.modules)

    def check(self):
        for name in list(sys.modules):
            top = name.partition(".")[0]
            if name in self.loaded or (top not in self.stdlib and top not in FRAMEWORK_MODULES):
                continue
            self.loaded.add(name)
            where = getattr(sys.modules.get(name), "__file__", None) or ""
            if where and os.path.abspath(where).startswith(self.workspace + os.sep):
                what = "module %s from the workspace (%s)" % (name, os.path.relpath(where, self.workspace))
                (self.found if top in FRAMEWORK_MODULES else self.shadowed).append(what)
        for name, obj in self.targets:
            now = _callables(obj)
            was = self.before[name]
            for attr in sorted(set(was) | set(now)):
                if was.get(attr) != now.get(attr):
                    what = "%s.%s" % (name, attr)
                    if what not in self.found:
                        self.found.append(what)
        return self.found


def _framework_targets(framework):
    import unittest
    import unittest.case
    import unittest.loader
    import unittest.result
    import unittest.suite

    targets = [
        ("unittest.TestCase", unittest.TestCase),
        ("unittest.TestResult", unittest.TestResult),
        ("unittest.TextTestResult", unittest.TextTestResult),
        ("unittest.TestSuite", unittest.TestSuite),
        ("unittest.TestLoader", unittest.TestLoader),
        ("unittest.case", unittest.case),
        ("unittest.suite", unittest.suite),
    ]
    if framework == "pytest":
        import pytest  # noqa: F401  (before the workspace is on any path: a `pytest.py` there cannot stand in)
        import _pytest.main
        import _pytest.python
        import _pytest.reports
        import _pytest.runner
        import _pytest.unittest

        targets += [
            ("_pytest.runner", _pytest.runner),
            ("_pytest.runner.CallInfo", _pytest.runner.CallInfo),
            ("_pytest.reports", _pytest.reports),
            ("_pytest.reports.TestReport", _pytest.reports.TestReport),
            ("_pytest.python", _pytest.python),
            ("_pytest.python.Function", _pytest.python.Function),
            ("_pytest.main", _pytest.main),
            ("_pytest.unittest", _pytest.unittest),
        ]
    return targets


class Events:
    """The child's side of the event pipe: one JSON line per event."""

    def __init__(self, fd, guard):
        self.fd = fd
        self.guard = guard

    def send(self, **event):
        data = (json.dumps(event) + "\n").encode()
        while data:
            data = data[os.write(self.fd, data):]

    def result(self, test_id, status, message="", seconds=0.0):
        self.send(t="result", id=test_id, status=status, message=message[:MESSAGE_CHARS], seconds=round(seconds, 4))
        self.guard.check()


def _text(err):
    if err is None:
        return ""
    try:
        import traceback

        return "".join(traceback.format_exception_only(err[0], err[1])).strip()
    except Exception:
        return repr(err)


def _flatten(tests):
    import unittest

    if isinstance(tests, unittest.TestSuite):
        for t in tests:
            for x in _flatten(t):
                yield x
    else:
        yield tests


def run_unittest(ids, events):
    import unittest
    import unittest.runner

    Base = unittest.TextTestResult  # prints `-v` lines and tracebacks for people (stderr)

    class Collector(Base):
        """One event per test: its worst outcome (a failed subtest fails the test)."""

        def startTest(self, test):
            Base.startTest(self, test)
            self._status, self._message, self._t0 = "passed", "", time.monotonic()

        def _set(self, status, message):
            order = ("passed", "skipped", "failed", "error")
            if order.index(status) >= order.index(self._status):
                self._status, self._message = status, message

        def addSuccess(self, test):
            Base.addSuccess(self, test)

        def addFailure(self, test, err):
            Base.addFailure(self, test, err)
            self._set("failed", _text(err))

        def addError(self, test, err):
            Base.addError(self, test, err)
            if not hasattr(self, "_t0"):  # a class or module fixture, outside any test
                events.send(t="error", where=str(test), message=_text(err)[:MESSAGE_CHARS])
            else:
                self._set("error", _text(err))

        def addSkip(self, test, reason):
            Base.addSkip(self, test, reason)
            self._set("skipped", str(reason))

        def addExpectedFailure(self, test, err):
            Base.addExpectedFailure(self, test, err)

        def addUnexpectedSuccess(self, test):
            Base.addUnexpectedSuccess(self, test)
            self._set("failed", "unexpected success")

        def addSubTest(self, test, subtest, err):
            Base.addSubTest(self, test, subtest, err)
            if err is not None:
                failed = issubclass(err[0], test.failureException)
                self._set("failed" if failed else "error", "%s: %s" % (subtest, _text(err)))

        def stopTest(self, test):
            Base.stopTest(self, test)
            if hasattr(self, "_t0"):
                events.result(test.id(), self._status, self._message, time.monotonic() - self._t0)
                del self._t0

    events.guard.targets.append(("kiln.Collector", Collector))
    events.guard.before["kiln.Collector"] = _callables(Collector)
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for test_id in ids:
        try:
            loaded = loader.loadTestsFromName(test_id)
        except Exception as e:  # the id's module or attribute does not exist: it stays missing
            events.send(t="error", where=test_id, message=("%s: %s" % (type(e).__name__, e))[:MESSAGE_CHARS])
            continue
        broken = [t for t in _flatten(loaded) if type(t).__name__ == "_FailedTest"]
        if broken:  # newer unittest returns a stand-in that errors when run: never run it
            why = getattr(broken[0], "_exception", None)
            events.send(t="error", where=test_id, message=("%s: %s" % (type(why).__name__, why))[:MESSAGE_CHARS])
        else:
            suite.addTest(loaded)
    result = Collector(unittest.runner._WritelnDecorator(sys.stderr), True, 2)
    suite.run(result)
    result.printErrors()


def run_pytest(ids, args, events):
    import pytest

    class Collector:
        """The outcome of each test over its setup, call and teardown phases."""

        def __init__(self):
            self.status = {}

        def pytest_runtest_logreport(self, report):
            status, message = self.status.get(report.nodeid, ("passed", ""))
            if report.failed:
                status = "failed" if report.when == "call" else "error"
                message = str(report.longrepr)[-MESSAGE_CHARS:]
            elif report.skipped and status == "passed":
                status, message = "skipped", str(report.longrepr)[-MESSAGE_CHARS:]
                if hasattr(report, "wasxfail"):
                    status, message = "passed", "xfail"
            elif report.when == "call" and hasattr(report, "wasxfail") and report.passed:
                status, message = "failed", "unexpected xpass"
            self.status[report.nodeid] = (status, message)
            if report.when == "teardown":
                events.result(report.nodeid, status, message, getattr(report, "duration", 0.0))

        def pytest_collectreport(self, report):
            if report.failed:
                events.send(t="error", where=report.nodeid or "collection", message=str(report.longrepr)[-MESSAGE_CHARS:])

    collector = Collector()
    events.guard.targets.append(("kiln.Collector", Collector))
    events.guard.before["kiln.Collector"] = _callables(Collector)
    code = pytest.main(["-p", "no:cacheprovider", "--color=no", "-rfE", *args, "--", *ids], plugins=[collector])
    events.send(t="exit", code=int(code))


def child(cfg, events_fd, cwd):
    os.setpgid(0, 0)
    _set_dumpable(True)
    os.dup2(2, 1)  # the tests print to the parent's stderr; the report (fd 1) is not theirs
    guard = Guard(_framework_targets(cfg["framework"]), cwd)
    events = Events(events_fd, guard)
    sys.path.insert(0, cwd)
    sys.argv = ["kiln-runner"]
    try:
        if cfg["framework"] == "pytest":
            run_pytest(cfg["ids"], cfg.get("args", []), events)
        else:
            run_unittest(cfg["ids"], events)
    except BaseException as e:  # a SystemExit from the tests included: the run ended early
        events.send(t="error", where="runner", message=("%s: %s" % (type(e).__name__, e))[:MESSAGE_CHARS])
    events.send(t="done", tampered=guard.check(), shadowed=guard.shadowed[:20])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def read_events(fd, pid, timeout_s):
    """(events, timed out, wait status): reads until the child has ended and its pipe is
    drained (a grandchild holding the pipe open does not hold the run), or kills the
    child's group at the deadline."""
    import select

    deadline = time.monotonic() + timeout_s
    buf, timed_out, status = b"", False, None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            timed_out = True
            break
        ready, _, _ = select.select([fd], [], [], min(left, 0.05 if status is not None else 1.0))
        if ready:
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            continue
        if status is not None:  # ended, and nothing more to read
            break
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
    if status is None:
        _, status = os.waitpid(pid, 0)
    events = []
    for line in buf.split(b"\n"):
        if line.strip():
            try:
                events.append(json.loads(line))
            except ValueError:
                events.append({"t": "malformed"})
    return events, timed_out, status


def report(cfg, events, timed_out, status, seconds):
    ids = cfg["ids"]
    wanted = {test_id: i for i, test_id in enumerate(ids)}
    results = [None] * len(ids)
    problems, errors, tampered, shadowed, done, extra, exit_code = [], [], [], [], False, 0, None
    for e in events:
        kind = e.get("t") if isinstance(e, dict) else None
        if kind == "result":
            i = wanted.get(e.get("id"))
            if i is None:
                extra += 1
            elif results[i] is not None:
                problems.append("two results for %s" % ids[i])
                results[i] = "duplicate"
            else:
                results[i] = [e.get("status"), str(e.get("message", ""))[:MESSAGE_CHARS]]
        elif kind == "error":
            errors.append([str(e.get("where", ""))[:200], str(e.get("message", ""))[:MESSAGE_CHARS]])
        elif kind == "exit":
            exit_code = e.get("code")
        elif kind == "done" and not done:
            done = True
            tampered = [str(x) for x in e.get("tampered", [])]
            shadowed = [str(x) for x in e.get("shadowed", [])]
        else:
            problems.append("an event kiln's runner never sends: %r" % (str(e)[:100],))
    statuses, messages, budget = [], {}, MESSAGES_CHARS
    for i, r in enumerate(results):
        if r is None or r == "duplicate" or r[0] not in CODES:
            statuses.append("M")
        else:
            statuses.append(CODES[r[0]])
            if r[0] != "passed" and r[1] and budget > 0:
                messages[str(i)] = r[1]
                budget -= len(r[1])
    return {
        "kiln_runner": REPORT_VERSION,
        "framework": cfg["framework"],
        "count": len(ids),
        "statuses": "".join(statuses),
        "messages": messages,
        "errors": errors[:20],
        "tampered": tampered,
        "shadowed": shadowed,
        "completed": done,
        "timed_out": timed_out,
        "child_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "child_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "pytest_exit": exit_code,
        "extra_results": extra,
        "problems": problems[:20],
        "python": sys.version.split()[0],
        "seconds": round(seconds, 3),
    }


def main():
    t0 = time.monotonic()
    cwd = os.getcwd()
    sys.path[:] = [p for p in sys.path if p and os.path.abspath(p) != cwd]
    cfg = json.loads(zlib.decompress(base64.b64decode(sys.argv[1])).decode())
    _site_packages()
    # The framework is imported with the workspace on no path (a `unittest.py` or a
    # `pytest/` in it cannot stand in), then the paths an editable install gave it
    # come back after.
    inside = [p for p in sys.path if os.path.abspath(p) == cwd or os.path.abspath(p).startswith(cwd + os.sep)]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in inside]
    _framework_targets(cfg["framework"])
    import select  # noqa: F401  (the parent's own needs, before the workspace is on any path)
    import traceback  # noqa: F401

    sys.path[:] = saved
    _set_dumpable(False)
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        child(cfg, write_fd, cwd)
    os.close(write_fd)
    events, timed_out, status = read_events(read_fd, pid, float(cfg["timeout_s"]))
    out = json.dumps(report(cfg, events, timed_out, status, time.monotonic() - t0)).encode()
    while out:
        out = out[os.write(1, out):]
    os._exit(0)  # nothing left to finalise: the report is written


if __name__ == "__main__":
    main()
