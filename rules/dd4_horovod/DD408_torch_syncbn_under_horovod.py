"""DD408 torch-syncbn-under-horovod: torch's SyncBatchNorm in a Horovod script without a
torch.distributed process group."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

TORCH_SYNCBN = ("torch.nn.SyncBatchNorm", "torch.nn.SyncBatchNorm.convert_sync_batchnorm")
HOROVOD_WORDS = frozenset({"horovod", "hvd"})


class TorchSyncBatchNormUnderHorovod(Rule):
    """
    ## What it does
    Flags `torch.nn.SyncBatchNorm(...)` and `torch.nn.SyncBatchNorm.convert_sync_batchnorm(...)`
    in a Horovod script that never initialises a `torch.distributed` process group.

    ## Why is this bad?
    torch's `SyncBatchNorm` synchronises its statistics through `torch.distributed`; when no
    process group is initialised, its `forward` silently falls back to plain, per-rank BatchNorm.
    Horovod does not create a `torch.distributed` process group, so the model trains with
    unsynchronised statistics and nothing says so. Horovod ships its own
    `hvd.SyncBatchNorm`, which synchronises through Horovod's allreduce/allgather.

    A script that also calls `init_process_group` (or a helper named like `init_distributed_mode`)
    is not reported, and neither is a call that runs only when Horovod is off: under
    `if args.distributed and not args.horovod:`, in the `else` of `if use_horovod:`, or after
    `if args.horovod: return` (the torch.distributed path of a script that supports both).

    ## Example
    ```python
    hvd.init()
    model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ```

    ## Use instead
    ```python
    hvd.init()
    # build the model with hvd.SyncBatchNorm in place of nn.BatchNorm2d
    self.bn = hvd.SyncBatchNorm(64)
    ```

    ## Fix safety
    No fix: Horovod has no `convert_sync_batchnorm`, so the replacement is a change to how the
    model is built.
    """

    code = "DD408"
    name = "torch-syncbn-under-horovod"
    severity = "warning"
    summary = "torch.nn.SyncBatchNorm under Horovod without a torch.distributed process group"
    requires = (frameworks.HOROVOD_WORDS, frozenset({"SyncBatchNorm", "convert_sync_batchnorm"}))

    invalid = (
        Example(
            """
            import torch.nn as nn
            import horovod.torch as hvd

            hvd.init()
            model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model())  # expect: DD408
            """
        ),
        Example(
            """
            import torch
            from horovod import torch as hvd

            class Block(torch.nn.Module):
                def __init__(self, channels):
                    super().__init__()
                    self.bn = torch.nn.SyncBatchNorm(channels)  # expect: DD408
            """
        ),
        Example(
            """
            import horovod.torch
            from torch.nn import SyncBatchNorm

            def build(args):
                model = make(args)
                if args.sync_bn:
                    model = SyncBatchNorm.convert_sync_batchnorm(model)  # expect: DD408
                return model

            horovod.torch.init()
            net = build(args)
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            if args.horovod:
                hvd.init()
            if args.distributed or not args.horovod:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)  # expect: DD408
            """
        ),
    )
    valid = (
        Example(
            """
            import torch.nn as nn
            import horovod.torch as hvd

            class Block(nn.Module):
                def __init__(self, channels):
                    super().__init__()
                    self.bn = hvd.SyncBatchNorm(channels)
            """
        ),
        Example(
            """
            import torch.nn as nn
            import torch.distributed as dist
            import horovod.torch as hvd

            hvd.init()
            dist.init_process_group("gloo", rank=hvd.rank(), world_size=hvd.size())
            model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model())
            """
        ),
        Example(
            """
            import torch.nn as nn
            import torch.distributed as dist

            # torch.distributed only: DD408 is about Horovod scripts
            dist.init_process_group("nccl")
            model = nn.SyncBatchNorm.convert_sync_batchnorm(build_model())
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            # one script, two back ends: torch's SyncBatchNorm only on the torch.distributed path
            if args.use_horovod:
                hvd.init()
            else:
                setup_process_group(args)  # a helper of another module
            model = build_model()
            if args.distributed and not args.use_horovod:
                model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            class SyncBatchNorm:  # a local class
                @staticmethod
                def convert_sync_batchnorm(m):
                    return m

            model = SyncBatchNorm.convert_sync_batchnorm(model)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod or ctx.process_group_initialised:
            return
        for _, step, call in ctx.calls(*TORCH_SYNCBN):
            if any(_off_when(guard.test, not guard.negated) for guard in step.guards):
                continue
            what = "convert_sync_batchnorm()" if (ctx.qualname(call.func) or "").endswith("convert_sync_batchnorm") else "nn.SyncBatchNorm"
            yield Report(
                call,
                f"torch's {what} synchronises through torch.distributed, which this Horovod script never "
                f"initialises: it silently trains as per-rank BatchNorm. Use `hvd.SyncBatchNorm` layers "
                f"instead (or initialise a torch.distributed process group).",
            )


def _off_when(test: cst.BaseExpression, truth: bool) -> bool:
    """Whether `test` having the truth value `truth` means Horovod is not in use: `not
    args.horovod` true, `use_hvd` false, `args.backend != "horovod"` true, or an `and` with such
    a term true."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        return _off_when(test.expression, not truth)
    if isinstance(test, cst.BooleanOperation):
        left, right = _off_when(test.left, truth), _off_when(test.right, truth)
        both_known = isinstance(test.operator, cst.And) == truth  # `a and b` true, `a or b` false
        return (left or right) if both_known else (left and right)
    if isinstance(test, (cst.Name, cst.Attribute)):
        return not truth and _names_horovod(test)
    if isinstance(test, cst.Comparison) and len(test.comparisons) == 1:
        target = test.comparisons[0]
        sides = (test.left, target.comparator)
        if any(isinstance(side, cst.SimpleString) and side.evaluated_value.lower() in HOROVOD_WORDS for side in sides):
            if isinstance(target.operator, cst.Equal):
                return not truth
            if isinstance(target.operator, cst.NotEqual):
                return truth
    return False


def _names_horovod(expr: cst.BaseExpression) -> bool:
    """`args.horovod`, `use_horovod`, `cfg.use_hvd`: a flag whose name says Horovod."""
    text = dotted(expr) or ""
    last = text.rsplit(".", 1)[-1].lower()
    return bool(HOROVOD_WORDS & set(re.split(r"_+", last)))
