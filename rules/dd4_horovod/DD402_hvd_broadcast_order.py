"""DD402 hvd-broadcast-order: Horovod broadcasts that miss the training state."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import evaluate, frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

BROADCAST_PARAMS = "horovod.torch.broadcast_parameters"
BROADCAST_OPT = "horovod.torch.broadcast_optimizer_state"


class HorovodBroadcastOrder(Rule):
    """
    ## What it does
    Flags a Horovod broadcast that does not cover the state training starts from:
    `hvd.broadcast_optimizer_state(opt)` before `opt` is created (or when `opt` is replaced by a
    new optimizer afterwards), `hvd.broadcast_parameters(model.state_dict())` before the model is
    created or before a checkpoint is restored on rank 0 only (`load_state_dict` under a rank-0
    guard after the broadcast), and any broadcast that runs under a rank guard.

    ## Why is this bad?
    Horovod does not synchronise weights by itself: the broadcast from rank 0 is the only thing
    that makes all workers start from the same state. A broadcast of the wrong object, or one made
    before rank 0 restored its checkpoint, leaves the workers training different models whose
    averaged gradients fit none of them. A broadcast under `if hvd.rank() == 0` is a collective
    only rank 0 joins: the job hangs.

    ## Example
    ```python
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.rank() == 0:
        model.load_state_dict(torch.load(checkpoint))
    ```

    ## Use instead
    ```python
    if hvd.rank() == 0:
        model.load_state_dict(torch.load(checkpoint))
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ```

    ## Fix safety
    No automatic fix: moving a broadcast changes which state every worker trains from.
    """

    code = "DD402"
    name = "hvd-broadcast-order"
    severity = "error"
    summary = "Horovod broadcast before the state it must cover exists"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)  # expect: DD402
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # expect: DD402
            if hvd.rank() == 0:
                model.load_state_dict(torch.load("ckpt.pt"))
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def main():
                model = Net()
                if hvd.rank() == 0:
                    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # expect: DD402
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def main(args):
                model = Net()
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # expect: DD402
                if args.pretrained:
                    model = PretrainedNet()
                model = model.cuda()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            class Trainer:
                def __init__(self):
                    self.model = Net()
                    self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1 * hvd.size())
                    hvd.broadcast_optimizer_state(self.opt, root_rank=0)  # expect: DD402
                    self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3 * hvd.size())
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
            if hvd.rank() == 0:
                model.load_state_dict(torch.load("ckpt.pt"))
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size())
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def main():
                model = Net()
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                model = model.cuda()  # the same model, moved
                model = torch.compile(model)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def sync(model, optimizer):
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            model.load_state_dict(torch.load("ckpt.pt"))  # every rank loads the same file
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        for kind in (BROADCAST_PARAMS, BROADCAST_OPT):
            for trace, step, call in ctx.calls(kind):
                message = self._problem(ctx, trace, step, call, kind)
                if message is not None:
                    yield Report(call, message)

    def _problem(self, ctx: LintContext, trace: Trace, step: Step, call: cst.Call, kind: str) -> str | None:
        api = "broadcast_parameters" if kind == BROADCAST_PARAMS else "broadcast_optimizer_state"
        if ctx.rank_guards(trace, step):
            return (
                f"hvd.{api}() runs under a rank condition: it is a collective every worker must join, "
                f"so the others wait forever. Call it on all ranks."
            )
        arg = syntax.argument(call, 0, "params" if kind == BROADCAST_PARAMS else "optimizer")
        if arg is None:
            return None
        target = _broadcast_object(arg, kind)
        if target is None:
            return None
        later = _later_bindings(trace, step, target)
        if trace.value(target, step) is None or _is_unknown_param(step, target):
            if later and not _is_unknown_param(step, target):
                what = "model" if kind == BROADCAST_PARAMS else "optimizer"
                line = ctx.position(later[0].node).start.line
                return (
                    f"hvd.{api}() runs before the {what} `{dotted(target)}` is created (line {line}): "
                    f"it broadcasts nothing useful. Broadcast after line {line}."
                )
            return None
        if kind == BROADCAST_OPT:
            before = trace.value(target, step)
            for later_step in later:
                value = trace.value(later_step.node.value, later_step) if isinstance(later_step.node, cst.Assign) else None
                if value is None:
                    continue
                new = value.inner if value.kind == kinds.HVD_OPTIMIZER else value
                if value.kind in (kinds.OPTIMIZER, kinds.HVD_OPTIMIZER) and new is not None and not new.same_object(before):
                    if new.kind == kinds.OPTIMIZER:
                        line = ctx.position(later_step.node).start.line
                        return (
                            f"the optimizer `{dotted(target)}` is replaced on line {line} after "
                            f"hvd.broadcast_optimizer_state(): the optimizer that trains was never "
                            f"broadcast. Broadcast the final optimizer, after line {line}."
                        )
        if kind == BROADCAST_PARAMS:
            name = dotted(target)
            for later_step in later:
                rhs = later_step.node.value if isinstance(later_step.node, cst.Assign) else None
                if rhs is not None and name not in _dotted_names(rhs):
                    line = ctx.position(later_step.node).start.line
                    return (
                        f"the model `{name}` is replaced on line {line} after "
                        f"hvd.broadcast_parameters(): the model that trains was never broadcast. "
                        f"Broadcast after line {line}."
                    )
        restore = self._rank_zero_restore_after(ctx, trace, step, target)
        if restore is not None:
            line = ctx.position(restore).start.line
            return (
                f"rank 0 restores a checkpoint on line {line}, after hvd.{api}(): the other workers "
                f"keep their initial state. Broadcast after the restore."
            )
        return None

    def _rank_zero_restore_after(self, ctx: LintContext, trace: Trace, step: Step, target: cst.BaseExpression) -> cst.CSTNode | None:
        name = dotted(target)
        if name is None:
            return None
        value = trace.value(target, step)
        for later in trace.steps[step.index + 1 :]:
            for call in syntax.own_calls(later.node):
                func = call.func
                if not (isinstance(func, cst.Attribute) and func.attr.value == "load_state_dict"):
                    continue
                receiver = trace.value(func.value, later)
                same = dotted(func.value) == name or (value is not None and receiver is not None and value.same_object(receiver))
                if same and any(guard.zero for guard in ctx.rank_guards(trace, later)):
                    return call
        return None


def _broadcast_object(arg: cst.BaseExpression, kind: str) -> cst.BaseExpression | None:
    """`model` in `model.state_dict()`; the optimizer expression itself for optimizer state."""
    if kind == BROADCAST_OPT:
        return arg if dotted(arg) is not None else None
    if isinstance(arg, cst.Call) and isinstance(arg.func, cst.Attribute) and arg.func.attr.value in (
        "state_dict",
        "named_parameters",
        "parameters",
    ):
        receiver = arg.func.value
        if isinstance(receiver, cst.Attribute) and receiver.attr.value == "module":
            receiver = receiver.value
        return receiver if dotted(receiver) is not None else None
    return None


def _dotted_names(node: cst.CSTNode) -> set[str]:
    return {text for sub in syntax.walk(node) if (text := dotted(sub)) is not None}


def _later_bindings(trace: Trace, step: Step, target: cst.BaseExpression) -> list[Step]:
    """Later steps of the same function that assign the same name."""
    key = evaluate.env_key(target, step.frame)
    found = []
    for later in trace.steps[step.index + 1 :]:
        if later.frame is not step.frame or not isinstance(later.node, cst.Assign):
            continue
        if any(evaluate.env_key(t.target, later.frame) == key for t in later.node.targets):
            found.append(later)
    return found


def _is_unknown_param(step: Step, target: cst.BaseExpression) -> bool:
    """A parameter of the function the trace started in: bound by a caller we cannot see."""
    function = step.frame.function
    if function is None or not isinstance(target, cst.Name):
        return False
    return any(param.name.value == target.value for param in function.params.params)
