"""DD502 no-sync-under-fsdp2: DDP-style gradient accumulation control on an FSDP2 model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP2, type_checked

DDP_CLASS = "torch.nn.parallel.DistributedDataParallel"
SYNC_WORDS = ("no_sync", "require_backward_grad_sync")


class NoSyncUnderFSDP2(Rule):
    """
    ## What it does
    Flags DDP's ways of skipping the gradient reduction used on a model sharded with FSDP2's
    `fully_shard`: `model.no_sync()`, `model.require_backward_grad_sync = ...`, and a branch on
    `isinstance(model, DistributedDataParallel)` that decides whether to call them.

    It stays silent on FSDP (v1) wrappers, which have their own `no_sync()`, on DDP models, and
    where another check of the model's type or attributes (`isinstance(model, FSDPModule)`,
    `hasattr(model, "no_sync")`) chooses the branch.

    ## Why is this bad?
    `fully_shard` turns the module into an `FSDPModule`; it is not a wrapper and has no
    `no_sync()` (an `AttributeError`, unless the model defines a method of that name that then
    does nothing for FSDP), and `require_backward_grad_sync` is an attribute FSDP2 never reads. A
    DDP-only `isinstance` branch is simply never taken. In each case every micro-batch
    reduce-scatters its gradients: accumulation runs as slowly as if it were not there (one report
    measured 430 s against 110 s per iteration at accumulation 4).

    ## Example
    ```python
    fully_shard(model)
    for i, batch in enumerate(loader):
        ctx = model.no_sync() if (i + 1) % accum else nullcontext()
        with ctx:
            model(batch).loss.backward()
    ```

    ## Use instead
    ```python
    fully_shard(model)
    for i, batch in enumerate(loader):
        model.set_requires_gradient_sync((i + 1) % accum == 0)
        model(batch).loss.backward()
    ```

    ## Fix safety
    No autofix: the replacement changes the structure of the loop.
    """

    code = "DD502"
    name = "no-sync-under-fsdp2"
    severity = "warning"
    summary = "no_sync()/require_backward_grad_sync/isinstance(DDP) accumulation on an FSDP2 model"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            for i, (x, y) in enumerate(loader):
                if (i + 1) % 4 != 0:
                    with model.no_sync():  # expect: DD502
                        model(x).sum().backward()
                else:
                    model(x).sum().backward()
                    optimizer.step()
            """
        ),
        Example(
            """
            from torch.distributed._composable.fsdp import fully_shard

            def train(model, loader, accum):
                model = fully_shard(model)
                for step, batch in enumerate(loader):
                    model.require_backward_grad_sync = (step + 1) % accum == 0  # expect: DD502
                    model(batch).mean().backward()
            """
        ),
        Example(
            """
            import contextlib
            from torch.distributed.fsdp import fully_shard
            from torch.nn.parallel import DistributedDataParallel as DDP

            def maybe_no_sync(model, sync):
                if isinstance(model, DDP) and not sync:  # expect: DD502
                    return model.no_sync()
                return contextlib.nullcontext()

            def main(model, loader):
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                for i, batch in enumerate(loader):
                    with maybe_no_sync(model, i % 4 == 3):
                        model(batch).backward()
            """
        ),
    )
    valid = (
        Example(
            """
            import contextlib
            from torch.distributed.fsdp import FSDPModule, fully_shard

            fully_shard(model)
            for i, batch in enumerate(loader):
                if isinstance(model, FSDPModule):
                    model.set_requires_gradient_sync(i % 4 == 3)
                    ctx = contextlib.nullcontext()
                else:
                    ctx = model.no_sync()
                with ctx:
                    model(batch).sum().backward()
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            for i, batch in enumerate(loader):
                model.set_requires_gradient_sync((i + 1) % 4 == 0)
                model(batch).sum().backward()
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model)
            for i, batch in enumerate(loader):
                with model.no_sync():  # FSDP (v1) has no_sync()
                    model(batch).sum().backward()
            """
        ),
        Example(
            """
            import contextlib
            from torch.distributed.fsdp import fully_shard
            from torch.nn.parallel import DistributedDataParallel as DDP

            def sync_context(model, sync):
                if isinstance(model, DDP) and not sync:
                    return model.no_sync()
                else:
                    model.set_requires_gradient_sync(sync)
                return contextlib.nullcontext()

            fully_shard(model)
            for i, batch in enumerate(loader):
                with sync_context(model, i % 4 == 3):
                    model(batch).sum().backward()
            """
        ),
        Example(
            """
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            for i, batch in enumerate(loader):
                if isinstance(model, DDP) and i % 4:
                    with model.no_sync():
                        model(batch).sum().backward()
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            with student.no_sync():  # another model, not sharded
                student(x).sum().backward()
            fully_shard(teacher)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP2):
            return
        reported: set[int] = set()
        for trace in ctx.traces:
            for step in trace.steps:
                for node, message in _findings(ctx, trace, step):
                    if id(node) not in reported:
                        reported.add(id(node))
                        yield Report(node, message)


def _fsdp2_line(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression) -> int | None:
    event = ctx.sharding.in_place_sharded(trace, step, expr, FSDP2)
    return None if event is None else ctx.position(event.call).start.line


def _findings(ctx: LintContext, trace: Trace, step: Step) -> Iterator[tuple[cst.CSTNode, str]]:
    node = step.node
    # A DDP-only branch that decides the accumulation.
    tests: list[tuple[cst.BaseExpression, cst.CSTNode, cst.CSTNode | None]] = []
    if isinstance(node, cst.If):
        tests.append((node.test, node.body, node.orelse))
    if not isinstance(node, (cst.If, cst.For, cst.While, cst.With, cst.Try, cst.FunctionDef, cst.ClassDef)):
        tests.extend((sub.test, sub.body, sub.orelse) for sub in syntax.walk(node) if isinstance(sub, cst.IfExp))
    for test, body, orelse in tests:
        if orelse is not None and _mentions(orelse, ("set_requires_gradient_sync",)):
            continue  # the other branch handles FSDP2
        for model in _ddp_isinstance_subjects(ctx, test):
            line = _fsdp2_line(ctx, trace, step, model)
            if line is not None and _mentions(body, SYNC_WORDS):
                yield test, (
                    f"`isinstance(..., DistributedDataParallel)` is never true for the FSDP2 model sharded on line {line}: "
                    f"this accumulation branch is skipped and every micro-batch reduce-scatters its gradients. Use "
                    f"`model.set_requires_gradient_sync(False)` on the non-final micro-batches."
                )
    if any(_ddp_isinstance_subjects(ctx, guard.test) for guard in step.guards):
        return  # the call sits in a DDP-only branch: reported on that branch
    for call in syntax.own_calls(node):
        if type_checked(ctx, step, call):
            continue  # another type check decides: cannot tell which branch the FSDP2 model takes
        if isinstance(call.func, cst.Attribute) and call.func.attr.value == "no_sync" and not call.args:
            line = _fsdp2_line(ctx, trace, step, call.func.value)
            if line is not None:
                yield call, (
                    f"`no_sync()` on a model sharded with fully_shard() (line {line}): FSDP2 modules have no no_sync() "
                    f"(AttributeError, or a method of the model that does nothing for FSDP), so gradients are "
                    f"reduce-scattered on every micro-batch. Use `model.set_requires_gradient_sync(False)` instead."
                )
    if isinstance(node, cst.Assign) and not type_checked(ctx, step, node):
        for target in node.targets:
            attr = target.target
            if isinstance(attr, cst.Attribute) and attr.attr.value == "require_backward_grad_sync":
                line = _fsdp2_line(ctx, trace, step, attr.value)
                if line is not None:
                    yield node, (
                        f"`require_backward_grad_sync` is a DDP attribute; FSDP2 (fully_shard, line {line}) never reads "
                        f"it, so every micro-batch still reduce-scatters. Use `model.set_requires_gradient_sync(...)`."
                    )


def _ddp_isinstance_subjects(ctx: LintContext, test: cst.BaseExpression) -> list[cst.BaseExpression]:
    """`model` in `isinstance(model, DDP)` (or a tuple naming DDP) within a condition."""
    found = []
    for sub in syntax.walk(test):
        if isinstance(sub, cst.Call) and isinstance(sub.func, cst.Name) and sub.func.value == "isinstance" and len(sub.args) == 2:
            classes = sub.args[1].value
            names = [el.value for el in classes.elements] if isinstance(classes, cst.Tuple) else [classes]
            if any(ctx.qualname(name) == DDP_CLASS for name in names):
                found.append(sub.args[0].value)
    return found


def _mentions(body: cst.CSTNode, words: tuple[str, ...]) -> bool:
    for sub in syntax.walk(body):
        if isinstance(sub, cst.Name) and sub.value in words:
            return True
    return False

