"""DD104 lr-not-scaled-with-world-size: the global batch grows with the GPUs, the learning rate not."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor import flow
from distdoctor.context import LintContext
from distdoctor.rule import Example, Report, Rule

DDP = "torch.nn.parallel.DistributedDataParallel"
LOADER = "torch.utils.data.DataLoader"


class LrNotScaledWithWorldSize(Rule):
    """
    ## What it does
    In a script that trains a `DistributedDataParallel` model, flags a `torch.optim` optimizer
    whose learning rate does not involve the world size (`dist.get_world_size()`, `WORLD_SIZE`,
    directly or through a variable) while no `DataLoader` divides its per-rank batch size by the
    world size and no later `param_groups[...]["lr"] = ...` scales it. Off by default.

    ## Why is this bad?
    Each rank loads `batch_size` samples, so the global batch is `batch_size * world_size` and
    grows with every GPU added, while the learning rate stays the one tuned for one GPU. The
    linear scaling rule (Goyal et al., 2017) multiplies the learning rate by the same factor,
    usually with a warm-up. This is advice, not a law: adaptive optimizers and tuned recipes often
    do without, which is why the rule is off by default.

    ## Example
    ```python
    loader = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ```

    ## Use instead
    ```python
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1 * dist.get_world_size())
    ```

    ## Fix safety
    No autofix: whether and how to scale is a recipe decision.
    """

    code = "DD104"
    name = "lr-not-scaled-with-world-size"
    severity = "info"
    default_on = False
    summary = "DDP learning rate independent of the world size"

    invalid = (
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            from torch.utils.data import DataLoader, DistributedSampler

            loader = DataLoader(ds, batch_size=64, sampler=DistributedSampler(ds))
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)  # expect: DD104
            """
        ),
        Example(
            """
            import argparse
            import torch
            import torch.nn as nn

            parser = argparse.ArgumentParser()
            parser.add_argument("--lr", type=float, default=3e-4)
            args = parser.parse_args()

            def main(gpu):
                model = nn.parallel.DistributedDataParallel(Net().cuda(gpu), device_ids=[gpu])
                optimizer = torch.optim.AdamW(model.parameters(), args.lr)  # expect: DD104
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel

            BASE_LR = 0.01

            class Trainer:
                def __init__(self, net, gpu):
                    self.model = DistributedDataParallel(net, device_ids=[gpu])
                    self.optimizer = torch.optim.SGD(self.model.parameters(), lr=BASE_LR)  # expect: DD104
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            lr = args.base_lr * dist.get_world_size()
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            """
        ),
        Example(
            """
            import os
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            from torch.utils.data import DataLoader, DistributedSampler

            world_size = int(os.environ["WORLD_SIZE"])
            loader = DataLoader(ds, batch_size=args.global_batch // world_size, sampler=DistributedSampler(ds))
            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for group in optimizer.param_groups:
                group["lr"] = 0.1 * dist.get_world_size()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if ctx.uses_horovod or next(iter(ctx.calls(DDP)), None) is None:
            return
        for trace, step, call in ctx.calls(LOADER):
            batch = flow.argument(call, 1, "batch_size")
            if batch is not None and _scaled(ctx, trace, step, batch):
                return
        if _lr_rescaled_later(ctx):
            return
        for trace in ctx.traces:
            for step, call in trace.calls():
                value = trace.value(call, step)
                if value is None or value.kind != flow.OPTIMIZER:
                    continue
                lr = flow.argument(call, 1, "lr")
                if lr is None or _scaled(ctx, trace, step, lr):
                    continue
                yield Report(
                    call,
                    "the learning rate does not depend on the world size while each rank keeps its own batch size, "
                    "so the global batch grows with every GPU: consider the linear scaling rule "
                    "(`lr = base_lr * dist.get_world_size()`, with warm-up).",
                )


WORKER_COUNT_WORDS = ("world", "gpus", "gpu_count", "n_gpu", "nproc", "replicas", "num_workers_total", "nodes")


def _scaled(ctx: LintContext, trace: flow.Trace, step: flow.Step, expr: cst.BaseExpression) -> bool:
    """Scaled by the world size, or by a name that counts the workers (`world_size` passed to an
    `mp.spawn` worker, `ngpus_per_node`)."""
    if ctx.scales_with_world_size(trace, step, expr):
        return True
    found = False

    class Finder(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            nonlocal found
            if any(word in node.value.lower() for word in WORKER_COUNT_WORDS):
                found = True

    expr.visit(Finder())
    return found


def _lr_rescaled_later(ctx: LintContext) -> bool:
    """`group["lr"] = ... * world_size` anywhere: the script scales it in its own way."""
    for trace in ctx.traces:
        for step in trace.steps:
            node = step.node
            if not isinstance(node, cst.Assign):
                continue
            for target in node.targets:
                if (
                    isinstance(target.target, cst.Subscript)
                    and len(target.target.slice) == 1
                    and isinstance(target.target.slice[0].slice, cst.Index)
                    and isinstance(target.target.slice[0].slice.value, cst.SimpleString)
                    and target.target.slice[0].slice.value.evaluated_value == "lr"
                    and _scaled(ctx, trace, step, node.value)
                ):
                    return True
    return False
