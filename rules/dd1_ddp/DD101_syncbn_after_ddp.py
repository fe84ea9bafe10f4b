"""DD101 syncbn-after-ddp: SyncBatchNorm conversion after the DDP wrap."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import kinds, syntax
from distdoctor.lint.analysis.context import LintContext, wrapper_holding
from distdoctor.lint.finding import Fix
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.rule import Example, Report, Rule

CONVERT = "torch.nn.SyncBatchNorm.convert_sync_batchnorm"


class SyncBatchNormAfterDDP(Rule):
    """
    ## What it does
    Flags `nn.SyncBatchNorm.convert_sync_batchnorm(...)` applied to a model that is already
    wrapped in `DistributedDataParallel`, or to the module inside such a wrapper
    (`ddp_model.module`, or the name that was passed to `DDP(...)`). When the conversion sits in a
    helper called after the wrap, the finding points at that call (the line to move), not at the
    helper, which is right wherever it runs before a wrap.

    ## Why is this bad?
    It departs from the order the PyTorch documentation of `SyncBatchNorm.convert_sync_batchnorm`
    shows (convert, then wrap), and from DDP's assumption that the module does not change after
    construction. On PyTorch 1.7 and older, SyncBatchNorm refused to run unless DDP had been
    built around it, so a late conversion failed at the first forward.

    On current PyTorch the late conversion works: it replaces the BatchNorm layers inside the
    wrapper in place, the new layers keep the same parameter and buffer tensors, so DDP's
    gradient hooks and buffer broadcasts still cover them (checked on torch 2.13: the same
    `DistributedDataParallel` object comes back and every BatchNorm weight is the original
    `Parameter`). What is lost is DDP's construction-time check that SyncBatchNorm sits on a GPU:
    a CPU model then fails at its first forward instead of at the wrap.

    That is why the rule is **off by default**: on real training code none of its findings was a
    bug (0 of 4 judged). Select it (`--extend-select DD101`) to keep the documented order as a
    house style, or where code must also run on PyTorch 1.7.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ```

    ## Use instead
    ```python
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    Safe when the conversion and the wrap are plain assignments of the same name in one block and
    nothing the conversion needs is assigned between them: the conversion line is moved above the
    wrap. Otherwise no fix is offered.
    """

    code = "DD101"
    name = "syncbn-after-ddp"
    severity = "info"
    default_on = False
    summary = "convert_sync_batchnorm() applied after the model was wrapped in DDP"
    requires = (frozenset({"convert_sync_batchnorm"}),)

    invalid = (
        Example(
            """
            import torch
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = Net().cuda()
            model = DDP(model, device_ids=[local_rank])
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # expect: DD101
            """,
            fixed="""
            import torch
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = Net().cuda()
            model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # expect: DD101
            model = DDP(model, device_ids=[local_rank])
            """,
        ),
        Example(
            """
            import torch

            def main():
                net = build()
                ddp_net = torch.nn.parallel.DistributedDataParallel(net)
                ddp_net.module = torch.nn.SyncBatchNorm.convert_sync_batchnorm(ddp_net.module)  # expect: DD101
            """
        ),
        Example(
            """
            import torch.nn.parallel as par
            from torch import nn

            def wrap(m):
                return par.DistributedDataParallel(m)

            def main():
                model = wrap(Net())
                model = nn.SyncBatchNorm.convert_sync_batchnorm(model)  # expect: DD101
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel

            class Trainer:
                def __init__(self, model):
                    self.model = DistributedDataParallel(model)

                def enable_syncbn(self):
                    self.model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.model)  # expect: DD101
            """
        ),
        Example(
            """
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel

            def to_sync_bn(model):
                return nn.SyncBatchNorm.convert_sync_batchnorm(model)

            def main(net, local_rank, sync_bn):
                model = DistributedDataParallel(net.cuda(), device_ids=[local_rank])
                if sync_bn:
                    model = to_sync_bn(model)  # expect: DD101
                return model

            main(Net(), 0, True)
            """
        ),
    )
    valid = (
        Example(
            # Each phase converts then wraps the model it is given; the previous phase's
            # wrapper is not what this phase converts.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            class Trainer:
                def _net_to_device(self):
                    self.net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(self.net)
                    self.net = DDP(self.net, device_ids=[0])

                def train(self, model):
                    self.net = model
                    self._net_to_device()
                    for batch in loader:
                        self.net(batch).sum().backward()

                def test(self, model=None):
                    keep_model = self.net
                    if model is not None:
                        self.net = model
                    else:
                        existing = self.net
                        self.net = existing
                    self._net_to_device()
                    self.net = keep_model  # back to the trained wrapper for more training

                def calibrate(self, model):
                    self.train(model)
                    self.test(model)
                    self.train(model)

            Trainer().calibrate(build())
            """
        ),
        Example(
            # The wrap in a branch that returns is not on the path to the conversion below it.
            """
            import os
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def make_ddp(model, workers):
                for worker in range(1, workers):
                    if os.fork() == 0:  # the child process converts and wraps its copy, and leaves
                        model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
                        ddp = DDP(model, device_ids=[worker])
                        return ddp
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
                return DDP(model.cuda(0), device_ids=[0])

            model = make_ddp(Net(), 4)
            """
        ),
        Example(
            """
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel

            def to_sync_bn(model):
                return nn.SyncBatchNorm.convert_sync_batchnorm(model)

            def main(net, local_rank):
                model = DistributedDataParallel(to_sync_bn(net).cuda(), device_ids=[local_rank])
                return model

            main(Net(), 0)
            """
        ),
        Example(
            """
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = nn.SyncBatchNorm.convert_sync_batchnorm(Net())
            model = DDP(model)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def build():
                return torch.nn.SyncBatchNorm.convert_sync_batchnorm(Net())

            def wrap(m):
                return DDP(m)

            model = wrap(build())
            """
        ),
        Example(
            """
            import torch

            class DDP(torch.nn.Module):  # a local class, not DistributedDataParallel
                pass

            model = DDP(net)
            model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
        Example(
            """
            import torch

            def convert(model):
                return torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.calls(CONVERT):
            target = call.args[0].value if call.args else None
            if target is None:
                continue
            wrapper = _wrapper_of(trace, step, target)
            if wrapper is None or _wrapped_by_an_earlier_call_of_this_function(trace, step, wrapper):
                continue
            wrap_line = ctx.position(wrapper.node).start.line
            at = _line_to_change(ctx, trace, step, call, wrapper)
            yield Report(
                at,
                f"convert_sync_batchnorm() runs after the model was wrapped in DistributedDataParallel "
                f"(line {wrap_line}), against the documented order (PyTorch 1.7 and older fail at the first "
                f"forward). Convert first, then wrap: move this conversion above line {wrap_line}.",
                fix=_move_above_wrap(ctx, trace, step, call, wrapper) if at is call else None,
            )


def _wrapped_by_an_earlier_call_of_this_function(trace: Trace, step: Step, wrapper: Value) -> bool:
    """The wrap ran in an earlier call of the very function that converts (`_net_to_device()`:
    convert, then wrap, run once per phase of a trainer). Within each call the order is right;
    what a previous call wrapped is not what this call converts before wrapping again."""
    wrap_step = trace.last_step_before(wrapper.node, step)
    if wrap_step is None or wrap_step.frame is step.frame:
        return False
    function = step.frame.function
    return function is not None and wrap_step.frame.function is function


def _line_to_change(ctx: LintContext, trace: Trace, step: Step, call: cst.Call, wrapper: Value) -> cst.CSTNode:
    """Where the conversion must move: the conversion itself, or, when it sits in a helper
    (`def to_sync_bn(m): return convert_sync_batchnorm(m)`) that was entered after the wrap,
    the call to that helper (the helper is right when called before the wrap)."""
    wrap_step = next((s for s in trace.steps if any(c is wrapper.node for c in syntax.own_calls(s.node))), None)
    if wrap_step is None:
        return call
    node: cst.CSTNode = call
    frame = step.frame
    while frame.call is not None and frame.parent is not None and not any(f is frame for f in wrap_step.frame.chain()):
        if not _in_source(ctx, frame.call):  # a function traced on its own: no caller in the file
            break
        node, frame = frame.call, frame.parent
    return node


def _in_source(ctx: LintContext, node: cst.CSTNode) -> bool:
    try:
        ctx.position(node)
    except KeyError:
        return False
    return True


def _wrapper_of(trace: Trace, step: Step, target: cst.BaseExpression) -> Value | None:
    """The DDP wrapper that already holds the module being converted: the wrapper itself, its
    `.module`, or the name that was passed to `DDP(...)`."""
    value = trace.value(target, step)
    if value is not None and value.kind == kinds.DDP:
        return value
    return wrapper_holding(trace, step, target)


def _move_above_wrap(ctx: LintContext, trace: Trace, step: Step, call: cst.Call, wrapper: Value) -> Fix | None:
    convert_stmt = step.node
    if not (
        isinstance(convert_stmt, cst.Assign)
        and convert_stmt.value is call
        and isinstance(step.line, cst.SimpleStatementLine)
        and len(step.line.body) == 1
        and len(convert_stmt.targets) == 1
    ):
        return None
    wrap_step = next(
        (
            s
            for s in trace.steps
            if isinstance(s.node, cst.Assign) and s.node.value is wrapper.node and s.frame is step.frame
        ),
        None,
    )
    if wrap_step is None or wrap_step.block is None or step.block is None:
        return None
    if wrap_step.block[0] is not step.block[0] or not isinstance(wrap_step.line, cst.SimpleStatementLine):
        return None
    name = convert_stmt.targets[0].target
    wrap_target = wrap_step.node.targets[0].target if len(wrap_step.node.targets) == 1 else None
    if not (isinstance(name, cst.Name) and isinstance(wrap_target, cst.Name) and name.value == wrap_target.value):
        return None
    if not call.args or not isinstance(call.args[0].value, cst.Name) or call.args[0].value.value != name.value:
        return None
    # Names the conversion reads must not be (re)bound between the wrap and the conversion.
    needed = {node.value for node in _names_in(call) if node.value != name.value}
    between = trace.steps[wrap_step.index + 1 : step.index]
    for other in between:
        if other.frame is step.frame and isinstance(other.node, (cst.Assign, cst.AugAssign, cst.AnnAssign)):
            bound = {n.value for n in _names_in(other.node.targets[0].target if isinstance(other.node, cst.Assign) else other.node.target)}
            if bound & needed:
                return None
    text = ctx.line_text(step.line)
    return Fix(
        message="move the conversion above the DDP wrap",
        edits=(ctx.insert_before(wrap_step.line, text), ctx.delete_lines(step.line)),
    )


def _names_in(node: cst.CSTNode) -> list[cst.Name]:
    return [sub for sub in syntax.walk(node) if isinstance(sub, cst.Name)]
