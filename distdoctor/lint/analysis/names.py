"""Qualified names through imports and aliases, without libcst's full scope analysis.

Scope analysis (`QualifiedNameProvider`) costs several times the parse itself; a training script
needs much less: which local names were bound by an import (anywhere in the file) and to what.
A name that the module also binds by `def`, `class` or a plain assignment of something else is
ambiguous and resolves to nothing, so a local class called `DDP` is never taken for DDP.
"""

from __future__ import annotations

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
            handler = getattr(collector, "visit_" + type(node).__name__, None)
            if handler is not None:
                handler(node)
        aliases = {
            name: target for name, target in collector.imports.items() if name not in collector.shadowed
        }
        # `DDP = torch.nn.parallel.DistributedDataParallel` is an alias too.
        for name, value in collector.assigned_aliases.items():
            if name in aliases or name in collector.defined:
                continue
            head = value.split(".", 1)
            if head[0] in aliases:
                aliases[name] = aliases[head[0]] + ("." + head[1] if len(head) > 1 else "")
        return cls(aliases)

    def qualname(self, node: cst.CSTNode) -> str | None:
        """The canonical qualified name of a Name/Attribute chain rooted at an import, else None."""
        text = dotted(node)
        if text is None:
            return None
        head, _, rest = text.partition(".")
        target = self.aliases.get(head)
        if target is None:
            return None
        return canonical(f"{target}.{rest}" if rest else target)

    def imports_any(self, prefixes: Iterable[str]) -> bool:
        return any(t == p or t.startswith(p + ".") for t in self.aliases.values() for p in prefixes)


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
    def __init__(self) -> None:
        self.imports: dict[str, str] = {}
        self.shadowed: set[str] = set()
        self.defined: set[str] = set()
        self.assigned_aliases: dict[str, str] = {}

    def visit_Import(self, node: cst.Import) -> bool:
        for alias in node.names:
            full = _module_name(alias.name)
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                self._bind(alias.asname.name.value, full)
            else:
                # `import torch.distributed` binds `torch`, through which the full path resolves.
                root = full.split(".")[0]
                self._bind(root, root)
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        if node.relative or node.module is None or isinstance(node.names, cst.ImportStar):
            return False
        module = _module_name(node.module)
        for alias in node.names:
            name = _module_name(alias.name)
            local = name
            if alias.asname is not None and isinstance(alias.asname.name, cst.Name):
                local = alias.asname.name.value
            self._bind(local, f"{module}.{name}")
        return False

    def _bind(self, local: str, target: str) -> None:
        previous = self.imports.get(local)
        if previous is not None and previous != target and not target.startswith(previous + "."):
            # `import torch` and `import torch.nn` both bind `torch`; different roots are ambiguous.
            if not previous.startswith(target + "."):
                self.shadowed.add(local)
        if previous is None or len(target) < len(previous):
            self.imports[local] = target

    def visit_ClassDef(self, node: cst.ClassDef) -> None:
        self._shadow(node.name.value)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> None:
        self._shadow(node.name.value)

    def visit_Assign(self, node: cst.Assign) -> None:
        for target in node.targets:
            if isinstance(target.target, cst.Name):
                name = target.target.value
                value = dotted(node.value)
                if value is not None and "." in value:
                    self.assigned_aliases.setdefault(name, value)
                elif name in self.imports:
                    self.shadowed.add(name)

    def _shadow(self, name: str) -> None:
        self.defined.add(name)
        if name in self.imports:
            self.shadowed.add(name)
        else:
            self.shadowed.add(name)
