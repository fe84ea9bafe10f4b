"""DD406 hvd-clip-without-synchronize: gradient clipping before Horovod reduced the gradients."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

CLIPPING = (
    "torch.nn.utils.clip_grad_norm_",
    "torch.nn.utils.clip_grad_value_",
    "torch.nn.utils.clip_grad_norm",
)


class HorovodClipWithoutSynchronize(Rule):
    """
    ## What it does
    Flags gradient clipping (`clip_grad_norm_`, `clip_grad_value_`) between `backward()` and the
    `step()` of a `hvd.DistributedOptimizer` when `optimizer.synchronize()` is not called before
    the clipping; and, when it is, a `step()` that is not inside
    `with optimizer.skip_synchronize():`.

    ## Why is this bad?
    `hvd.DistributedOptimizer` starts the allreduce of each gradient during `backward()` and waits
    for the results only in `step()` (or `synchronize()`). Clipping before that clips each rank's
    local, unreduced gradient; the allreduce then writes the averaged, unclipped gradient over it,
    so the clipping does nothing (and the norm it returns differs per rank). Calling
    `synchronize()` first and then `step()` outside `skip_synchronize()` makes `step()` reduce
    every gradient a second time: Horovod warns, and the communication doubles. The pattern in
    the `DistributedOptimizer` documentation is:

    ```python
    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    with optimizer.skip_synchronize():
        optimizer.step()
    ```

    ## Example
    ```python
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    ```

    ## Use instead
    ```python
    loss.backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with optimizer.skip_synchronize():
        optimizer.step()
    ```

    ## Fix safety
    No fix: the edit spans several statements and a new block.
    """

    code = "DD406"
    name = "hvd-clip-without-synchronize"
    severity = "warning"
    summary = "gradient clipping under hvd.DistributedOptimizer without synchronize() first"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: DD406
                optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.nn.utils import clip_grad_value_
            from horovod import torch as hvd

            class Trainer:
                def __init__(self, model):
                    self.model = model
                    self.opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))

                def step(self, batch):
                    self.opt.zero_grad()
                    self.model(batch).sum().backward()
                    clip_grad_value_(self.model.parameters(), 0.5)  # expect: DD406
                    self.opt.step()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            def train(model, loader, opt, scaler):
                for x, y in loader:
                    with torch.autocast("cuda"):
                        loss = model(x, y)
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: DD406
                    scaler.step(opt)
                    scaler.update()

            model = Net()
            opt = hvd.DistributedOptimizer(torch.optim.AdamW(model.parameters()))
            train(model, loader, opt, torch.cuda.amp.GradScaler())
            """
        ),
        Example(
            """
            import torch.nn as nn
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)
            for x, y in loader:
                optimizer.zero_grad()
                criterion(model(x), y).backward()
                optimizer.synchronize()
                nn.utils.clip_grad_norm_(model.parameters(), 5.0)
                optimizer.step()  # expect: DD406
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                with optimizer.skip_synchronize():
                    optimizer.step()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            # Horovod's mixed-precision MNIST pattern
            def train(model, loader, optimizer, scaler):
                for x, y in loader:
                    scaler.scale(model(x, y)).backward()
                    optimizer.synchronize()
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    with optimizer.skip_synchronize():
                        scaler.step(optimizer)
                    scaler.update()

            model = Net()
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            train(model, loader, optimizer, torch.cuda.amp.GradScaler())
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            # plain torch optimizer (DDP reduces during backward): nothing to synchronize
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for x, y in loader:
                criterion(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            def step(model, optimizer, loss):
                # the optimizer's kind is unknown here: stay silent
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        for trace, clip_step, _clip in ctx.calls(*CLIPPING):
            backward = _previous_backward(ctx, trace, clip_step)
            if backward is None:
                continue
            stepped = _next_hvd_step(ctx, trace, clip_step)
            if stepped is None:
                continue
            step_step, step_call, optimizer = stepped
            name = dotted(step_call.func.value) if isinstance(step_call.func, cst.Attribute) else None
            if step_call.args and name is not None and trace.value(step_call.func.value, step_step) is not optimizer:
                name = dotted(step_call.args[0].value)  # scaler.step(optimizer)
            name = name or "optimizer"
            if not _synchronized_between(ctx, trace, backward.index, clip_step.index):
                yield Report(
                    _clip,
                    f"clipping before `{name}.synchronize()`: Horovod has not reduced the gradients yet, "
                    f"and its allreduce overwrites them unclipped. Call `{name}.synchronize()` before "
                    f"clipping and run the step inside `with {name}.skip_synchronize():`.",
                )
            elif not _inside_skip_synchronize(ctx, step_call):
                yield Report(
                    step_call,
                    f"`{name}.synchronize()` already reduced the gradients: a step outside "
                    f"`with {name}.skip_synchronize():` reduces them again. Wrap this step in "
                    f"`with {name}.skip_synchronize():`.",
                )


def _previous_backward(ctx: LintContext, trace: Trace, clip_step: Step) -> Step | None:
    """The backward pass the clipping follows, in the same iteration (no optimizer step between)."""
    for earlier in reversed(trace.steps[: clip_step.index]):
        for call in reversed(syntax.own_calls(earlier.node)):
            if ctx.is_backward(call):
                return earlier
            if ctx.stepped_optimizer(trace, earlier, call) is not None:
                return None
    return None


def _next_hvd_step(ctx: LintContext, trace: Trace, clip_step: Step) -> tuple[Step, cst.Call, Value] | None:
    """The Horovod optimizer step that follows the clipping, before any further backward pass."""
    for later in trace.steps[clip_step.index + 1 :]:
        for call in syntax.own_calls(later.node):
            if ctx.is_backward(call):
                return None
            optimizer = ctx.stepped_optimizer(trace, later, call)
            if optimizer is not None:
                return (later, call, optimizer) if optimizer.kind == kinds.HVD_OPTIMIZER else None
    return None


def _synchronized_between(ctx: LintContext, trace: Trace, start: int, end: int) -> bool:
    """Any `<x>.synchronize()` that is not `torch.cuda.synchronize()` between two steps."""
    for between in trace.steps[start : end + 1]:
        for call in syntax.own_calls(between.node):
            if (
                isinstance(call.func, cst.Attribute)
                and call.func.attr.value == "synchronize"
                and not (ctx.qualname(call.func) or "").startswith("torch.")
            ):
                return True
    return False


def _inside_skip_synchronize(ctx: LintContext, call: cst.Call) -> bool:
    node: cst.CSTNode | None = call
    while node is not None:
        node = ctx.parent(node)
        if isinstance(node, cst.With) and any(
            isinstance(item.item, cst.Call)
            and isinstance(item.item.func, cst.Attribute)
            and item.item.func.attr.value == "skip_synchronize"
            for item in node.items
        ):
            return True
        if isinstance(node, (cst.FunctionDef, cst.ClassDef)):
            return False
    return False
