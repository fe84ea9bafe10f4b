"""DD410 hvd-adasum-lr-scaled-by-size: a learning rate scaled by hvd.size() while Adasum is on."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext, is_lr_slot
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

SIZE = "horovod.torch.size"


class HorovodAdasumLrScaledBySize(Rule):
    """
    ## What it does
    In a Horovod script whose `hvd.DistributedOptimizer` uses Adasum (`op=hvd.Adasum`, or
    `op=hvd.Adasum if args.use_adasum else hvd.Average`), flags a learning rate, at creation or
    in a later `param_group["lr"] = ...`, that is multiplied by `hvd.size()` on the path where
    Adasum is on: unconditionally, or without regard to the flag that switches Adasum on.

    A new rule in the Horovod family, found on Horovod's own ImageNet example: its initial
    learning rate honours `--use-adasum` (`lr_scaler = ... hvd.size() if not args.use_adasum else 1`),
    but its per-batch schedule `adjust_learning_rate` sets
    `param_group["lr"] = args.base_lr * hvd.size() * ...` on every batch, Adasum or not.

    ## Why is this bad?
    Adasum combines gradients adaptively instead of averaging them; Horovod's documentation
    (docs/adasum_user_guide.rst) says the learning rate should not be scaled by the number of
    workers with Adasum (on GPUs, by `hvd.local_size()` at most). Scaling by `hvd.size()`
    multiplies the step size by the job's width: the larger the job, the likelier it diverges.

    Silent when the scaling is itself conditioned on the Adasum flag (an `if not
    args.use_adasum:` around it, or a conditional expression on that flag), and for
    `hvd.local_size()`.

    ## Example
    ```python
    optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum if args.use_adasum else hvd.Average)

    def adjust_learning_rate(epoch):
        for group in optimizer.param_groups:
            group["lr"] = args.base_lr * hvd.size() * warmup(epoch)
    ```

    ## Use instead
    ```python
    lr_scaler = hvd.size() if not args.use_adasum else 1

    def adjust_learning_rate(epoch):
        for group in optimizer.param_groups:
            group["lr"] = args.base_lr * lr_scaler * warmup(epoch)
    ```

    ## Fix safety
    No automatic fix: the scaling to use with Adasum depends on the hardware.
    """

    code = "DD410"
    name = "hvd-adasum-lr-scaled-by-size"
    severity = "warning"
    summary = "learning rate scaled by hvd.size() while Adasum may be on"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            lr_scaler = hvd.size() if not args.use_adasum else 1
            optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler)
            optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum if args.use_adasum else hvd.Average)

            def adjust_learning_rate(epoch, batch_idx):
                adj = 0.1 if epoch > 30 else 1.0
                for param_group in optimizer.param_groups:
                    param_group["lr"] = args.base_lr * hvd.size() * adj  # expect: DD410
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            opt = torch.optim.SGD(net.parameters(), lr=0.01 * hvd.size())  # expect: DD410
            opt = hvd.DistributedOptimizer(opt, named_parameters=net.named_parameters(), op=hvd.Adasum)
            """
        ),
        Example(
            """
            import torch
            from horovod import torch as hv

            def build(model, cfg):
                scaled = cfg.lr * hv.size()
                opt = torch.optim.Adam(model.parameters(), lr=scaled)  # expect: DD410
                op = hv.Adasum if cfg.adasum else hv.Average
                return hv.DistributedOptimizer(opt, op=op)
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            lr_scaler = hvd.size() if not args.use_adasum else 1
            optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler)
            optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum if args.use_adasum else hvd.Average)

            def adjust_learning_rate(epoch):
                for param_group in optimizer.param_groups:
                    param_group["lr"] = args.base_lr * lr_scaler * warmup(epoch)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
            optimizer = hvd.DistributedOptimizer(optimizer)  # averaging: scale by size
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.local_size())
            optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)  # GPU Adasum: local size
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum if args.use_adasum else hvd.Average)
            if not args.use_adasum:
                for group in optimizer.param_groups:
                    group["lr"] = args.lr * hvd.size()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        flags = _adasum_flags(ctx)
        if flags is None:
            return  # no Adasum anywhere
        for trace, step, expr in _learning_rates(ctx):
            if not _multiplies_by_size(ctx, trace, step, expr) or _conditioned_on(ctx, step, expr, flags):
                continue
            yield Report(
                expr,
                "this learning rate is multiplied by hvd.size() while the optimizer may use Adasum, "
                "which must not be scaled by the number of workers (Horovod's Adasum guide): scale "
                "by hvd.size() only when averaging, e.g. `lr_scaler = hvd.size() if not use_adasum "
                "else 1` (hvd.local_size() for GPU Adasum).",
            )


def _adasum_flags(ctx: LintContext) -> set[str] | None:
    """None when no DistributedOptimizer uses Adasum; else the names of the flags that switch it
    on (empty when Adasum is unconditional)."""
    flags: set[str] = set()
    found = False
    for trace, step, call in ctx.calls("horovod.torch.DistributedOptimizer"):
        op = syntax.keyword(call, "op")
        if op is None:
            continue
        resolved = _resolve_op(ctx, trace, step, op)
        if "Adasum" not in ctx.code(resolved):
            continue
        found = True
        for node in syntax.walk(resolved):
            if isinstance(node, cst.IfExp):
                flags |= _names(node.test)
    return flags if found else None


def _resolve_op(ctx: LintContext, trace: Trace, step: Step, op: cst.BaseExpression) -> cst.BaseExpression:
    """`op=op` where `op = hvd.Adasum if flag else hvd.Average` was assigned before."""
    binding = ctx.binding(trace, step, op) if isinstance(op, cst.Name) else None
    return binding[1] if binding is not None else op


def _learning_rates(ctx: LintContext) -> Iterator[tuple[Trace, Step, cst.BaseExpression]]:
    for trace in ctx.traces:
        for step, call in trace.calls():
            qual = ctx.qualname(call.func) or ""
            if qual.startswith("torch.optim.") and qual.rsplit(".", 1)[-1][:1].isupper():
                lr = syntax.argument(call, 1, "lr")
                if lr is not None:
                    yield trace, step, lr
        for step in trace.steps:
            if isinstance(step.node, cst.Assign) and any(is_lr_slot(t.target) for t in step.node.targets):
                yield trace, step, step.node.value


def _multiplies_by_size(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
    """`hvd.size()` in the expression, or a plain variable computed from it unconditionally."""
    for node in syntax.walk(expr, skip=(cst.Lambda,)):
        if isinstance(node, cst.Call) and ctx.qualname(node.func) == SIZE:
            return True
        if isinstance(node, cst.Name):
            binding = ctx.binding(trace, step, node)
            if binding is None:
                continue
            value = binding[1]
            if not any(isinstance(sub, cst.IfExp) for sub in syntax.walk(value)) and any(
                isinstance(sub, cst.Call) and ctx.qualname(sub.func) == SIZE for sub in syntax.walk(value)
            ):
                return True
    return False


def _conditioned_on(ctx: LintContext, step: Step, expr: cst.BaseExpression, flags: set[str]) -> bool:
    if not flags:
        return False
    if any(_names(guard.test) & flags for guard in step.guards):
        return True
    return any(isinstance(node, cst.IfExp) and _names(node.test) & flags for node in syntax.walk(expr))


def _names(node: cst.CSTNode) -> set[str]:
    return {text for sub in syntax.walk(node) if (text := dotted(sub)) is not None}
