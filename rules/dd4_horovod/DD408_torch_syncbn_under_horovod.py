"""DD408 torch-syncbn-under-horovod: torch's SyncBatchNorm in a Horovod script without a
torch.distributed process group."""

from __future__ import annotations

from collections.abc import Iterable

from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule

TORCH_SYNCBN = ("torch.nn.SyncBatchNorm", "torch.nn.SyncBatchNorm.convert_sync_batchnorm")


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
    is not reported.

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
        for _, _, call in ctx.calls(*TORCH_SYNCBN):
            what = "convert_sync_batchnorm()" if (ctx.qualname(call.func) or "").endswith("convert_sync_batchnorm") else "nn.SyncBatchNorm"
            yield Report(
                call,
                f"torch's {what} synchronises through torch.distributed, which this Horovod script never "
                f"initialises: it silently trains as per-rank BatchNorm. Use `hvd.SyncBatchNorm` layers "
                f"instead (or initialise a torch.distributed process group).",
            )
