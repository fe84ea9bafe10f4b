"""DD401 hvd-lr-not-scaled: a Horovod learning rate that ignores the number of workers."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, is_lr_slot
from distdoctor.lint.analysis.scaling import batch_divided_by_workers
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule


class HorovodLrNotScaled(Rule):
    """
    ## What it does
    In a Horovod script, flags the learning rate given to the optimizer that
    `hvd.DistributedOptimizer` wraps when it does not involve `hvd.size()` (or `hvd.local_size()`),
    neither directly nor through a variable or helper, and no later
    `param_group["lr"] = ...` or scheduler scales it (a scheduler argument, a `lambda` factor or
    a factor function of the module that calls `hvd.size()`).

    ## Why is this bad?
    `hvd.DistributedOptimizer` averages gradients over all workers, so one step consumes
    `hvd.size()` times the per-worker batch. Horovod's documentation (docs/pytorch.rst) says to scale
    the learning rate by the number of workers, usually with a warm-up; an unscaled rate trains
    the large effective batch with a small-batch step size, which converges slower or worse.

    Silent when the optimizer uses Adasum (`op=hvd.Adasum`), whose scaling rules differ, when
    the per-worker batch is divided by the number of workers (`batch_size // hvd.size()`: the
    global batch does not grow), and when no learning rate is given explicitly.

    Off by default: scaling the learning rate is a recipe, not a law (the same reason DD104, its
    DDP counterpart, is off). On held-out real code none of its findings were bugs: GAN recipes
    with Adam keep a fixed, documented global rate, and scripts that divide the batch need none.
    Turn it on (`--extend-select DD401`) where your recipe follows Horovod's linear scaling.

    ## Example
    ```python
    optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ```

    ## Use instead
    ```python
    optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ```

    ## Fix safety
    No automatic fix: whether to scale linearly, by the local size, or with a warm-up is the
    training recipe's decision.
    """

    code = "DD401"
    name = "hvd-lr-not-scaled"
    severity = "warning"
    default_on = False
    summary = "Horovod learning rate not scaled by hvd.size()"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import torch.optim as optim
            import horovod.torch as hvd

            hvd.init()
            optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)  # expect: DD401
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            """
        ),
        Example(
            """
            import torch
            from horovod import torch as hvd

            def make_optimizer(model, lr):
                return torch.optim.Adam(model.parameters(), lr)  # expect: DD401

            opt = hvd.DistributedOptimizer(make_optimizer(model, 0.001))
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as horovod

            base_lr = 0.1
            lr = base_lr * 2
            opt = torch.optim.SGD(net.parameters(), lr=lr)  # expect: DD401
            opt = horovod.DistributedOptimizer(opt)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)  # expect: DD401
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: 0.1 ** (e // 30))
            optimizer = hvd.DistributedOptimizer(optimizer)
            """
        ),
    )
    valid = (
        Example(
            """
            import torch.optim as optim
            import horovod.torch as hvd

            optimizer = optim.SGD(model.parameters(), lr=args.lr * hvd.size())
            optimizer = hvd.DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            lr_scaler = hvd.size() if not args.use_adasum else 1
            optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr * lr_scaler)
            optimizer = hvd.DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=args.base_lr)
            optimizer = hvd.DistributedOptimizer(optimizer)

            def adjust_learning_rate(epoch):
                for param_group in optimizer.param_groups:
                    param_group["lr"] = args.base_lr * hvd.size() * warmup(epoch)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
            optimizer = hvd.DistributedOptimizer(optimizer, op=hvd.Adasum)
            """
        ),
        Example(
            """
            from horovod import torch as hv
            import torch

            def scaled_lr(base_lr):
                return base_lr * hv.size()

            def run():
                opt = torch.optim.Adam(model.parameters(), lr=scaled_lr(1e-3))
                opt = hv.DistributedOptimizer(opt)

            run()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=0.0125)
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: hvd.size() * min(1.0, (e + 1) / 5))
            optimizer = hvd.DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            from horovod import torch as hv
            from torch import optim

            def warmup_factor(epoch):
                return 1.0 + (hv.size() - 1.0) * min(1.0, epoch / 5)

            optimizer = optim.Adam(model.parameters(), lr=1e-3)
            scheduler = optim.lr_scheduler.LambdaLR(optimizer, lr_lambda=warmup_factor)
            optimizer = hv.DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            import torch

            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)  # no Horovod: not this rule's business
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            import torch.optim as optim
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            hvd.init()
            # --batch-size is the total over all workers: each takes its share.
            per_worker = args.batch_size // hvd.size()
            loader = DataLoader(dataset, batch_size=per_worker, sampler=DistributedSampler(dataset, hvd.size(), hvd.rank()))
            optimizer = optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        wraps = list(ctx.calls("horovod.torch.DistributedOptimizer"))
        if not wraps:
            return
        if any("Adasum" in ctx.code(syntax.keyword(call, "op") or cst.Name("x")) for _, _, call in wraps):
            return
        if batch_divided_by_workers(ctx):
            return  # the global batch does not grow with the workers: nothing to scale
        if self._scaled_later(ctx):
            return
        wrapped = [trace.value(syntax.argument(call, 0, "optimizer"), step) for trace, step, call in wraps]
        known = [value for value in wrapped if value is not None and value.kind == kinds.OPTIMIZER]
        for trace, step, call in ctx.optimizer_calls():
            if known and not any(value.node is call for value in known):
                continue
            lr = syntax.argument(call, 1, "lr")
            if lr is None or ctx.scales_with_world_size(trace, step, lr):
                continue
            yield Report(
                lr,
                f"the learning rate `{ctx.code(lr)}` is not scaled by the number of workers: "
                f"hvd.DistributedOptimizer averages gradients over hvd.size() workers. "
                f"Use `lr={ctx.code(lr)} * hvd.size()` (with a warm-up).",
            )

    def _scaled_later(self, ctx: LintContext) -> bool:
        """`param_group["lr"] = base * hvd.size()`, or a scheduler whose factor involves the size."""
        for trace, step in ctx.steps():
            node = step.node
            if isinstance(node, (cst.Assign, cst.AugAssign)):
                targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
                if any(is_lr_slot(t) for t in targets) and ctx.scales_with_world_size(trace, step, node.value):
                    return True
            for call in syntax.own_calls(node):
                qual = ctx.qualname(call.func) or ""
                if qual.startswith("torch.optim.lr_scheduler") and any(
                    ctx.scales_with_world_size(trace, step, arg.value) or _factor_uses_size(ctx, trace, step, arg.value)
                    for arg in call.args
                ):
                    return True
        # Helpers nobody on a trace calls (e.g. adjust_learning_rate passed as a callback).
        return False


_SIZE_QUALS = ("horovod.torch.size", "horovod.torch.local_size")


def _factor_uses_size(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
    """A scheduler factor that multiplies by the number of workers: `LambdaLR(opt, lambda e:
    hvd.size() * warmup(e))`, or `LambdaLR(opt, lr_lambda=factor)` with a `def factor` of this
    module whose body calls `hvd.size()`/`hvd.local_size()`."""
    if isinstance(expr, cst.Lambda):
        return ctx.scales_with_world_size(trace, step, expr.body)
    if isinstance(expr, cst.Name) and expr.value in ctx.info.functions:
        body = ctx.info.functions[expr.value]
        return any(
            isinstance(node, cst.Call) and ctx.qualname(node.func) in _SIZE_QUALS for node in syntax.walk(body)
        )
    return False


