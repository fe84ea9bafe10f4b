"""DD407 hvd-broadcast-named-parameters: a generator passed to hvd.broadcast_parameters."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import kinds, names, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.finding import Edit, Fix
from distdoctor.lint.rule import Example, Report, Rule

BROADCAST = "horovod.torch.broadcast_parameters"
GENERATORS = ("parameters", "named_parameters")


class HorovodBroadcastNamedParameters(Rule):
    """
    ## What it does
    Flags `hvd.broadcast_parameters(model.named_parameters(), ...)` and
    `hvd.broadcast_parameters(model.parameters(), ...)`, directly or through a name bound to
    such a call.

    ## Why is this bad?
    `broadcast_parameters` accepts a dict or a list (see `horovod/torch/functions.py`); the
    generators that `parameters()` and `named_parameters()` return are neither, so the call raises
    `ValueError: invalid params of type: <class 'generator'>` on every rank. Even wrapped in
    `list(...)`, the parameters alone leave the buffers out: BatchNorm running statistics stay
    different on every rank. Horovod's documentation broadcasts `model.state_dict()`, which holds
    parameters and buffers.

    `list(model.named_parameters())` and `dict(model.named_parameters())` are accepted by Horovod
    and are not reported.

    ## Example
    ```python
    hvd.broadcast_parameters(model.named_parameters(), root_rank=0)
    ```

    ## Use instead
    ```python
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    ```

    ## Fix safety
    Safe when the argument is the call itself: `model.named_parameters()` or `model.parameters()`
    becomes `model.state_dict()` (the tensors it returns share storage with the model, so the
    in-place broadcast updates the model, buffers included). No fix when the generator comes
    through a variable.
    """

    code = "DD407"
    name = "hvd-broadcast-named-parameters"
    severity = "error"
    summary = "hvd.broadcast_parameters() given parameters()/named_parameters() instead of state_dict()"
    requires = (frozenset({"broadcast_parameters"}),)

    invalid = (
        Example(
            """
            import horovod.torch as hvd

            hvd.init()
            model = Net()
            hvd.broadcast_parameters(model.named_parameters(), root_rank=0)  # expect: DD407
            """,
            fixed="""
            import horovod.torch as hvd

            hvd.init()
            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # expect: DD407
            """,
        ),
        Example(
            """
            from horovod import torch as horovod_torch

            class Trainer:
                def __init__(self, net):
                    self.net = net.cuda()
                    horovod_torch.broadcast_parameters(self.net.parameters(), 0)  # expect: DD407
            """,
            fixed="""
            from horovod import torch as horovod_torch

            class Trainer:
                def __init__(self, net):
                    self.net = net.cuda()
                    horovod_torch.broadcast_parameters(self.net.state_dict(), 0)  # expect: DD407
            """,
        ),
        Example(
            """
            import horovod.torch
            import torch.nn as nn
            from horovod.torch import broadcast_parameters

            class Net(nn.Module):
                pass

            def sync(model):
                params = model.named_parameters()
                broadcast_parameters(params, root_rank=0)  # expect: DD407

            def main():
                horovod.torch.init()
                sync(Net())
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            model = Net()
            hvd.broadcast_parameters(params=model.module.named_parameters(prefix="m"), root_rank=0)  # expect: DD407
            """,
            fixed="""
            import horovod.torch as hvd

            model = Net()
            hvd.broadcast_parameters(params=model.module.state_dict(), root_rank=0)  # expect: DD407
            """,
        ),
    )
    valid = (
        Example(
            """
            import horovod.torch as hvd

            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            model = Net()
            # A list is accepted by Horovod (buffers are a deliberate omission here).
            hvd.broadcast_parameters(list(model.named_parameters()), root_rank=0)
            hvd.broadcast_parameters(dict(model.named_parameters()), root_rank=0)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def broadcast_parameters(params, root_rank):  # a local helper, not Horovod's
                for p in params:
                    hvd.broadcast_(p, root_rank)

            broadcast_parameters(model.parameters(), 0)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            params = [p for p in model.parameters() if p.requires_grad]
            hvd.broadcast_parameters(params, root_rank=0)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.calls(BROADCAST):
            arg = syntax.argument(call, 0, "params")
            if arg is None:
                continue
            method = _generator_method(arg)
            if method is None:
                if not isinstance(arg, (cst.Name, cst.Attribute)):
                    continue  # list(...), dict(...), a comprehension: accepted by Horovod
                value = trace.value(arg, step)
                if value is None or value.kind != kinds.PARAMS or value.attrs.get("method") not in GENERATORS:
                    continue
                method = value.attrs["method"]
            fix = None
            if isinstance(arg, cst.Call):
                fix = _to_state_dict(ctx, arg)
            yield Report(
                arg,
                f"broadcast_parameters() needs a dict or a list: `{method}()` is a generator (a "
                f"ValueError on every rank) and leaves the buffers out. Pass `<model>.state_dict()`.",
                fix=fix,
            )


def _generator_method(arg: cst.BaseExpression) -> str | None:
    if (
        isinstance(arg, cst.Call)
        and isinstance(arg.func, cst.Attribute)
        and arg.func.attr.value in GENERATORS
        and names.dotted(arg.func.value) is not None
    ):
        return arg.func.attr.value
    return None


def _to_state_dict(ctx: LintContext, arg: cst.Call) -> Fix | None:
    if not isinstance(arg.func, cst.Attribute):
        return None
    start = ctx.position(arg.func.attr).start
    end = ctx.position(arg).end
    return Fix(
        message="broadcast `state_dict()` instead",
        edits=(Edit(start.line, start.column + 1, end.line, end.column + 1, "state_dict()"),),
    )
