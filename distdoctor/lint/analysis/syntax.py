"""Syntax helpers every analysis and rule shares: a fast walk over code nodes, the calls of a
statement in evaluation order, arguments by position or keyword, literal values."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, TypeVar

import libcst as cst


def const_value(node: cst.BaseExpression) -> tuple[bool, Any]:
    if isinstance(node, cst.Integer):
        return True, int(node.value, 0) if node.value.isdigit() else node.evaluated_value
    if isinstance(node, cst.Float):
        return True, node.evaluated_value
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return True, {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, cst.SimpleString):
        return True, node.evaluated_value
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        known, value = const_value(node.expression)
        if known and isinstance(value, (int, float)):
            return True, -value
    return False, None


def string_value(node: cst.CSTNode) -> str | None:
    """The text of a string literal (implicitly concatenated or not), else None (bytes too)."""
    if isinstance(node, (cst.SimpleString, cst.ConcatenatedString)):
        value = node.evaluated_value
        return value if isinstance(value, str) else None
    return None


def keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    """The expression passed as keyword `name`, if any."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    return None


def argument(call: cst.Call, position: int, name: str) -> cst.BaseExpression | None:
    """An argument given by position or by keyword."""
    value = keyword(call, name)
    if value is not None:
        return value
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    return positional[position].value if position < len(positional) else None


def arg_node(call: cst.Call, expr: cst.BaseExpression) -> cst.CSTNode:
    """The `Arg` of `call` that holds `expr` (what a finding about that argument points at, and
    what a fix rewrites), or the call itself when `expr` is not one of its arguments."""
    for arg in call.args:
        if arg.value is expr:
            return arg
    return call


# Fields that hold only layout (whitespace, commas, parentheses, blank lines): never code.
_LAYOUT_FIELDS = frozenset(
    {
        "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "comma", "semicolon", "colon",
        "equal", "dot", "star", "leading_lines", "lines_after_decorators", "header", "footer",
        "trailing_whitespace", "newline", "first_line", "empty_lines", "whitespace_before",
        "whitespace_after", "whitespace_before_colon", "whitespace_after_colon", "whitespace_before_params",
        "whitespace_after_def", "whitespace_after_class", "whitespace_after_for", "whitespace_before_in",
        "whitespace_after_in", "whitespace_after_if", "whitespace_after_with", "whitespace_after_while",
        "whitespace_after_import", "whitespace_after_from", "whitespace_before_import", "whitespace_after_as",
        "whitespace_before_as", "whitespace_after_func", "whitespace_before_args", "whitespace_after_arg",
        "whitespace_after_star", "whitespace_after_param", "whitespace_after_equal", "whitespace_before_equal",
        "whitespace_after_return", "whitespace_after_lambda", "whitespace_after_await", "whitespace_after_del",
        "whitespace_after_raise", "whitespace_after_assert", "whitespace_after_global", "whitespace_after_nonlocal",
        "whitespace_after_except", "whitespace_after_yield", "whitespace_after_indicator", "whitespace_after_test",
        "whitespace_before_from", "whitespace_after_match", "whitespace_after_case", "whitespace_before_if",
        "whitespace_after_async", "whitespace_after_at", "whitespace_after_type",
    }
)


_CODE_FIELDS: dict[type, tuple[str, ...]] = {}


def _code_fields(kind: type) -> tuple[str, ...]:
    fields = _CODE_FIELDS.get(kind)
    if fields is None:
        fields = tuple(name for name in kind.__dataclass_fields__ if name not in _LAYOUT_FIELDS)
        _CODE_FIELDS[kind] = fields
    return fields


# What a field's value is, by its exact type: 1 a node, 2 a list or tuple, 0 anything else. libcst's
# node classes are ABCs, and `isinstance` through ABCMeta was a tenth of the run time in the
# hot walks; a dict lookup by type gives the same answers (libcst registers no virtual subclasses).
_KIND: dict[type, int] = {list: 2, tuple: 2}


def _kind(kind: type) -> int:
    found = _KIND.get(kind)
    if found is None:
        found = _KIND[kind] = 1 if issubclass(kind, cst.CSTNode) else 0
    return found


_SKIPPED: dict[tuple[type, tuple[type, ...]], bool] = {}


def _skipped(kind: type, skip: tuple[type, ...]) -> bool:
    key = (kind, skip)
    found = _SKIPPED.get(key)
    if found is None:
        found = _SKIPPED[key] = issubclass(kind, skip)
    return found


def operands(test: cst.BaseExpression, joiner: type[cst.BaseBooleanOp]) -> list[cst.BaseExpression]:
    """The terms of a chain of `joiner` (`cst.And` or `cst.Or`): `a and (b and c)` -> [a, b, c];
    a test of another shape is its own single term."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, joiner):
        return [*operands(test.left, joiner), *operands(test.right, joiner)]
    return [test]


def walk(node: cst.CSTNode, skip: tuple[type, ...] = ()) -> Iterator[cst.CSTNode]:
    """Every code node under `node` (itself included), parents before children, in field order,
    not descending into nodes of the `skip` types nor into layout (whitespace, commas,
    parentheses). Much faster than a libcst visitor, which rebuilds every node it passes."""
    kinds = _KIND
    fields_of = _CODE_FIELDS
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        children: list[cst.CSTNode] = []
        fields = fields_of.get(type(current))
        if fields is None:
            fields = _code_fields(type(current))
        for name in fields:
            value = getattr(current, name)
            kind = kinds.get(type(value))
            if kind is None:
                kind = _kind(type(value))
            if kind == 2:
                for item in value:
                    item_kind = kinds.get(type(item))
                    if item_kind == 1 or (item_kind is None and _kind(type(item)) == 1):
                        children.append(item)
            elif kind == 1:
                children.append(value)
        if skip:
            children = [child for child in children if not _skipped(type(child), skip)]
        children.reverse()
        stack.extend(children)


def _calls_in_order(node: cst.CSTNode) -> list[cst.Call]:
    """Calls under `node` in evaluation order: arguments (and the receiver) before the call."""
    out: list[cst.Call] = []
    call_type = cst.Call
    kinds = _KIND
    fields_of = _CODE_FIELDS
    descend = _DESCEND

    def visit(current: cst.CSTNode) -> None:
        fields = fields_of.get(type(current))
        if fields is None:
            fields = _code_fields(type(current))
        for name in fields:
            value = getattr(current, name)
            kind = kinds.get(type(value))
            if kind is None:
                kind = _kind(type(value))
            if kind == 0:
                continue
            for item in value if kind == 2 else (value,):
                item_type = type(item)
                inside = descend.get(item_type)
                if inside is None:
                    inside = descend[item_type] = _kind(item_type) == 1 and not _skipped(item_type, _OPAQUE)
                if inside:
                    visit(item)
        if type(current) is call_type:
            out.append(current)

    visit(node)
    return out


_OPAQUE = (cst.Lambda, cst.FunctionDef, cst.ClassDef)
# Whether `_calls_in_order` descends into a value of this exact type: a node, not an opaque one.
_DESCEND: dict[type, bool] = {}


T = TypeVar("T")


class NodeMemo(dict[int, tuple[cst.CSTNode, Any]]):
    """Values computed from a node, keyed by `id(node)`: a hit is `entry = memo.get(id(node))` with
    `entry[0] is node`, a miss is stored by `remember`. Each entry holds its node, so that an id is
    never reused while its entry lives; so memos are emptied after each file (`forget_file_memos`),
    lest they keep every linted tree alive, and when one outgrows `limit` within a file."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def remember(self, node: cst.CSTNode, value: T) -> T:
        if len(self) > self.limit:
            self.clear()
        self[id(node)] = (node, value)
        return value


_FILE_MEMOS: list[NodeMemo] = []


def file_memo(limit: int) -> NodeMemo:
    """A new memo of values by node, emptied after each file."""
    memo = NodeMemo(limit)
    _FILE_MEMOS.append(memo)
    return memo


_CALLS_MEMO = file_memo(200_000)


def forget_file_memos() -> None:
    """Empty every memo of the file just linted (see `file_memo`)."""
    for memo in _FILE_MEMOS:
        memo.clear()


def own_calls(node: cst.CSTNode) -> list[cst.Call]:
    """Calls in a statement in evaluation order (arguments before the call), not descending into
    nested function bodies, lambdas, or the bodies of compound statements. Memoised: every rule
    asks this of the same steps."""
    entry = _CALLS_MEMO.get(id(node))
    if entry is not None and entry[0] is node:
        return entry[1]
    if isinstance(node, cst.For):
        calls = _calls_in_order(node.iter)
    elif isinstance(node, (cst.While, cst.If)):
        calls = _calls_in_order(node.test)
    elif isinstance(node, cst.With):
        calls = [call for item in node.items for call in _calls_in_order(item)]
    elif isinstance(node, (cst.Try, cst.TryStar, cst.FunctionDef, cst.ClassDef, cst.Match)):
        calls = []
    else:
        calls = _calls_in_order(node)
    return _CALLS_MEMO.remember(node, calls)


def assigned_targets(node: cst.Assign) -> Iterator[cst.BaseExpression]:
    """Every name, attribute or subscript an assignment binds, through tuple and list unpacking
    (`args.local_rank, args.rank, _ = get_envs()` binds three)."""
    pending: list[cst.BaseExpression] = [target.target for target in node.targets]
    while pending:
        current = pending.pop()
        if isinstance(current, (cst.Tuple, cst.List)):
            pending.extend(element.value for element in current.elements)
        else:
            yield current
