"""Regenerate the built-in suite (``builtin.jsonl``): ``python -m kiln.shared.tasks.make_builtin``.

Each task is a one-module repository with a one-line bug and a unittest file. The
generator runs the tests on the buggy and on the fixed module and derives
``fail_to_pass`` / ``pass_to_pass`` from what actually happened, so a task whose bug
does not break a test, or whose fix does not make them pass, is refused.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

from kiln.shared.tasks import BUILTIN, Task
from kiln.shared.tasks.report import parse_test_report

# (module, function source with the bug, (buggy line, fixed line), tests as (name, body), problem statement)
SPECS: list[tuple[str, str, tuple[str, str], list[tuple[str, str]], str]] = [
    (
        "calc",
        "def add(a, b):\n    return a - b\n",
        ("a - b", "a + b"),
        [("test_add_positive", "self.assertEqual(add(2, 3), 5)"), ("test_add_zero", "self.assertEqual(add(0, 0), 0)")],
        "add(a, b) should return the sum of a and b.",
    ),
    (
        "parity",
        "def is_even(n):\n    return n % 2 == 1\n",
        ("n % 2 == 1", "n % 2 == 0"),
        [("test_even", "self.assertTrue(is_even(4))"), ("test_odd", "self.assertFalse(is_even(7))")],
        "is_even(n) should be True exactly when n is even.",
    ),
    (
        "bounds",
        "def clamp(x, lo, hi):\n    return max(lo, min(x, lo))\n",
        ("min(x, lo)", "min(x, hi)"),
        [
            ("test_inside", "self.assertEqual(clamp(5, 0, 10), 5)"),
            ("test_below", "self.assertEqual(clamp(-3, 0, 10), 0)"),
            ("test_above", "self.assertEqual(clamp(12, 0, 10), 10)"),
        ],
        "clamp(x, lo, hi) should limit x to the range [lo, hi].",
    ),
    (
        "fact",
        "def factorial(n):\n    out = 1\n    for i in range(1, n):\n        out *= i\n    return out\n",
        ("range(1, n)", "range(1, n + 1)"),
        [("test_zero", "self.assertEqual(factorial(0), 1)"), ("test_five", "self.assertEqual(factorial(5), 120)")],
        "factorial(n) should return n! (with 0! = 1).",
    ),
    (
        "vowels",
        "def count_vowels(s):\n    return sum(1 for ch in s.lower() if ch in 'aeio')\n",
        ("'aeio'", "'aeiou'"),
        [
            ("test_word", "self.assertEqual(count_vowels('banana'), 3)"),
            ("test_u", "self.assertEqual(count_vowels('sun'), 1)"),
        ],
        "count_vowels(s) should count the vowels a, e, i, o, u in s, ignoring case.",
    ),
    (
        "biggest",
        "def max_of(xs):\n    best = 0\n    for x in xs:\n        if x > best:\n            best = x\n    return best\n",
        ("best = 0", "best = xs[0]"),
        [
            ("test_positive", "self.assertEqual(max_of([1, 5, 3]), 5)"),
            ("test_negative", "self.assertEqual(max_of([-4, -2, -9]), -2)"),
        ],
        "max_of(xs) should return the largest element of a non-empty list.",
    ),
    (
        "stats",
        "def average(xs):\n    return sum(xs) / (len(xs) + 1)\n",
        ("(len(xs) + 1)", "len(xs)"),
        [("test_simple", "self.assertEqual(average([2, 4]), 3)"), ("test_single", "self.assertEqual(average([7]), 7)")],
        "average(xs) should return the arithmetic mean of xs.",
    ),
    (
        "palin",
        "def is_palindrome(s):\n    return s == s[1:][::-1]\n",
        ("s[1:][::-1]", "s[::-1]"),
        [
            ("test_yes", "self.assertTrue(is_palindrome('level'))"),
            ("test_no", "self.assertFalse(is_palindrome('kiln'))"),
        ],
        "is_palindrome(s) should be True when s reads the same backwards.",
    ),
    (
        "temp",
        "def c_to_f(c):\n    return c * 9 / 5 + 23\n",
        ("+ 23", "+ 32"),
        [("test_freezing", "self.assertEqual(c_to_f(0), 32)"), ("test_boiling", "self.assertEqual(c_to_f(100), 212)")],
        "c_to_f(c) should convert degrees Celsius to Fahrenheit.",
    ),
    (
        "lists",
        "def last_item(xs):\n    return xs[0]\n",
        ("xs[0]", "xs[-1]"),
        [
            ("test_last", "self.assertEqual(last_item([1, 2, 3]), 3)"),
            ("test_one", "self.assertEqual(last_item([9]), 9)"),
        ],
        "last_item(xs) should return the last element of xs.",
    ),
    (
        "squares",
        "def square(x):\n    return x * 2\n",
        ("x * 2", "x * x"),
        [("test_three", "self.assertEqual(square(3), 9)"), ("test_two", "self.assertEqual(square(2), 4)")],
        "square(x) should return x squared.",
    ),
    (
        "dist",
        "def abs_diff(a, b):\n    return a - b\n",
        ("a - b", "abs(a - b)"),
        [
            ("test_forward", "self.assertEqual(abs_diff(5, 3), 2)"),
            ("test_backward", "self.assertEqual(abs_diff(3, 5), 2)"),
        ],
        "abs_diff(a, b) should return the absolute difference of a and b.",
    ),
    (
        "series",
        "def sum_to(n):\n    return sum(range(n))\n",
        ("range(n)", "range(n + 1)"),
        [("test_ten", "self.assertEqual(sum_to(10), 55)"), ("test_zero", "self.assertEqual(sum_to(0), 0)")],
        "sum_to(n) should return 1 + 2 + ... + n.",
    ),
    (
        "powers",
        "def power(a, b):\n    return a * b\n",
        ("a * b", "a ** b"),
        [("test_cube", "self.assertEqual(power(2, 3), 8)"), ("test_square", "self.assertEqual(power(2, 2), 4)")],
        "power(a, b) should return a raised to the power b.",
    ),
    (
        "signs",
        "def is_positive(x):\n    return x >= 0\n",
        ("x >= 0", "x > 0"),
        [("test_zero", "self.assertFalse(is_positive(0))"), ("test_one", "self.assertTrue(is_positive(1))")],
        "is_positive(x) should be True only for numbers strictly greater than zero.",
    ),
    (
        "csv",
        "def join_csv(items):\n    return ';'.join(items)\n",
        ("';'", "','"),
        [
            ("test_three", "self.assertEqual(join_csv(['a', 'b', 'c']), 'a,b,c')"),
            ("test_one", "self.assertEqual(join_csv(['x']), 'x')"),
        ],
        "join_csv(items) should join the strings with commas.",
    ),
    (
        "doubler",
        "def double_all(xs):\n    return [x + 2 for x in xs]\n",
        ("x + 2", "x * 2"),
        [
            ("test_values", "self.assertEqual(double_all([1, 5]), [2, 10])"),
            ("test_empty", "self.assertEqual(double_all([]), [])"),
        ],
        "double_all(xs) should return a list with every element doubled.",
    ),
    (
        "chars",
        "def first_char(s):\n    return s[1]\n",
        ("s[1]", "s[0]"),
        [
            ("test_word", "self.assertEqual(first_char('kiln'), 'k')"),
            ("test_pair", "self.assertEqual(first_char('ab'), 'a')"),
        ],
        "first_char(s) should return the first character of s.",
    ),
    (
        "lows",
        "def min_of(xs):\n    return max(xs)\n",
        ("max(xs)", "min(xs)"),
        [("test_min", "self.assertEqual(min_of([3, 1, 2]), 1)"), ("test_same", "self.assertEqual(min_of([4, 4]), 4)")],
        "min_of(xs) should return the smallest element of xs.",
    ),
    (
        "fizz",
        "def divisible(n, d):\n    return n % d == 1\n",
        ("n % d == 1", "n % d == 0"),
        [("test_yes", "self.assertTrue(divisible(9, 3))"), ("test_no", "self.assertFalse(divisible(10, 3))")],
        "divisible(n, d) should be True when d divides n.",
    ),
    (
        "strings",
        "def shout(s):\n    return s.lower() + '!'\n",
        ("s.lower()", "s.upper()"),
        [("test_hi", "self.assertEqual(shout('hi'), 'HI!')"), ("test_mixed", "self.assertEqual(shout('Ok'), 'OK!')")],
        "shout(s) should return s in upper case followed by '!'.",
    ),
    (
        "counting",
        "def count_words(s):\n    return len(s.split(' ')) - 1\n",
        ("len(s.split(' ')) - 1", "len(s.split())"),
        [
            ("test_three", "self.assertEqual(count_words('a b c'), 3)"),
            ("test_one", "self.assertEqual(count_words('word'), 1)"),
        ],
        "count_words(s) should return the number of whitespace-separated words in s.",
    ),
    (
        "rect",
        "def area(w, h):\n    return w + h\n",
        ("w + h", "w * h"),
        [("test_square", "self.assertEqual(area(3, 3), 9)"), ("test_rect", "self.assertEqual(area(2, 5), 10)")],
        "area(w, h) should return the area of a w by h rectangle.",
    ),
    (
        "negate",
        "def negate_all(xs):\n    return [x for x in xs]\n",
        ("[x for x in xs]", "[-x for x in xs]"),
        [
            ("test_values", "self.assertEqual(negate_all([1, -2]), [-1, 2])"),
            ("test_empty", "self.assertEqual(negate_all([]), [])"),
        ],
        "negate_all(xs) should return a list with every element negated.",
    ),
]

HELDOUT_EVERY = 4
"""Every fourth task goes to the ``heldout`` split (evaluation only)."""


def _fn_name(src: str) -> str:
    return src.split("def ", 1)[1].split("(", 1)[0]


def build_task(index: int, spec) -> Task:
    module, source, (bug, fix), tests, statement = spec
    assert source.count(bug) == 1, f"{module}: bug text must occur exactly once"
    fixed = source.replace(bug, fix)
    fn = _fn_name(source)
    test_src = (
        f"import unittest\n\nfrom {module} import {fn}\n\n\nclass Test{module.capitalize()}(unittest.TestCase):\n"
        + "".join(f"    def {name}(self):\n        {body}\n\n" for name, body in tests)
        + "\nif __name__ == '__main__':\n    unittest.main()\n"
    )
    test_file = f"test_{module}.py"
    cmd = f"python3 -m unittest -v {test_file[:-3]}"
    before = _run({f"{module}.py": source, test_file: test_src}, cmd)
    after = _run({f"{module}.py": fixed, test_file: test_src}, cmd)
    ids = sorted(after)
    if len(ids) != len(tests) or any(s.value != "passed" for s in after.values()):
        raise ValueError(f"{module}: the fix does not pass every test: {after}")
    f2p = [t for t in ids if before.get(t, None) is None or before[t].value != "passed"]
    p2p = [t for t in ids if t not in f2p]
    if not f2p:
        raise ValueError(f"{module}: the bug breaks no test")
    return Task(
        id=f"fix-{module}",
        problem_statement=f"The function `{fn}` in `{module}.py` has a bug. {statement} "
        f"Fix `{module}.py` so that the tests in `{test_file}` pass.",
        files={f"{module}.py": source, test_file: test_src},
        test_files={test_file: test_src},
        test_command=cmd,
        fail_to_pass=f2p,
        pass_to_pass=p2p,
        split="heldout" if index % HELDOUT_EVERY == HELDOUT_EVERY - 1 else "train",
        solution={f"{module}.py": fixed},
        timeout_s=30.0,
        metadata={"family": "one-line-fix", "bug": bug, "fix": fix, "module": f"{module}.py"},
    )


def _run(files: dict[str, str], cmd: str):
    with tempfile.TemporaryDirectory() as d:
        for name, text in files.items():
            Path(d, name).write_text(text)
        out = subprocess.run(cmd, shell=True, cwd=d, capture_output=True, text=True, timeout=60)
        return parse_test_report(out.stdout + out.stderr)


def main() -> None:
    tasks = [build_task(i, s) for i, s in enumerate(SPECS)]
    BUILTIN.write_text("".join(json.dumps(t.model_dump(), sort_keys=True) + "\n" for t in tasks))
    print(f"wrote {len(tasks)} tasks to {BUILTIN}", file=sys.stderr)


if __name__ == "__main__":
    main()
