"""Qualified names through imports and aliases, without libcst's full scope analysis.

Scope analysis (`QualifiedNameProvider`) costs several times the parse itself; a training script
needs much less: which local names were bound by an import (anywhere in the file) and to what.
A name that the module also binds by `def`, `class` or a plain assignment of something else is
ambiguous and resolves to nothing, so a local class called `DDP` is never taken for DDP.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import libcst as cst

# Canonical names: the public spelling of APIs reachable under several module paths.
CANONICAL: Mapping[str, str] = {
    "torch.nn.parallel.distributed.DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.DistributedDataParallel": "torch.nn.parallel.DistributedDataParallel",
    "torch.nn.modules.batchnorm.SyncBatchNorm": "torch.nn.SyncBatchNorm",
    "torch.utils.data.distributed.DistributedSampler": "torch.utils.data.DistributedSampler",
    "torch.utils.data.dataloader.DataLoader": "torch.utils.data.DataLoader",
    "torch.distributed.distributed_c10d": "torch.distributed",
    "torch.multiprocessing.spawn.spawn": "torch.multiprocessing.spawn",
    "dgl.multiprocessing": "torch.multiprocessing",  # DGL re-exports it (Process, spawn)
    "horovod.torch.mpi_ops": "horovod.torch",
    "horovod.torch.optimizer": "horovod.torch",
    "horovod.torch.functions": "horovod.torch",
    "torch.cuda.amp.GradScaler": "torch.amp.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler": "torch.amp.GradScaler",
    "torch.nn.utils.clip_grad.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_",
    "torch.nn.utils.clip_grad.clip_grad_value_": "torch.nn.utils.clip_grad_value_",
}


def canonical(qualname: str) -> str:
    """The public spelling of `qualname` (longest known prefix rewritten)."""
    parts = qualname.split(".")
    for cut in range(len(parts), 0, -1):
        head = ".".join(parts[:cut])
        if head in CANONICAL:
            return ".".join([CANONICAL[head], *parts[cut:]])
    return qualname


def dotted(node: cst.CSTNode) -> str | None:
    """`a.b.c` for a Name/Attribute chain, else None."""
    if isinstance(node, cst.Name):
        return node.value
    if isinstance(node, cst.Attribute):
        head = dotted(node.value)
        return None if head is None else f"{head}.{node.attr.value}"
    return None


def _module_name(node: cst.BaseExpression) -> str:
    return dotted(node) or ""


@dataclass(frozen=True)
class ImportTable:
    """Local names bound by imports, mapped to the qualified name they stand for."""

    aliases: Mapping[str, str]

    @classmethod
    def of(cls, module: cst.Module) -> ImportTable:
        collector = _ImportCollector()
        for node in _walk_statements(module):
            kind = type(node)
            if kind is cst.Import:
                for alias in node.names:
                    asname = alias.asname.name if alias.asname is not None else None
                    collector.import_module(_module_name(alias.name), asname.value if type(asname) is cst.Name else None)
            elif kind is cst.ImportFrom:
                if isinstance(node.names, cst.ImportStar):
                    collector.star()
                    continue
                if node.relative or node.module is None:
                    continue
                module_name = _module_name(node.module)
                for alias in node.names:
                    asname = alias.asname.name if alias.asname is not None else None
                    collector.import_from(module_name, _module_name(alias.name), asname.value if type(asname) is cst.Name else None)
            elif kind is cst.ClassDef or kind is cst.FunctionDef:
                collector.define(node.name.value)
            elif kind is cst.Assign:
                for target in node.targets:
                    if type(target.target) is cst.Name:
                        collector.assign(target.target.value, dotted(node.value))
        return collector.table()

    @classmethod
    def of_ast(cls, tree: ast.Module) -> ImportTable:
        """The same table from CPython's syntax tree, visiting the statements in the order
        `_walk_statements` visits libcst's (an alias assigned twice keeps the first one seen)."""
        collector = _ImportCollector()
        stack: list[ast.AST] = [tree]
        while stack:
            node = stack.pop()
            kind = type(node)
            if kind is ast.Import:
                for alias in node.names:
                    collector.import_module(alias.name, alias.asname)
            elif kind is ast.ImportFrom:
                if node.names[0].name == "*":
                    collector.star()
                    continue
                if node.level or node.module is None:
                    continue
                for alias in node.names:
                    collector.import_from(node.module, alias.name, alias.asname)
            elif kind is ast.Assign:
                value = ast_dotted(node.value)
                for target in node.targets:
                    if type(target) is ast.Name:
                        collector.assign(target.id, value)
            else:
                if kind is ast.ClassDef or kind is ast.FunctionDef or kind is ast.AsyncFunctionDef:
                    collector.define(node.name)
                # libcst's walk pushes a compound statement's blocks in field order and pops the
                # last first (`else` before the body, `finally` before the handlers).
                for field in _AST_BLOCKS.get(kind, ()):
                    stack.extend(reversed(getattr(node, field)))
        return collector.table()

    def qualname(self, node: cst.CSTNode) -> str | None:
        """The canonical qualified name of a Name/Attribute chain rooted at an import, else None."""
        return self.resolve(dotted(node))

    def resolve(self, text: str | None) -> str | None:
        """The canonical qualified name of the dotted name `text` (`dist.barrier`), else None."""
        if text is None:
            return None
        head, _, rest = text.partition(".")
        target = self.aliases.get(head)
        if target is None:
            return None
        return canonical(f"{target}.{rest}" if rest else target)

    def imports_any(self, prefixes: Iterable[str]) -> bool:
        return any(t == p or t.startswith(p + ".") for t in self.aliases.values() for p in prefixes)


def ast_dotted(node: ast.AST) -> str | None:
    """`dotted` for CPython's syntax tree."""
    if type(node) is ast.Name:
        return node.id
    if type(node) is ast.Attribute:
        head = ast_dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


# The statement blocks of each compound statement of CPython's tree, in libcst's field order.
_AST_BLOCKS: dict[type, tuple[str, ...]] = {
    ast.Module: ("body",),
    ast.FunctionDef: ("body",),
    ast.AsyncFunctionDef: ("body",),
    ast.ClassDef: ("body",),
    ast.If: ("body", "orelse"),
    ast.For: ("body", "orelse"),
    ast.AsyncFor: ("body", "orelse"),
    ast.While: ("body", "orelse"),
    ast.With: ("body",),
    ast.AsyncWith: ("body",),
    ast.Try: ("body", "handlers", "orelse", "finalbody"),
    ast.ExceptHandler: ("body",),
    ast.Match: ("cases",),
    ast.match_case: ("body",),
}
if sys.version_info >= (3, 11):
    _AST_BLOCKS[ast.TryStar] = ("body", "handlers", "orelse", "finalbody")


def _walk_statements(node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    """Imports, defs and assignments anywhere in the module (statements only: no expression
    holds any), without a libcst visitor, which rebuilds every node it passes."""
    stack = [node]
    kinds = _STATEMENT_KIND
    while stack:
        current = stack.pop()
        yield current
        kind = kinds.get(type(current))
        if kind is None:
            kind = _statement_kind(type(current))
        if kind == _LINE:
            stack.extend(reversed(current.body))
            continue
        if kind == _LEAF or kind == _EXPRESSION:
            continue
        for name in current.__dataclass_fields__:
            value = getattr(current, name)
            items = value if type(value) in (list, tuple) else (value,)
            for item in reversed(items):
                item_kind = kinds.get(type(item))
                if item_kind is None:
                    item_kind = _statement_kind(type(item))
                if item_kind <= _BLOCK:
                    stack.append(item)


# What `_walk_statements` does with a node, by its exact type: libcst's node classes are ABCs, and
# `isinstance` through ABCMeta cost most of that walk; a dict lookup gives the same answers.
_LINE, _LEAF, _BLOCK, _EXPRESSION, _OTHER = 0, 1, 2, 3, 4
_STATEMENT_KIND: dict[type, int] = {}


def _statement_kind(kind: type) -> int:
    if issubclass(kind, cst.SimpleStatementLine):
        found = _LINE
    elif issubclass(kind, cst.BaseSmallStatement):
        found = _LEAF
    elif issubclass(kind, cst.BaseExpression):
        found = _EXPRESSION
    elif issubclass(kind, (cst.BaseStatement, cst.BaseSuite, cst.Else, cst.ExceptHandler, cst.Finally, cst.MatchCase, cst.ExceptStarHandler)):
        found = _BLOCK
    else:
        found = _OTHER
    _STATEMENT_KIND[kind] = found
    return found


class _ImportCollector:
    """What the statements of a module bind, from either syntax tree: imports, definitions and
    `NAME = a.b.c` aliases, reduced to the table by `table()`."""

    def __init__(self) -> None:
        self.imports: dict[str, str] = {}
        self.shadowed: set[str] = set()
        self.defined: set[str] = set()
        self.assigned: set[str] = set()
        self.assigned_aliases: dict[str, str] = {}
        self.star_import = False

    def star(self) -> None:
        """`from helpers import *`: names the file never binds may come from there."""
        self.star_import = True

    def import_module(self, full: str, asname: str | None) -> None:
        if asname is not None:
            self._bind(asname, full)
        else:
            # `import torch.distributed` binds `torch`, through which the full path resolves.
            root = full.split(".")[0]
            self._bind(root, root)

    def import_from(self, module: str, name: str, asname: str | None) -> None:
        self._bind(asname if asname is not None else name, f"{module}.{name}")

    def _bind(self, local: str, target: str) -> None:
        previous = self.imports.get(local)
        if previous is not None and previous != target and not target.startswith(previous + "."):
            # `import torch` and `import torch.nn` both bind `torch`; different roots are ambiguous.
            if not previous.startswith(target + "."):
                self.shadowed.add(local)
        if previous is None or len(target) < len(previous):
            self.imports[local] = target

    def define(self, name: str) -> None:
        """A `def` or `class` of that name: a name it shares with an import is ambiguous."""
        self.defined.add(name)
        self.shadowed.add(name)

    def assign(self, name: str, value: str | None) -> None:
        """`name = value` (`value` the dotted text of the right side, or None)."""
        self.assigned.add(name)
        if value is not None and "." in value:
            self.assigned_aliases.setdefault(name, value)
        elif name in self.imports:
            self.shadowed.add(name)

    def table(self) -> ImportTable:
        aliases = {name: target for name, target in self.imports.items() if name not in self.shadowed}
        # `DDP = torch.nn.parallel.DistributedDataParallel` is an alias too.
        for name, value in self.assigned_aliases.items():
            if name in aliases or name in self.defined:
                continue
            head = value.split(".", 1)
            if head[0] in aliases:
                aliases[name] = aliases[head[0]] + ("." + head[1] if len(head) > 1 else "")
        if self.star_import:
            # `from ddp_utils import *` re-exporting `torch.multiprocessing as mp`: a name the
            # file uses but never binds, spelled as everyone spells that module, is that module.
            for name, target in STAR_IMPORTED_CONVENTIONS.items():
                if name not in aliases and name not in self.imports and name not in self.defined and name not in self.assigned:
                    aliases[name] = target
        return ImportTable(aliases)


# The spellings a star import is taken to provide when the file itself never binds them.
STAR_IMPORTED_CONVENTIONS = {
    "torch": "torch",
    "dist": "torch.distributed",
    "mp": "torch.multiprocessing",
    "nn": "torch.nn",
    "DDP": "torch.nn.parallel.DistributedDataParallel",
    "hvd": "horovod.torch",
}
