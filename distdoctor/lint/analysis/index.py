"""What a file imports and calls, read before (and often instead of) libcst's concrete tree.

Most files a rule's words let through never give that rule anything to report, and most rules
learn that from the file's calls alone: no collective, no `torch.save`, no device index. CPython's
parser builds its tree about ten times faster than libcst, so the engine reads the imports and
calls from it (`FileIndex.of_ast`) and parses the concrete tree only when a rule asks for more
(`LintContext.module`). For a file CPython cannot parse (syntax newer than the running Python),
the same index is read from libcst's tree (`FileIndex.of_module`).

Both builders resolve names with the same `ImportTable` rules and see the same calls, so the
index, and every rule's answer, is the same whichever tree it came from (tests/test_engine_robust.py
checks that on every fixture and rule example).
"""

from __future__ import annotations

import ast
from typing import NamedTuple

import libcst as cst

from distdoctor.lint.analysis import syntax
from distdoctor.lint.analysis.names import ImportTable, ast_dotted

CUDA_COLON = "cuda:"


class FileIndex(NamedTuple):
    """The import table of a file, and every call of it (on a code path or not) by qualified name,
    by method name (`x.m(...)`) and by the last name of its callee (`f(...)`, `a.b.f(...)`); and
    whether any string of it contains `cuda:`."""

    imports: ImportTable
    quals: frozenset[str]
    methods: frozenset[str]
    callees: frozenset[str]
    cuda_strings: bool

    @classmethod
    def of_ast(cls, tree: ast.Module) -> FileIndex:
        imports = ImportTable.of_ast(tree)
        quals: set[str] = set()
        methods: set[str] = set()
        callees: set[str] = set()
        cuda_strings = False
        resolve = imports.resolve
        node_type = ast.AST
        stack: list[object] = [tree]
        while stack:  # `ast.walk`, without its generators: twice as fast
            node = stack.pop()
            if not isinstance(node, node_type):
                continue  # a name in a list field (`global a, b`)
            for field in node._fields:
                value = getattr(node, field, None)
                if type(value) is list:
                    stack.extend(value)
                elif isinstance(value, node_type):
                    stack.append(value)
            kind = type(node)
            if kind is ast.Call:
                func = node.func
                if type(func) is ast.Attribute:
                    methods.add(func.attr)
                    callees.add(func.attr)
                elif type(func) is ast.Name:
                    callees.add(func.id)
                qual = resolve(ast_dotted(func))
                if qual is not None:
                    quals.add(qual)
            elif kind is ast.Constant and not cuda_strings:
                # Implicitly concatenated literals are one constant here, as libcst evaluates them.
                value = node.value
                if type(value) is str:
                    cuda_strings = CUDA_COLON in value
                elif type(value) is bytes:
                    cuda_strings = b"cuda:" in value
        return cls(imports, frozenset(quals), frozenset(methods), frozenset(callees), cuda_strings)

    @classmethod
    def of_module(cls, module: cst.Module, nodes: dict[type, list[cst.CSTNode]]) -> FileIndex:
        """The index from libcst's tree (`nodes`: its nodes by type, see `LintContext.nodes`)."""
        imports = ImportTable.of(module)
        quals: set[str] = set()
        methods: set[str] = set()
        callees: set[str] = set()
        for call in nodes.get(cst.Call, ()):
            func = call.func
            if type(func) is cst.Attribute:
                methods.add(func.attr.value)
                callees.add(func.attr.value)
            elif type(func) is cst.Name:
                callees.add(func.value)
            qual = imports.qualname(func)
            if qual is not None:
                quals.add(qual)
        return cls(imports, frozenset(quals), frozenset(methods), frozenset(callees), _mentions_cuda_colon(nodes))


def _mentions_cuda_colon(nodes: dict[type, list[cst.CSTNode]]) -> bool:
    for node in nodes.get(cst.FormattedStringText, ()):
        if CUDA_COLON in node.value:
            return True
    for node in nodes.get(cst.SimpleString, ()):
        if CUDA_COLON in (node.value if "\\" not in node.value else syntax.string_value(node) or ""):
            return True
    return any(CUDA_COLON in (syntax.string_value(node) or "") for node in nodes.get(cst.ConcatenatedString, ()))
