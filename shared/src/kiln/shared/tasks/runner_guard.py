"""What every verdict of kiln's runner depends on, recorded before any workspace code
runs and checked after every test and at the end (``Guard``). Not a module of its own:
``runner_command`` appends this source to ``runner_child.py``'s (one namespace, one
program), so the names it uses (``CORE``, ``REPORT_PATH``, the captured ``_fstat``...)
are that file's.

Invariants: ``check`` reports every difference from the recorded state as tampering
(``found``), a module of the framework loaded from the workspace included; a ``Seal``
only lets ``check`` skip a namespace whose keys, values and functions' code are all
identical (by identity) to what it last found clean, so the fast path never accepts a
state the full comparison would refuse.
"""

import builtins
import os
import sys
import threading


def _attrs(obj):
    out = {}
    for k, v in list(vars(obj).items()):
        f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
        if f is not v or callable(v):
            out[k] = (id(v), id(getattr(f, "__code__", None)) if type(f) is _FunctionType else 0)
    return out


class Seal:
    """A target's namespace as it was last found clean, checked at C speed: its keys, its
    values and everything its functions reference (their code, globals, defaults,
    closure: one ``gc.get_referents`` call) are the very same objects, compared with
    ``is`` (``id()`` and each ``__code__`` read would run the audit hook once per object).
    Holding them keeps every one alive, so none can be replaced by another at its
    address; any difference sends ``Guard.check`` to the full comparison."""

    def __init__(self, obj):
        d = vars(obj)
        self.keys, self.values = list(d), list(d.values())
        self.funcs = [
            f
            for f in (
                v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
                for v in self.values
            )
            if type(f) is _FunctionType
        ]
        self.refs = _get_referents(*self.funcs) if self.funcs else []

    def holds(self, obj):
        d = vars(obj)
        return (
            _same(self.keys, list(d))
            and _same(self.values, list(d.values()))
            and _same(self.refs, _get_referents(*self.funcs) if self.funcs else [])
        )


def _same(a, b):
    return len(a) == len(b) and all(map(_is, a, b))


class Guard:
    """What every verdict depends on, recorded before any workspace code runs; ``check``
    lists every difference (``found``: tampering)."""

    def __init__(self, framework, cwd, fd, pristine, own):
        self.cwd, self.fd, self.pristine = cwd, fd, pristine
        self.found, self.shadowed, self.done_with = [], [], set()
        self.stdlib = set(getattr(sys, "stdlib_module_names", ()))
        self.loaded = set(sys.modules)
        tops = FRAMEWORK_TOPS if framework == "pytest" else ("unittest",)
        self.targets = [("builtins", builtins)] + own
        for name in sorted(sys.modules):
            m = sys.modules[name]
            if name.partition(".")[0] in tops and isinstance(m, _ModuleType):
                self.targets.append((name, m))
                self.targets += [
                    (name + "." + k, v)
                    for k, v in sorted(vars(m).items())
                    if isinstance(v, type) and getattr(v, "__module__", None) == name
                ]
        self.core = [
            (n, o)
            for n, o in self.targets
            if n == "builtins"
            or n.startswith("kiln.")
            or n in CORE
            or n.rpartition(".")[0] in CORE
            or framework == "unittest"
        ]
        self.before = {n: _attrs(o) for n, o in self.targets}
        self.seals = {n: Seal(o) for n, o in self.targets}
        self.state = self._state()

    def watch(self, name, obj):
        """Record one more target (kiln's own collector or plugin, made after ``__init__``)."""
        self.targets.append((name, obj))
        self.before[name] = _attrs(obj)
        self.seals[name] = Seal(obj)

    def tamper(self, what):
        if what not in self.found:
            self.found.append(what)

    def _state(self):
        s = {
            "sys.getprofile()": id(_getprofile()),
            "sys.gettrace()": id(_gettrace()),
            "threading's profile hook": id(getattr(threading, "_profile_hook", None)),
            "threading's trace hook": id(getattr(threading, "_trace_hook", None)),
            "sys.modules['__main__']": id(sys.modules.get("__main__")),
        }
        for name in REPORT_PATH:
            s["os." + name] = id(getattr(os, name, None))
        mon = getattr(sys, "monitoring", None)
        for i in range(6) if mon is not None else ():
            s["sys.monitoring tool %d" % i] = (mon.get_tool(i), mon.get_events(i))
        try:
            st = _fstat(self.fd)
            s["the event channel"] = (st.st_dev, st.st_ino)
        except OSError:
            s["the event channel"] = None
        return s

    def audit(self, event, args):
        try:
            if event == "object.__setattr__":
                if (
                    len(args) > 1
                    and args[1] == "__code__"
                    and type(args[0]) is _FunctionType
                    and self.pristine.pristine(args[0].__code__)
                ):
                    self.tamper("the code of %s was replaced" % args[0].__qualname__)
            elif event in ("sys.settrace", "sys.setprofile", "sys.monitoring.register_callback"):
                self.tamper(event + " was called during the tests")
        except Exception:  # an audit hook that raises would fail the audited operation
            pass

    def _from_workspace(self, v):
        f = v.__func__ if isinstance(v, (staticmethod, classmethod)) else v.fget if isinstance(v, property) else v
        if type(f) is _FunctionType:
            return self.pristine.in_workspace(f.__code__.co_filename)
        if isinstance(f, type):
            where = getattr(sys.modules.get(getattr(f, "__module__", "")), "__file__", None)
            return bool(where) and self.pristine.in_workspace(where)
        return False

    def rebase(self, tops):
        """Take pytest's plugins' own changes into the record (``legacypath`` adds
        properties at configure time, hypothesis wraps a fixture method): a change to
        a module under ``tops`` made with code from outside the workspace is theirs;
        one made with the workspace's code is tampering."""
        for name, obj in self.targets:
            if name.partition(".")[0] not in tops:
                continue
            now = _attrs(obj)
            for attr in set(now) - set(self.before[name]) | {a for a in now if now[a] != self.before[name].get(a)}:
                if self._from_workspace(vars(obj)[attr]):
                    self.tamper("%s.%s" % (name, attr))
            self.before[name] = now
            self.seals[name] = Seal(obj)

    def check(self, full=True, skip=()):
        for name in sorted(sys.modules.keys() - self.loaded, key=str):
            self.loaded.add(name)
            top = name.partition(".")[0]
            if top not in self.stdlib and top not in FRAMEWORK_TOPS:
                continue
            where = getattr(sys.modules.get(name), "__file__", None) or ""
            if where and self.pristine.in_workspace(where):
                what = "module %s from the workspace (%s)" % (name, os.path.relpath(_abspath(where), self.cwd))
                (self.found if top in FRAMEWORK_TOPS else self.shadowed).append(what)
        for name, obj in self.targets if full else self.core:
            if name.partition(".")[0] in skip or self.seals[name].holds(obj):
                continue
            was, now = self.before[name], _attrs(obj)
            found = len(self.found)
            if was != now:
                for attr in sorted(set(was) | set(now)):
                    if was.get(attr) == now.get(attr):
                        continue
                    if attr in was or self._from_workspace(
                        vars(obj)[attr]
                    ):  # new ones: lazy imports are the framework's own
                        self.tamper("%s.%s" % (name, attr))
            if len(self.found) == found:  # clean (new attributes the framework's own): the next check starts here
                self.seals[name] = Seal(obj)
        for what, value in self._state().items():
            if self.state[what] != value:
                self.tamper(what + " changed")
        return self.found
