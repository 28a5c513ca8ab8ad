"""Column types that store any text: the one place rows are made safe to write.

Records carry text the workspace controls (test output, failure messages, the runner's
report, the agent's observations), and PostgreSQL refuses some of it: a NUL character in
a ``text`` column, and a lone surrogate anywhere (it is not UTF-8). Refused, the row is
never written and the trajectory never scored. So every string column of the models is
a ``SafeString``/``SafeText`` and every JSON column a ``SafeJSON`` (a test checks that
none is left plain), and their values are cleaned as they are bound, whoever writes them:

- NUL becomes U+2400 (SYMBOL FOR NULL, "␀") and a lone surrogate U+FFFD: the same
  length, visible, never refused (the whole output is kept as bytes in the
  ``kiln-reward-logs`` object store for whoever needs it exactly);
- JSON values are cleaned in every string, keys included; a value nested deeper than
  ``MAX_JSON_DEPTH`` is stored as a note instead (no parser or serializer recursion on
  the way in or out).
"""

from __future__ import annotations

import re

from sqlalchemy import JSON, String, Text
from sqlalchemy.types import TypeDecorator

NUL_MARK = "\u2400"
MAX_JSON_DEPTH = 64
TOO_DEEP = f"[nested deeper than {MAX_JSON_DEPTH} levels: not stored]"
_SURROGATE = re.compile("[\ud800-\udfff]")


def clean_text(value: str) -> str:
    if "\0" in value:
        value = value.replace("\0", NUL_MARK)
    if not value.isascii() and _SURROGATE.search(value):
        value = _SURROGATE.sub("\ufffd", value)
    return value


def clean_json(value: object, depth: int = 0) -> object:
    """``value`` with every string cleaned (``clean_text``) and depth bounded."""
    if isinstance(value, str):
        return clean_text(value)
    if isinstance(value, (dict, list, tuple)) and depth >= MAX_JSON_DEPTH:
        return TOO_DEEP
    if isinstance(value, dict):
        return {clean_text(k) if isinstance(k, str) else k: clean_json(v, depth + 1) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_json(v, depth + 1) for v in value]
    return value


class SafeString(TypeDecorator):
    impl = String
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return clean_text(value) if isinstance(value, str) else value


class SafeText(TypeDecorator):
    impl = Text
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return clean_text(value) if isinstance(value, str) else value


class SafeJSON(TypeDecorator):
    impl = JSON
    cache_ok = True

    def process_bind_param(self, value, dialect):
        return clean_json(value) if value is not None else None
