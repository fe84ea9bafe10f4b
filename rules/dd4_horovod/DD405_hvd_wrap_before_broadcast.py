"""DD405 hvd-wrap-before-broadcast: house style, broadcast before wrapping the optimizer."""

from __future__ import annotations

from collections.abc import Iterable

from distdoctor.lint.analysis import frameworks
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule

BROADCASTS = ("horovod.torch.broadcast_parameters", "horovod.torch.broadcast_optimizer_state")


class HorovodWrapBeforeBroadcast(Rule):
    """
    ## What it does
    Flags `hvd.DistributedOptimizer(...)` created before the `broadcast_parameters` /
    `broadcast_optimizer_state` calls of the same code path. **Off by default**: select it by
    its full code (`--extend-select DD405`).

    ## Why is this bad?
    It is not a bug. Horovod accepts both orders: its ImageNet example
    (`pytorch_imagenet_resnet50.py`) wraps first, its MNIST example (`pytorch_mnist.py`)
    broadcasts first. This is a house-style rule for teams that want the MNIST order, in which
    the dummy `step()` that `broadcast_optimizer_state` performs internally to materialise the
    optimizer state never goes through the wrapped optimizer's gradient hooks, and reviewers see
    one canonical order everywhere.

    ## Example
    ```python
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    ```

    ## Use instead
    ```python
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ```

    ## Fix safety
    No automatic fix.
    """

    code = "DD405"
    name = "hvd-wrap-before-broadcast"
    severity = "info"
    default_on = False
    summary = "hvd.DistributedOptimizer created before the broadcasts (house style)"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)  # expect: DD405
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
        Example(
            """
            from horovod import torch as hv

            def setup(model, opt):
                opt = hv.DistributedOptimizer(opt, named_parameters=model.named_parameters())  # expect: DD405
                hv.broadcast_parameters(model.state_dict(), root_rank=0)
                return opt
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            class Runner:
                def __init__(self, model, opt):
                    self.opt = hvd.DistributedOptimizer(opt)  # expect: DD405
                    self.sync(model)

                def sync(self, model):
                    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            """
        ),
    )
    valid = (
        Example(
            """
            import horovod.torch as hvd

            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            optimizer = hvd.DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)  # no broadcast on this path at all (DD403's business)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def wrap(opt):
                return hvd.DistributedOptimizer(opt)

            def sync(model):
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        for trace, step, call in ctx.calls("horovod.torch.DistributedOptimizer"):
            broadcast_later = any(
                later.index > step.index and (ctx.qualname(c.func) in BROADCASTS)
                for later, c in trace.calls()
            )
            if broadcast_later:
                yield Report(
                    call,
                    "hvd.DistributedOptimizer is created before the broadcasts; this codebase's style "
                    "broadcasts parameters and optimizer state first, then wraps (Horovod accepts both).",
                )
