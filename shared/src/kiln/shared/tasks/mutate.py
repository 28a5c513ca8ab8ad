"""Procedural bugs for synthesized tasks (``kiln tasks synth``, SWE-smith style): AST
mutations of one function of a Python source file, rendered by splicing the mutated node's
``ast.unparse`` text into the original bytes at the node's position, so the rest of the
file stays byte-identical (comments, formatting, every other line).

Kinds:

- ``compare``: a comparison operator swapped (``<``/``<=``, ``>``/``>=``, ``==``/``!=``,
  ``in``/``not in``, ``is``/``is not``);
- ``binop``: an arithmetic operator (``+``/``-``, ``*``/``//``) or a boolean one
  (``and``/``or``) swapped;
- ``constant``: an int off by one, ``True``/``False`` flipped, a string emptied, a
  non-None constant replaced by ``None``;
- ``remove``: a ``return``, assignment or call statement removed from a function body
  (a block is never left empty);
- ``negate``: an ``if``/``while``/conditional expression's condition negated.

A mutation is only offered when the spliced text parses back to exactly the mutated tree
(``ast.dump`` equal), so what the file says is what the mutation meant.
"""

from __future__ import annotations

import ast
import copy
from dataclasses import dataclass

KINDS = ("compare", "binop", "constant", "remove", "negate")

_COMPARE_SWAP = {
    ast.Lt: ast.LtE,
    ast.LtE: ast.Lt,
    ast.Gt: ast.GtE,
    ast.GtE: ast.Gt,
    ast.Eq: ast.NotEq,
    ast.NotEq: ast.Eq,
    ast.In: ast.NotIn,
    ast.NotIn: ast.In,
    ast.Is: ast.IsNot,
    ast.IsNot: ast.Is,
}
_BINOP_SWAP = {ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.FloorDiv, ast.FloorDiv: ast.Mult}
_BOOL_SWAP = {ast.And: ast.Or, ast.Or: ast.And}


@dataclass(frozen=True)
class Mutation:
    path: str
    """File (relative to the repository)."""
    function: str
    """Qualified name of the function mutated (``Class.method``)."""
    kind: str
    """One of ``KINDS``."""
    description: str
    """What changed, for metadata and logs (never shown to the agent)."""
    lineno: int
    end_lineno: int
    original: str
    """The original file."""
    mutated: str
    """The file with the mutation spliced in."""
    before: str
    """The original text of the region replaced (the solution's line(s))."""
    after: str
    """The text put in its place ("" for a removed statement)."""


def _functions(tree: ast.AST):
    """(qualified name, function node) for every function, methods and nested ones included."""

    def walk(node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = f"{prefix}{child.name}"
                yield name, child
                yield from walk(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                yield from walk(child, f"{prefix}{child.name}.")
            else:
                yield from walk(child, prefix)

    yield from walk(tree, "")


def _own_nodes(func: ast.AST):
    """Nodes of ``func``'s body that belong to it, not to a nested function or class, and
    are not its docstring, decorators, annotations or default arguments."""
    body = list(func.body)
    if (
        body
        and isinstance(body[0], ast.Expr)
        and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)
    ):
        body = body[1:]
    stack = list(reversed(body))
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        for child in reversed(list(ast.iter_child_nodes(node))):
            if isinstance(node, (ast.AnnAssign, ast.arg)) and child is getattr(node, "annotation", None):
                continue
            if isinstance(child, ast.JoinedStr):
                continue  # f-string parts render differently: left alone
            stack.append(child)


def _blocks(func: ast.AST):
    """Statement lists inside ``func`` (its body and nested blocks), not nested functions'."""
    out = [func.body]
    for node in _own_nodes(func):
        if isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                    out.append(block)
            for h in getattr(node, "handlers", []) or []:
                out.append(h.body)
            for case in getattr(node, "cases", []) or []:
                out.append(case.body)
    return out


def _sites(func: ast.AST):
    """(kind, node, replacement-factory, description) of every mutation of ``func``."""
    for node in _own_nodes(func):
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _COMPARE_SWAP:
                    new = _COMPARE_SWAP[type(op)]
                    yield (
                        "compare",
                        node,
                        _replace_op(node, i, new),
                        f"comparison {type(op).__name__} -> {new.__name__}",
                    )
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINOP_SWAP:
            new = _BINOP_SWAP[type(node.op)]
            yield "binop", node, _with(node, op=new()), f"operator {type(node.op).__name__} -> {new.__name__}"
        elif isinstance(node, ast.BoolOp) and type(node.op) in _BOOL_SWAP:
            new = _BOOL_SWAP[type(node.op)]
            yield "binop", node, _with(node, op=new()), f"boolean {type(node.op).__name__} -> {new.__name__}"
        elif isinstance(node, ast.Constant):
            v = node.value
            if isinstance(v, bool):
                yield "constant", node, _with(node, value=not v), f"constant {v} -> {not v}"
            elif isinstance(v, int):
                yield "constant", node, _with(node, value=v + 1), f"constant {v} -> {v + 1}"
            elif isinstance(v, str) and v:
                yield "constant", node, _with(node, value=""), f"constant {v!r} -> ''"
            if v is not None and v is not Ellipsis and not isinstance(v, bool):
                yield "constant", node, _with(node, value=None), f"constant {v!r} -> None"
        elif isinstance(node, (ast.If, ast.While)):
            yield (
                "negate",
                node.test,
                _with(node.test, _negate=True),
                f"condition of {type(node).__name__.lower()} negated",
            )
        elif isinstance(node, ast.IfExp):
            yield "negate", node.test, _with(node.test, _negate=True), "condition of a conditional expression negated"
    for block in _blocks(func):
        if len(block) < 2:
            continue
        for stmt in block:
            if isinstance(stmt, (ast.Return, ast.Assign, ast.AugAssign, ast.AnnAssign)) or (
                isinstance(stmt, ast.Expr) and isinstance(stmt.value, (ast.Call, ast.Await))
            ):
                yield "remove", stmt, None, f"{type(stmt).__name__.lower()} statement removed"


def _replace_op(node: ast.Compare, i: int, new) -> dict:
    ops = list(node.ops)
    ops[i] = new()
    return {"ops": ops}


def _with(node: ast.AST, **fields) -> dict:
    return fields


def _mutated_node(node: ast.AST, change: dict) -> ast.AST:
    if change.get("_negate"):
        return ast.UnaryOp(op=ast.Not(), operand=copy.deepcopy(node))
    new = copy.copy(node)
    for k, v in change.items():
        setattr(new, k, v)
    return new


def _offsets(src: bytes) -> list[int]:
    starts, pos = [0], 0
    for line in src.splitlines(keepends=True):
        pos += len(line)
        starts.append(pos)
    return starts


@dataclass(frozen=True, eq=False)
class Site:
    """A mutation not yet rendered (cheap to list; ``render`` checks and splices it)."""

    file: _File
    function: str
    kind: str
    node: ast.AST
    change: dict | None
    description: str

    def render(self) -> Mutation | None:
        return self.file.render(self)


class _File:
    def __init__(self, path: str, source: str, tree: ast.Module):
        self.path, self.source, self.tree = path, source, tree
        self.src = source.encode()
        self.starts = _offsets(self.src)
        self.parents: dict[int, tuple[ast.AST, str, int | None]] = {}
        for parent in ast.walk(tree):
            for field, value in ast.iter_fields(parent):
                if isinstance(value, ast.AST):
                    self.parents[id(value)] = (parent, field, None)
                elif isinstance(value, list):
                    for i, item in enumerate(value):
                        if isinstance(item, ast.AST):
                            self.parents[id(item)] = (parent, field, i)
        self._dump: str | None = None

    def _mutated_dump(self, node: ast.AST, replacement: ast.AST | None) -> str:
        """``ast.dump`` of the tree with ``node`` replaced (removed from its list when
        ``replacement`` is None); the tree is restored after."""
        parent, field, i = self.parents[id(node)]
        if i is None:
            setattr(parent, field, replacement)
            try:
                return ast.dump(self.tree)
            finally:
                setattr(parent, field, node)
        items = getattr(parent, field)
        if replacement is None:
            del items[i]
        else:
            items[i] = replacement
        try:
            return ast.dump(self.tree)
        finally:
            if replacement is None:
                items.insert(i, node)
            else:
                items[i] = node

    def render(self, site: Site) -> Mutation | None:
        node, src, starts = site.node, self.src, self.starts
        if getattr(node, "end_lineno", None) is None or id(node) not in self.parents:
            return None
        a = starts[node.lineno - 1] + node.col_offset
        b = starts[node.end_lineno - 1] + node.end_col_offset
        if site.change is None:  # remove the statement's whole lines, when it is alone on them
            line_a, line_b = starts[node.lineno - 1], starts[node.end_lineno]
            head, tail = src[line_a:a], src[b:line_b]
            if head.strip() or (tail.strip() and not tail.strip().startswith(b"#")):
                return None
            new_node = None
            a, b, text = line_a, line_b, b""
        else:
            new_node = _mutated_node(node, site.change)
            try:
                text = ast.unparse(new_node).encode()
            except Exception:  # noqa: BLE001 - an odd node: not offered
                return None
        want = self._mutated_dump(node, new_node)
        if self._dump is None:
            self._dump = ast.dump(self.tree)
        if want == self._dump:
            return None
        for candidate in (text, b"(" + text + b")") if text else (text,):
            new_src = src[:a] + candidate + src[b:]
            try:
                got = ast.dump(ast.parse(new_src))
            except SyntaxError:
                continue
            if got == want:
                return Mutation(
                    self.path,
                    site.function,
                    site.kind,
                    site.description,
                    node.lineno,
                    node.end_lineno,
                    self.source,
                    new_src.decode(),
                    src[a:b].decode(),
                    candidate.decode(),
                )
        return None


def sites(path: str, source: str) -> list[Site]:
    """Every mutation site of every function of ``source``, in file order (not rendered:
    the caller samples, then ``render``s; a site that does not splice cleanly renders None)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    f = _File(path, source, tree)
    return [
        Site(f, qualname, kind, node, change, description)
        for qualname, func in _functions(tree)
        for kind, node, change, description in _sites(func)
    ]


def mutations(path: str, source: str) -> list[Mutation]:
    """Every site of ``source`` rendered (the ones that splice cleanly)."""
    return [m for s in sites(path, source) if (m := s.render()) is not None]
