"""kiln's protected test runner: the only source of a score's test results.

Run inside the scoring sandbox as ``python -I -S -c <source> <config>``
(``kiln.shared.tasks.testrun.runner_command`` builds it: this file, with the test
process's half, ``runner_child.py``, ``runner_guard.py`` and ``runner_drivers.py``, as ``CHILD_SOURCE``; ``<config>`` is base64
of zlib of JSON: ``framework`` (``unittest`` or ``pytest``), ``ids`` (the tests to run),
``args`` (extra pytest arguments), ``timeout_s``, ``test_files`` (the task's test files
and their sha256, optional)). Standard library only, Python 3.8 and later: it runs under
whatever interpreter the task's environment has.

A pass is earned only by the pristine test code running to its end in a pristine
framework. Two processes:
- the *parent* starts before any code of the workspace can run: ``-I`` ignores every
  ``PYTHON*`` variable and the user's site, ``-S`` skips ``site``; it adds the
  environment's site-packages itself (the current directory on no path), imports the
  framework from there, then **reads and compiles the protected test sources itself**
  (the files the ids name and the task's test files; for pytest with pytest's own
  assertion rewriting, so failure messages stay pytest's), notes what each test's source
  declares (``expectedFailure``/``xfail``/skip decorators, read from the syntax tree),
  builds the test process's code in a private namespace whose builtins are a copy taken
  now, makes itself non-dumpable and forks;
- the *child* (``runner_child.py``) snapshots what every verdict depends on, installs an
  audit hook, loads the test modules from the parent's code objects by file location,
  runs exactly the requested ids through kiln's collector and an execution witness, and
  sends authenticated events over a pipe.

Invariants:
- the report is the parent's stdout and nothing else writes there: one JSON document,
  written once, after the child has ended (or was killed at ``timeout_s``);
- the child's ``ready`` (its test modules are imported) is authenticated with a token
  the parent made before the fork; only then does the parent send the event key (made
  after the fork, masked with the token, so bytes read off the key pipe by anyone else
  are useless); every later event carries an HMAC-SHA256 over its sequence number and
  payload, and the parent verifies each one: an event that does not authenticate, or
  comes out of order, is a ``problem``, never a result;
- ``completed`` only when the child's authenticated ``done`` was its last event and it
  then exited with status 0; anything else is an incomplete run, whatever was written;
- every requested id gets exactly one status: from the child's authenticated event for
  it, or ``missing``; a report never says more than the child's runner showed;
- as pid 1 of its sandbox the parent cannot be signalled by the tested code, and its
  exit ends every process the tests left behind.
"""

import ast
import base64
import builtins
import json
import marshal
import os
import sys
import time
import zlib
from _operator import _compare_digest

REPORT_VERSION = 1
MESSAGE_CHARS = 400
MESSAGES_CHARS = 12000
"""Failure messages kept in the report, all tests together: the report must fit in the
sandbox's captured stdout (64 KiB by default) whatever the number of tests."""
CODES = {"passed": "P", "failed": "F", "error": "E", "skipped": "S"}
"""One letter per test in ``statuses`` (``M``: missing)."""
PR_SET_DUMPABLE = 4
KEY_BYTES = 32
MAX_SOURCE_BYTES = 8 << 20
MAX_NEIGHBOUR_BYTES = 32 << 20
MAX_NEIGHBOURS = 5000
# runner_command puts (source, magic, code) of runner_child.py + runner_guard.py + runner_drivers.py here:
CHILD_SOURCE = None
MARKS = {
    "xfail": "xfail",
    "expectedFailure": "xfail",
    "skip": "skip",
    "skipIf": "skip",
    "skipUnless": "skip",
    "skipif": "skip",
}


def _sha256():
    """The built-in sha256 (``hashlib`` would load OpenSSL: milliseconds a run)."""
    for name in ("_sha2", "_sha256"):
        try:
            return __import__(name).sha256
        except (ImportError, AttributeError):
            pass
    import hashlib

    return hashlib.sha256


SHA256 = _sha256()


class Mac:
    """HMAC-SHA256 (RFC 2104) over the built-in sha256; runner_child.py holds the same."""

    def __init__(self, key):
        key = key.ljust(64, b"\0")
        self.inner, self.outer = bytes(k ^ 0x36 for k in key), bytes(k ^ 0x5C for k in key)

    def digest(self, msg):
        return SHA256(self.outer + SHA256(self.inner + msg).digest()).digest()


def _site_packages():
    """The environment's site-packages (and its ``.pth`` files), as ``site.main`` would
    add them, minus user site-packages and the customize hooks."""
    import site

    known = site.removeduppaths()
    if hasattr(site, "venv"):
        known = site.venv(known)
    site.addsitepackages(known)


def prctl(option, arg):
    """``prctl(2)`` through ``_ctypes`` itself: importing ``ctypes`` cost 3 ms a run."""
    try:
        import _ctypes

        return _ctypes.call_function(_ctypes.dlsym(_ctypes.dlopen(None, 0), "prctl"), (option, arg, 0, 0, 0))
    except Exception:  # no such entry points here: the slower, portable way
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(option, arg, 0, 0, 0)


def _set_dumpable(flag):
    try:
        return prctl(PR_SET_DUMPABLE, 1 if flag else 0) == 0
    except Exception:
        return False


def _framework(framework):
    """Import the framework (and what the child's runner uses) with the workspace on no
    path: a ``unittest.py`` or a ``pytest/`` there cannot stand in."""
    import importlib.util  # noqa: F401
    import inspect  # noqa: F401
    import select  # noqa: F401
    import traceback  # noqa: F401
    import types  # noqa: F401
    import unittest  # noqa: F401
    import unittest.case  # noqa: F401
    import unittest.loader  # noqa: F401
    import unittest.result  # noqa: F401
    import unittest.runner  # noqa: F401
    import unittest.suite  # noqa: F401

    if framework == "pytest":
        import _pytest.assertion.rewrite  # noqa: F401
        import _pytest.main  # noqa: F401
        import _pytest.python  # noqa: F401
        import _pytest.reports  # noqa: F401
        import _pytest.runner  # noqa: F401
        import _pytest.skipping  # noqa: F401
        import _pytest.unittest  # noqa: F401
        import pytest  # noqa: F401


def _declared(tree):
    """Qualified name (``""`` for the module) -> the marks its source declares:
    ``xfail`` (``expectedFailure``, ``pytest.mark.xfail``), ``skip``."""
    out = {}

    def marks(exprs):
        found = set()
        for e in exprs:
            for n in ast.walk(e):
                word = n.id if isinstance(n, ast.Name) else n.attr if isinstance(n, ast.Attribute) else None
                if word in MARKS:
                    found.add(MARKS[word])
        return found

    def visit(body, prefix):
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                q = prefix + node.name
                out[q] = out.get(q, set()) | marks(node.decorator_list)
                if isinstance(node, ast.ClassDef):
                    visit(node.body, q + ".")
            elif isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets
            ):
                q = prefix[:-1]
                out[q] = out.get(q, set()) | marks([node.value])

    visit(tree.body, "")
    return {q: sorted(m) for q, m in out.items() if m}


def _module_names(rel):
    """The names a test file may be imported under: its dotted path from the
    repository, from its topmost package (pytest's ``prepend``), and its stem."""
    parts = rel[:-3].split("/")
    names = {".".join(parts), parts[-1]}
    i = len(parts) - 1
    while i > 0 and os.path.isfile(os.path.join(*parts[:i], "__init__.py")):
        i -= 1
    names.add(".".join(parts[i:]))
    return names


def _unittest_file(test_id, cwd):
    """The file and module of a unittest id: the longest dotted prefix that is a file
    under the repository (a module file before a package of the same name)."""
    parts = test_id.split(".")
    for k in range(len(parts), 0, -1):
        base = os.path.join(cwd, *parts[:k])
        for path in (base + ".py", os.path.join(base, "__init__.py")):
            if os.path.isfile(path):
                return os.path.relpath(path, cwd), ".".join(parts[:k])
    return None, None


def _is_test_dir(name):
    """protect.py's rule: a folder the clean room protects whole."""
    return name in ("test", "tests", "testing") or name.startswith("test_") or name.endswith("_tests")


def _neighbours(wanted, cwd):
    """The other test modules the named ones may import (a base class in a sibling
    module, a helper): every ``.py`` of the protected test folder each lives in, or the
    test modules beside it, as protect.py protects them (so the clean room made them
    the task's). Bounded: a huge test tree is read up to ``MAX_NEIGHBOUR_BYTES``."""
    out, seen, budget = [], set(wanted), [MAX_NEIGHBOUR_BYTES, MAX_NEIGHBOURS]

    def add(rel):
        if rel in seen or not rel.endswith(".py") or budget[1] <= 0:
            return
        seen.add(rel)
        budget[1] -= 1
        out.append(rel)

    for rel in list(wanted):
        parts = rel.split("/")[:-1]
        top = next((i for i, name in enumerate(parts) if _is_test_dir(name)), None)
        if top is None:
            folder = os.path.join(cwd, *parts) if parts else cwd
            try:
                names = sorted(os.listdir(folder))
            except OSError:
                continue
            for n in names:
                if (n.startswith("test_") or n.endswith("_test.py")) and n.endswith(".py"):
                    add("/".join(parts + [n]))
            continue
        root = os.path.join(cwd, *parts[: top + 1])
        for where, dirs, files in os.walk(root):
            depth = where[len(root) :].count(os.sep)
            if depth >= 16:
                dirs[:] = []
            dirs.sort()
            for n in sorted(files):
                add(os.path.relpath(os.path.join(where, n), cwd).replace(os.sep, "/"))
    return out


def pristine_sources(cfg, cwd):
    """Read and compile the protected test sources before any workspace code runs:
    ({relative path: [module names, code, declared marks]}, findings)."""
    files, findings = {}, []
    wanted = dict.fromkeys(p for p in (cfg.get("test_files") or {}) if p.endswith(".py"))
    for test_id in cfg["ids"]:
        if cfg["framework"] == "pytest":
            rel = test_id.split("::", 1)[0]
            if rel.endswith(".py"):
                wanted.setdefault(os.path.normpath(rel), None)
        else:
            rel, name = _unittest_file(test_id, cwd)
            if rel is not None:
                wanted.setdefault(rel, name)
    rewrite = None
    if cfg["framework"] == "pytest" and "--assert=plain" not in cfg.get("args", []):
        from _pytest.assertion.rewrite import rewrite_asserts as rewrite
    for rel, id_name in wanted.items():
        path = os.path.join(cwd, rel)
        try:
            with open(path, "rb") as f:
                source = f.read(MAX_SOURCE_BYTES + 1)
        except OSError as e:
            findings.append("test file %s cannot be read (%s)" % (rel, e.strerror))
            continue
        digest = (cfg.get("test_files") or {}).get(rel)
        if digest and SHA256(source).hexdigest() != digest:
            findings.append("test file %s is not the task's" % rel)
            continue
        names = sorted(_module_names(rel) | ({id_name} if id_name else set()))
        if os.path.basename(rel) == "__init__.py" or len(source) > MAX_SOURCE_BYTES:
            continue
        try:
            tree = ast.parse(source, path)
            declared = _declared(tree)
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            continue  # it fails to import in the test process, as it would anyway
        try:
            if rewrite is not None:
                rewrite(tree, source, path, None)
            code = compile(tree, path, "exec", dont_inherit=True)
        except Exception:  # pytest's rewriting failed on it: plain asserts, as `--assert=plain` would
            try:
                code = compile(source, path, "exec", dont_inherit=True)
            except (SyntaxError, ValueError, RecursionError, MemoryError):
                continue
        files[rel] = [names, code, declared, None]
    # Their neighbours' bytes are read now, compiled (plain) only if the tests import them.
    budget = MAX_NEIGHBOUR_BYTES
    for rel in _neighbours(wanted, cwd):
        if os.path.basename(rel) == "__init__.py":
            continue
        path = os.path.join(cwd, rel)
        try:
            if not os.path.isfile(path) or os.path.islink(path):
                continue
            with open(path, "rb") as f:
                source = f.read(min(budget, MAX_SOURCE_BYTES) + 1)
        except OSError:
            continue
        if len(source) > min(budget, MAX_SOURCE_BYTES):
            continue
        digest = (cfg.get("test_files") or {}).get(rel)
        if digest and SHA256(source).hexdigest() != digest:
            findings.append("test file %s is not the task's" % rel)
            continue
        budget -= len(source)
        stem = os.path.basename(rel)[:-3]
        names = _module_names(rel)
        if not (stem.startswith("test") or stem.endswith("_test") or stem == "conftest"):
            names.discard(stem)  # a helper's bare name (`utils`) may be the code's own module
        files[rel] = [sorted(names), None, {}, source]
    return files, findings


def _child_namespace():
    """The test process's code, defined now (before any workspace code runs) in its own
    namespace: its builtins are a copy, so no later patch of ``builtins`` or of
    ``__main__`` reaches the functions the verdict depends on."""
    from importlib.util import MAGIC_NUMBER

    source, magic, compiled = CHILD_SOURCE
    if MAGIC_NUMBER.hex() == magic:  # kiln's own compilation, for this bytecode version
        code = marshal.loads(zlib.decompress(base64.b64decode(compiled)))
    else:
        code = compile(
            zlib.decompress(base64.b64decode(source)).decode(), "<kiln-runner-child>", "exec", dont_inherit=True
        )
    ns = {"__builtins__": dict(vars(builtins)), "__name__": "kiln-runner-child", "_prctl": prctl}
    exec(code, ns)
    return ns


def read_events(fd, key_fd, token, key, pid, timeout_s):
    """(events, problems, timed out, wait status): reads until the child has ended and its
    pipe is drained (a grandchild holding the pipe open does not hold the run), or kills
    the child's group at the deadline. The key goes out once, on the child's ``ready``."""
    import select

    deadline = time.monotonic() + timeout_s
    buf, timed_out, status, events, problems, seq = b"", False, None, [], [], 0
    keyed, by_token, by_key = False, Mac(token), Mac(key)

    def take(line):
        nonlocal keyed, seq
        if not keyed:
            if _compare_digest(line, b"ready " + by_token.digest(b"ready").hex().encode()):
                keyed = True
                mask = by_token.digest(b"key")
                out = bytes(a ^ b for a, b in zip(key, mask))
                while out:
                    out = out[os.write(key_fd, out) :]
                os.close(key_fd)
            else:
                problems.append("unauthenticated output before the runner was ready: %r" % line[:60])
            return
        mac, _, payload = line.partition(b" ")
        want = by_key.digest(b"%d " % seq + payload).hex().encode()
        if not _compare_digest(mac, want):
            problems.append("an event that does not authenticate: %r" % line[:60])
            return
        seq += 1
        try:
            event = ast.literal_eval(payload.decode("utf-8"))
        except (ValueError, SyntaxError, UnicodeDecodeError, MemoryError, RecursionError):
            problems.append("a malformed event")
            return
        events.append(event)

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
            *lines, buf = buf.split(b"\n")
            for line in lines:
                if line.strip():
                    take(line)
            continue
        if status is not None:  # ended, and nothing more to read
            break
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
    if buf.strip():
        problems.append("an unterminated event")
    try:
        os.killpg(pid, 9)
    except OSError:
        pass
    if status is None:
        _, status = os.waitpid(pid, 0)
    if not keyed:
        os.close(key_fd)
    return events, problems, timed_out, status


def report(cfg, events, problems, timed_out, status, seconds, findings):
    ids = cfg["ids"]
    wanted = {test_id: i for i, test_id in enumerate(ids)}
    results = [None] * len(ids)
    errors, tampered, shadowed, done, extra, exit_code = [], list(findings), [], False, 0, None
    for e in events:
        kind = e[0] if isinstance(e, tuple) and e else None
        if done:
            problems.append("an event after the runner's end")
            done = False
            break
        if kind == "result" and len(e) == 5:
            i = wanted.get(e[1])
            if i is None:
                extra += 1
            elif results[i] is not None:
                problems.append("two results for %s" % ids[i])
                results[i] = "duplicate"
            else:
                results[i] = [e[2], str(e[3])[:MESSAGE_CHARS]]
        elif kind == "error" and len(e) == 3:
            errors.append([str(e[1])[:200], str(e[2])[:MESSAGE_CHARS]])
        elif kind == "exit" and len(e) == 2:
            exit_code = e[1]
        elif kind == "done" and len(e) == 3:
            done = True
            tampered += [str(x) for x in e[1]]
            shadowed = [str(x) for x in e[2]]
        else:
            problems.append("an event kiln's runner never sends: %r" % (str(e)[:100],))
    exited_ok = os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
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
        "tampered": tampered[:50],
        "shadowed": shadowed,
        "completed": done and exited_ok and not timed_out,
        "timed_out": timed_out,
        "child_exit": os.WEXITSTATUS(status) if os.WIFEXITED(status) else None,
        "child_signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
        "pytest_exit": exit_code if isinstance(exit_code, int) else None,
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
    # The framework is imported with the workspace on no path, then the paths an
    # editable install gave it come back after.
    inside = [p for p in sys.path if os.path.abspath(p) == cwd or os.path.abspath(p).startswith(cwd + os.sep)]
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if p not in inside]
    _framework(cfg["framework"])
    sys.path[:] = saved
    sources, findings = pristine_sources(cfg, cwd)
    ns = _child_namespace()
    _set_dumpable(False)
    token = os.urandom(KEY_BYTES)
    read_fd, write_fd = os.pipe()
    key_read, key_write = os.pipe()
    prepared = ns["prepare"](cfg, cwd, write_fd, sources)
    sys.stdout.flush()
    sys.stderr.flush()
    import gc

    gc.freeze()  # the child's collector then never walks (and copies) the parent's objects: 5 ms a run
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.close(key_write)
        ns["child_main"](cfg, cwd, write_fd, key_read, token, prepared)
    os.close(write_fd)
    os.close(key_read)
    key = os.urandom(KEY_BYTES)  # made after the fork: the test process never held it
    events, problems, timed_out, status = read_events(read_fd, key_write, token, key, pid, float(cfg["timeout_s"]))
    out = json.dumps(report(cfg, events, problems, timed_out, status, time.monotonic() - t0, findings)).encode()
    while out:
        out = out[os.write(1, out) :]
    os._exit(0)  # nothing left to finalise: the report is written


if __name__ == "__main__":
    main()
