"""The framework drivers of kiln's runner's test process: unittest's and pytest's runs
through kiln's collector and witness. Not a module of its own: ``runner_command``
appends this source to ``runner_child.py``'s (one namespace, one program), so the names
it uses (``Record``, ``_attrs``, ``_text``, the captured ``_monotonic``...) are that file's.

Invariants: each test's result event carries the witness's verdict
(``Witness.verdict``), never the framework's alone; the key is asked for (``ready``)
only once every test module is imported.
"""

import sys


def _flatten(tests):
    import unittest

    if isinstance(tests, unittest.TestSuite):
        for t in tests:
            yield from _flatten(t)
    else:
        yield tests


def run_unittest(ids, ch, guard, witness, pristine, finder):
    import unittest
    import unittest.runner

    Base = unittest.TextTestResult  # prints `-v` lines and tracebacks for people (stderr)
    order = ("passed", "xfail", "skipped", "failed", "error")

    class Collector(Base):
        """One event per test: its worst outcome (a failed subtest fails the test)."""

        def startTest(self, test):
            Base.startTest(self, test)
            self._status, self._message, self._t0, self._id = "passed", "", _monotonic(), test.id()
            witness.install_unittest(test, self._id)

        def _set(self, status, message):
            if order.index(status) >= order.index(self._status):
                self._status, self._message = status, message

        def addFailure(self, test, err):
            Base.addFailure(self, test, err)
            self._set("failed", _text(err))

        def addError(self, test, err):
            Base.addError(self, test, err)
            if not hasattr(self, "_t0"):  # a class or module fixture, outside any test
                ch.send("error", str(test), _text(err)[:MESSAGE_CHARS])
            else:
                self._set("error", _text(err))

        def addSkip(self, test, reason):
            Base.addSkip(self, test, reason)
            self._set("skipped", str(reason))

        def addExpectedFailure(self, test, err):
            Base.addExpectedFailure(self, test, err)
            self._set("xfail", _text(err))

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
                cls = type(test)
                path = pristine.path_of(cls.__module__)
                status, message = witness.verdict(
                    self._id, self._status, self._message, path, cls.__qualname__ + "." + test._testMethodName
                )
                ch.send("result", self._id, status, message[:MESSAGE_CHARS], round(_monotonic() - self._t0, 4))
                del self._t0
                guard.check()

    guard.watch("kiln.Collector", Collector)
    guard.core.append(("kiln.Collector", Collector))
    modules = {}
    for test_id in ids:  # each test module from its protected file, by location
        parts = test_id.split(".")
        name = next(
            (".".join(parts[:k]) for k in range(len(parts), 0, -1) if pristine.path_of(".".join(parts[:k]))), None
        )
        if name is None or name in modules:
            continue
        try:
            parent = name.rpartition(".")[0]
            if parent:
                _import_module(parent)
            spec = finder.find_spec(name)
            module = _module_from_spec(spec)
            sys.modules[name] = module
            if parent:
                setattr(sys.modules[parent], name.rpartition(".")[2], module)
            spec.loader.exec_module(module)
            modules[name] = module
        except Exception as e:
            sys.modules.pop(name, None)
            modules[name] = e
    ch.ready()
    loader = unittest.TestLoader()
    suite = unittest.TestSuite()
    for test_id in ids:
        name = next((m for m in modules if test_id == m or test_id.startswith(m + ".")), None)
        try:
            module = modules.get(name)
            if isinstance(module, Exception):
                raise module
            if module is None:  # not a file of the repository: found by name, judged by the witness
                loaded = loader.loadTestsFromName(test_id)
            elif test_id == name:
                loaded = loader.loadTestsFromModule(module)
            else:
                loaded = loader.loadTestsFromName(test_id[len(name) + 1 :], module)
        except Exception as e:  # the id's module or attribute does not exist: it stays missing
            ch.send("error", test_id, ("%s: %s" % (type(e).__name__, e))[:MESSAGE_CHARS])
            continue
        broken = [t for t in _flatten(loaded) if type(t).__name__ == "_FailedTest"]
        if broken:  # newer unittest returns a stand-in that errors when run: never run it
            why = getattr(broken[0], "_exception", None)
            ch.send("error", test_id, ("%s: %s" % (type(why).__name__, why))[:MESSAGE_CHARS])
        else:
            suite.addTest(loaded)
    result = Collector(unittest.runner._WritelnDecorator(sys.stderr), True, 2)
    suite.run(result)
    result.printErrors()


def _node(nodeid, cwd):
    parts = nodeid.split("::")
    return _join(cwd, parts[0]), ".".join(p.split("[")[0] for p in parts[1:])


def run_pytest(ids, args, ch, guard, witness, pristine, finder, cwd):
    import pytest

    class Plugin:
        """The witness around each test function, and the outcome of each test over its
        setup, call and teardown phases."""

        def __init__(self):
            self.status = {}

        def _first(self):
            if sys.meta_path[:1] != [finder]:  # pytest puts its assertion hook first
                if finder in sys.meta_path:
                    sys.meta_path.remove(finder)
                sys.meta_path.insert(0, finder)

        @pytest.hookimpl(trylast=True)
        def pytest_configure(self, config):
            self._first()
            guard.rebase(("pytest", "_pytest", "pluggy"))

        def pytest_collectstart(self, collector):
            self._first()

        def pytest_collection_finish(self, session):
            ch.ready()

        @pytest.hookimpl(tryfirst=True)
        def pytest_sessionfinish(self, session):
            guard.check()  # in full, before the plugins undo their own changes at unconfigure
            guard.done_with.update(("pytest", "_pytest", "pluggy"))

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_pyfunc_call(self, pyfuncitem):
            nodeid, obj = pyfuncitem.nodeid, pyfuncitem.obj
            rec = witness.records[nodeid] = Record()
            fn = getattr(obj, "__func__", obj)
            path, qualname = _node(nodeid, cwd)
            cls, name = getattr(pyfuncitem, "cls", None), qualname.rpartition(".")[2]
            owner = next((k for k in cls.__mro__ if name in vars(k)), cls) if cls is not None else None
            if owner is not None and owner is not cls and pristine.path_of(owner.__module__):
                # inherited from a base class in another protected module: checked against its source
                path, qualname = pristine.path_of(owner.__module__), owner.__qualname__ + "." + name
            pyfuncitem.obj = witness.wrap(obj, fn, path, qualname, rec)
            try:
                yield
            finally:
                pyfuncitem.obj = obj

        @pytest.hookimpl(hookwrapper=True, tryfirst=True)
        def pytest_runtest_call(self, item):
            case = getattr(item, "_testcase", None)  # a unittest.TestCase under pytest
            if case is not None and hasattr(case, "_testMethodName"):
                witness.install_unittest(case, item.nodeid)
                witnessed = vars(case).get(case._testMethodName)
                if witnessed is not None:  # pytest sets item.obj on the instance before it runs the case
                    item.obj = witnessed
            yield

        def pytest_runtest_logreport(self, report):
            status, message = self.status.get(report.nodeid, ("passed", ""))
            if report.failed:
                status = "failed" if report.when == "call" else "error"
                message = str(report.longrepr)[-MESSAGE_CHARS:]
            elif report.skipped and status == "passed":
                status, message = "skipped", str(report.longrepr)[-MESSAGE_CHARS:]
                if hasattr(report, "wasxfail"):
                    status = "xfail"
            elif report.when == "call" and hasattr(report, "wasxfail") and report.passed:
                status, message = "failed", "unexpected xpass"
            self.status[report.nodeid] = (status, message)
            if report.when == "teardown":
                path, qualname = _node(report.nodeid, cwd)
                status, message = witness.verdict(report.nodeid, status, message, path, qualname)
                ch.send(
                    "result", report.nodeid, status, message[:MESSAGE_CHARS], round(getattr(report, "duration", 0.0), 4)
                )
                guard.check(full=False)

        def pytest_collectreport(self, report):
            if report.failed:
                ch.send("error", report.nodeid or "collection", str(report.longrepr)[-MESSAGE_CHARS:])

    plugin = Plugin()
    guard.watch("kiln.Plugin", Plugin)
    guard.core.append(("kiln.Plugin", Plugin))
    code = pytest.main(
        ["-p", "no:cacheprovider", "--color=no", "-rfE"] + list(args) + ["--"] + list(ids), plugins=[plugin]
    )
    ch.ready()
    ch.send("exit", int(code))
