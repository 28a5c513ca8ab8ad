"""The test process of kiln's runner (``runner.py``). Never imported: ``runner_command``
inlines this source into the runner's as ``CHILD_SOURCE``, and the parent executes it,
before it forks and before any workspace code can run, in a namespace of its own whose
builtins are a copy. ``child_main`` then runs in the forked test process.

What a pass needs: the pristine test code ran to its end in a pristine framework.
- **Pristine code**: the test modules are the parent's code objects, loaded by file
  location (unittest: module objects made here and executed from those code objects;
  pytest: a meta-path finder, kept first, serving exactly the protected files' names).
  A module that replaces itself in ``sys.modules`` while it is imported is put back and
  is tampering.
- **The witness**: a test counts as passed only if the runner itself called its
  function and saw it return normally, after checking that the function (each layer of
  its ``__wrapped__`` chain) is the code compiled from the protected source, or library
  code from outside the workspace, and that its code is the one defined under its name.
  unittest: a wrapper on the test instance under the test method's name; pytest: a
  ``pytest_pyfunc_call`` wrapper around the item's function. An expected failure (or
  xfail) is a pass only where the protected source declares it; an expected-failure or
  skip flag the source does not declare is tampering. A test the framework reported as
  passed without the witness is tampering.
- **A pristine framework**: before any workspace code runs, the identities (and
  ``__code__``) of every function and class of the framework's modules (``unittest.*``;
  ``pytest``, ``_pytest.*``, ``pluggy.*``), every builtin, the profile and trace hooks
  (``sys``, ``threading``, ``sys.monitoring``), ``sys.modules['__main__']`` and the event
  pipe's target are recorded, checked after every test (pytest: its outcome machinery)
  and in full at the end; an audit hook (which no code can remove) records any
  ``sys.settrace``/``sys.setprofile`` call and any ``__code__`` assignment to a pristine
  function. Any difference is ``tampered``.
- **The channel**: the functions on the report path (``os.write``, ``os.read``,
  ``os._exit``, HMAC) are held by reference from before any workspace code ran; events
  are HMAC-SHA256 over a sequence number and the payload, with a key read from the
  parent once the test modules are imported; ``sys.modules['__main__']`` is a fresh
  module, not the runner.

What remains: code that deliberately reaches the runner's own objects (``gc``, frames,
closures, ``ctypes``) can still forge; so can a patch made and undone within one test.
"""

import _operator
import builtins
import gc
import importlib
import importlib.util
import inspect
import os
import sys
import time
import traceback
import types


def _sha256():
    for name in ("_sha2", "_sha256"):
        try:
            return __import__(name).sha256
        except (ImportError, AttributeError):
            pass
    import hashlib

    return hashlib.sha256


_SHA256 = _sha256()


class Mac:
    """HMAC-SHA256 (RFC 2104), as runner.py's."""

    def __init__(self, key):
        key = key.ljust(64, b"\0")
        self.inner, self.outer = bytes(k ^ 0x36 for k in key), bytes(k ^ 0x5C for k in key)

    def digest(self, msg):
        return _SHA256(self.outer + _SHA256(self.inner + msg).digest()).digest()


_write, _read, _close, _exit, _fstat, _dup2 = os.write, os.read, os.close, os._exit, os.fstat, os.dup2
_abspath, _join, _sep = os.path.abspath, os.path.join, os.sep
_monotonic = time.monotonic
_getprofile, _gettrace = sys.getprofile, sys.gettrace
_spec_from_file_location, _module_from_spec = importlib.util.spec_from_file_location, importlib.util.module_from_spec
_import_module = importlib.import_module
_iscoroutinefunction = inspect.iscoroutinefunction
_format_exception_only = traceback.format_exception_only
_FunctionType, _ModuleType = types.FunctionType, types.ModuleType
_exec, _compile = exec, compile
_get_referents = gc.get_referents
_is = _operator.is_
MESSAGE_CHARS = 400
KEY_BYTES = 32
CO_OPTIMIZED = 1
__unittest = True  # unittest leaves this code's frames out of tracebacks
REPORT_PATH = ("write", "read", "close", "_exit", "dup2", "fstat", "fork", "pipe", "kill", "killpg")
"""os functions a report depends on: replaced, they are tampering."""
FRAMEWORK_TOPS = ("unittest", "pytest", "_pytest", "pluggy")
CORE = (
    "unittest.case",
    "_pytest.runner",
    "_pytest.python",
    "_pytest.reports",
    "_pytest.skipping",
    "_pytest.outcomes",
    "_pytest.unittest",
    "_pytest.main",
    "pluggy._callers",
    "pluggy._hooks",
    "pluggy._result",
    "pluggy._manager",
)
"""Modules checked after every test (with their classes); the rest at the end."""


def _plain(x):
    t = type(x)
    if t is str or t is int or t is float or t is bool or x is None:
        return x
    if isinstance(x, str):
        return str.encode(x, "utf-8", "replace").decode("utf-8")
    if isinstance(x, (list, tuple)):
        return [_plain(y) for y in x]
    return "?"


def _text(err):
    try:
        return "".join(_format_exception_only(err[0], err[1])).strip()
    except Exception:
        return "?"


def _xor(a, b):
    return bytes(x ^ y for x, y in zip(a, b))


class Channel:
    """The child's side of the event pipe: ``ready`` (authenticated with the token the
    parent gave before any workspace code ran), then one authenticated line per event
    with the key the parent sends in answer, masked with the token (events before the
    key wait for it)."""

    def __init__(self, fd, key_fd, token):
        self.fd, self.key_fd, self.token, self.key, self.seq, self.pending = fd, key_fd, token, None, 0, []

    def _raw(self, data):
        while data:
            data = data[_write(self.fd, data) :]

    def ready(self):
        if self.key is not None:
            return
        by_token = Mac(self.token)
        self._raw(b"ready " + by_token.digest(b"ready").hex().encode() + b"\n")
        key = b""
        while len(key) < KEY_BYTES:
            chunk = _read(self.key_fd, KEY_BYTES - len(key))
            if not chunk:
                break
            key += chunk
        _close(self.key_fd)
        self.key = Mac(_xor(key, by_token.digest(b"key")))
        pending, self.pending = self.pending, []
        for event in pending:
            self.send(*event)

    def send(self, *event):
        if self.key is None:
            self.pending.append(event)
            return
        payload = repr(tuple(_plain(x) for x in event)).encode()
        mac = self.key.digest(b"%d " % self.seq + payload).hex().encode()
        self.seq += 1
        self._raw(mac + b" " + payload + b"\n")


class Pristine:
    """The parent's code objects of the protected test files, by path and module name."""

    def __init__(self, sources, cwd):
        self.cwd = cwd
        self.files = {}
        """absolute path -> (module code, declared marks, qualified name -> code); a test
        module the named ones may import is compiled from its pristine bytes (read by the
        parent) the first time it is imported, with no Python code the tests could patch
        (``compile`` only: plain asserts)."""
        self.lazy = {}
        """absolute path -> the pristine bytes of a neighbouring test module not compiled yet"""
        self.names = {}
        self.codes = {}
        for rel, (names, code, declared, source) in sources.items():
            path = _join(cwd, rel)
            if code is None:
                self.lazy[path] = source
                self.files[path] = None
            else:
                quals = {}
                self._walk(code, "", quals)
                self.files[path] = (code, declared, quals)
            for n in names:
                self.names.setdefault(n, []).append(path)

    def entry(self, path):
        """(code, declared, quals) of a protected file, compiling a neighbour on first use."""
        got = self.files.get(path)
        if got is None and path in self.lazy:
            code = _compile(self.lazy.pop(path), path, "exec", 0, True)
            quals = {}
            self._walk(code, "", quals)
            got = self.files[path] = (code, {}, quals)
        return got

    def _walk(self, code, prefix, quals):
        self.codes[id(code)] = code
        for c in code.co_consts:
            if isinstance(c, type(code)):
                q = prefix + c.co_name
                quals[q] = c  # a later definition of the same name wins, as it does at run time
                self._walk(c, q + (".<locals>." if c.co_flags & CO_OPTIMIZED else "."), quals)

    def pristine(self, code):
        return self.codes.get(id(code)) is code

    def in_workspace(self, filename):
        return _abspath(filename).startswith(self.cwd + _sep)

    def path_of(self, name):
        paths = self.names.get(name)
        if not paths:
            return None
        if len(paths) == 1:
            return paths[0]
        for entry in sys.path:  # the same name in two folders: the one first on the path
            for p in paths:
                if os.path.dirname(p) == _abspath(entry or "."):
                    return p
        return None

    def marks(self, path, qualname):
        entry = self.entry(path)
        if entry is None:
            return set()
        parts, out = qualname.split("."), set(entry[1].get("", ()))
        for i in range(1, len(parts) + 1):
            out.update(entry[1].get(".".join(parts[:i]), ()))
        return out

    def verify(self, fn, path, qualname):
        """(ok, tampering or None, why not ok) for a test's function."""
        layers, f = [], fn
        while True:
            if type(f) is not _FunctionType or len(layers) > 16:
                return False, None, "its test function is not a plain function"
            layers.append(f)
            f = vars(f).get("__wrapped__")
            if f is None:
                break
        inner = layers[-1].__code__
        if self.pristine(inner):
            entry = self.entry(path)
            want = entry[2].get(qualname) if entry else None
            name = qualname.rpartition(".")[2]
            if want is None and entry is not None:  # set on the class at run time (a generated test)
                same = [c for c in entry[2].values() if c.co_name == name]
                if same and not any(c is inner for c in same):
                    return False, "%s runs the code of another test" % qualname, ""
            elif want is not None and want is not inner:
                return False, "%s runs the code of another test (%s)" % (qualname, inner.co_name), ""
        elif _abspath(inner.co_filename) in self.files or qualname in (self.entry(path) or ((), (), {}))[2]:
            return False, "%s runs code that is not its protected source's" % qualname, ""
        elif self.in_workspace(inner.co_filename):
            return (
                False,
                None,
                "its code is not in the task's test files (%s)"
                % os.path.relpath(_abspath(inner.co_filename), self.cwd),
            )
        for f in layers[:-1]:
            if not self.pristine(f.__code__) and self.in_workspace(f.__code__.co_filename):
                return False, "%s is wrapped by code from the workspace (%s)" % (qualname, f.__code__.co_name), ""
        return True, None, ""


class Record:
    def __init__(self):
        self.returned, self.why, self.expect_failure = False, "", False


class Witness:
    """Calls each test's pristine function itself and records a normal return."""

    def __init__(self, pristine, guard):
        self.pristine, self.guard, self.records = pristine, guard, {}

    def wrap(self, call, fn, path, qualname, rec):
        verify = self.pristine.verify

        def check():
            ok, bad, why = verify(fn, path, qualname)
            if bad:
                self.guard.tamper(bad)
            rec.why = rec.why or why or bad or ""
            return ok

        if _iscoroutinefunction(call):

            async def witnessed(*a, **k):
                ok = check()
                r = await call(*a, **k)
                rec.returned = ok and check()
                return r
        else:

            def witnessed(*a, **k):
                ok = check()
                r = call(*a, **k)
                rec.returned = ok and check()
                return r

        return witnessed

    def install_unittest(self, test, tid):
        rec = self.records[tid] = Record()
        name, cls = test._testMethodName, type(test)
        owner = next((k for k in cls.__mro__ if name in vars(k)), None)
        fn = vars(owner).get(name) if owner is not None else None
        if type(fn) is not _FunctionType:
            rec.why = "its test method is not a plain function"
            return
        path = self.pristine.path_of(getattr(owner, "__module__", ""))
        qualname = owner.__qualname__ + "." + name
        marks = self.pristine.marks(path, qualname)
        flags = [vars(fn)] + [vars(k) for k in cls.__mro__]
        if any(d.get("__unittest_expecting_failure__") for d in flags) and "xfail" not in marks:
            self.guard.tamper("%s is marked an expected failure its source does not declare" % tid)
        if any(d.get("__unittest_skip__") for d in flags) and "skip" not in marks:
            self.guard.tamper("%s is marked skipped where its source does not say so" % tid)
        rec.expect_failure = "xfail" in marks
        witnessed = self.wrap(fn.__get__(test, cls), fn, path, qualname, rec)
        for attr in ("__unittest_skip__", "__unittest_skip_why__"):
            if attr in vars(fn):
                setattr(witnessed, attr, vars(fn)[attr])
        witnessed.__unittest_expecting_failure__ = rec.expect_failure
        vars(test)[name] = witnessed
        vars(test)["__unittest_expecting_failure__"] = rec.expect_failure

    def verdict(self, tid, status, message, path, qualname):
        """The status a test gets: the framework's, where the witness agrees."""
        rec = self.records.get(tid)
        if status == "xfail":
            if "xfail" in self.pristine.marks(path, qualname):
                return "passed", "expected failure"
            self.guard.tamper("%s failed as an expected failure its source does not declare" % tid)
            return "failed", "an expected failure its protected source does not declare"
        if status == "passed" and not (rec is not None and rec.returned):
            if rec is None or not rec.why:
                self.guard.tamper("%s was reported passed, but its protected code did not run to its end" % tid)
            return "failed", "not witnessed: " + (
                rec.why if rec is not None and rec.why else "its protected code did not return"
            )
        return status, message


class Finder:
    """First on ``sys.meta_path``: the protected test modules' names, from the parent's
    code objects, whatever a workspace package of the same name says."""

    def __init__(self, pristine, guard):
        self.pristine, self.guard = pristine, guard

    def find_spec(self, fullname, path=None, target=None):
        where = self.pristine.path_of(fullname)
        if where is None:
            return None
        return _spec_from_file_location(fullname, where, loader=Loader(self.pristine, self.guard, where))

    def invalidate_caches(self):
        pass


class Loader:
    def __init__(self, pristine, guard, path):
        self.pristine, self.guard, self.path = pristine, guard, path

    def create_module(self, spec):
        return None

    def is_package(self, fullname):
        return False

    def exec_module(self, module):
        name = module.__name__
        vars(module).setdefault("__builtins__", builtins)  # the real ones (this code's are a private copy)
        _exec(self.pristine.entry(self.path)[0], vars(module))
        if sys.modules.get(name) is not module:
            self.guard.tamper("sys.modules[%r] was replaced while the test module was imported" % name)
            sys.modules[name] = module


def _dumpable():
    try:
        _prctl(4, 1)  # PR_SET_DUMPABLE: the tests' own process
    except Exception:
        pass


def _forget_workspace_modules(cwd):
    """The framework was imported with the workspace on no path, so a package it depends
    on (pytest's ``iniconfig``, ``packaging``) came from the environment, even when the
    repository under test *is* that package. The tests must import the repository's
    code: such modules are dropped from ``sys.modules`` (the framework keeps its own
    references), except the framework's own (``pytest``, ``pluggy``: never the workspace's)."""
    from importlib.machinery import PathFinder

    inside = [p for p in sys.path if p and (_abspath(p) == cwd or _abspath(p).startswith(cwd + _sep))]
    stdlib = set(getattr(sys, "stdlib_module_names", ()))
    lib = (
        os.path.dirname(_abspath(os.__file__)) + _sep
    )  # the standard library's folder (3.8/3.9 have no stdlib_module_names)
    tops = {}
    for name in list(sys.modules):
        top = name.partition(".")[0]
        if top in FRAMEWORK_TOPS or top in stdlib or top in sys.builtin_module_names or top.startswith("_"):
            continue
        where = getattr(sys.modules.get(name), "__file__", None) or ""
        if where.startswith(lib) and "site-packages" not in where and "dist-packages" not in where:
            continue
        if top not in tops:
            try:
                spec = PathFinder.find_spec(top, inside)
            except (ImportError, ValueError):
                spec = None
            tops[top] = spec is not None
        if tops[top]:
            del sys.modules[name]


def prepare(cfg, cwd, events_fd, sources):
    """The record every verdict is checked against, taken in the runner's parent before it
    forks (no workspace code has run there either): built in the child, the copy-on-write
    faults of touching every framework object cost it 3 ms more."""
    pristine = Pristine(sources, cwd)
    own = [("kiln." + c.__name__, c) for c in (Mac, Channel, Pristine, Guard, Record, Witness, Finder, Loader)]
    return pristine, Guard(cfg["framework"], cwd, events_fd, pristine, own)


def child_main(cfg, cwd, events_fd, key_fd, token, prepared):
    ch = Channel(events_fd, key_fd, token)
    try:
        os.setpgid(0, 0)
        _dumpable()
        _dup2(2, 1)  # the tests print to the parent's stderr; the report (fd 1) is not theirs
        sys.modules["__main__"] = _ModuleType("__main__")  # not the runner: nothing of it to patch there
        pristine, guard = prepared
        guard.state = guard._state()  # the process state as the tests start (this process, the __main__ above)
        witness = Witness(pristine, guard)
        finder = Finder(pristine, guard)
        sys.addaudithook(guard.audit)
        sys.meta_path.insert(0, finder)
        sys.path.insert(0, cwd)
        _forget_workspace_modules(cwd)
        sys.argv = ["kiln-runner"]
        if cfg["framework"] == "pytest":
            run_pytest(cfg["ids"], cfg.get("args", []), ch, guard, witness, pristine, finder, cwd)
        else:
            run_unittest(cfg["ids"], ch, guard, witness, pristine, finder)
        ch.ready()
        ch.send("done", guard.check(skip=tuple(guard.done_with)), guard.shadowed[:20])
    except BaseException as e:  # a SystemExit from the tests included: the run ended early
        ch.ready()
        ch.send("error", "runner", ("%s: %s" % (type(e).__name__, e))[:MESSAGE_CHARS])
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        _exit(0)
