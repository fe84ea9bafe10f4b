"""DD104 lr-not-scaled-with-world-size: the global batch grows with the GPUs, the learning rate not."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, is_lr_slot
from distdoctor.lint.analysis.scaling import batch_divided_by_workers, scaled_by_workers
from distdoctor.lint.rule import Example, Report, Rule

DDP = frameworks.DDP


class LrNotScaledWithWorldSize(Rule):
    """
    ## What it does
    In a script that trains a `DistributedDataParallel` model, flags a `torch.optim` optimizer
    whose learning rate does not involve the world size (`dist.get_world_size()`, `WORLD_SIZE`,
    directly or through a variable) while no `DataLoader` divides its per-rank batch size by the
    world size and no later `param_groups[...]["lr"] = ...` scales it. Off by default.

    Names are followed to what they were assigned, also through a helper's parameter: a batch
    size divided by the number of GPUs before the loader (`args.batch_size =
    int(args.batch_size / ngpus_per_node)`, as in pytorch/examples ImageNet: the global batch
    stays the command line's), or `group["lr"] = lr_schedule[it]` where the schedule was built
    from `base_lr * get_world_size()` (DINO's `lr=0` placeholder), count as scaled. A name that
    counts the workers (`world_size`, `ngpus_per_node`, `nodes`), or `torch.cuda.device_count()`,
    counts as the world size.

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
    requires = (frameworks.DDP_WORDS,)

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
        Example(
            """
            import torch
            import torch.multiprocessing as mp
            from torch.nn.parallel import DistributedDataParallel
            from torch.utils.data import DataLoader, DistributedSampler

            def worker(gpu, num_gpus, opts):
                # the batch on the command line is the node's: each process takes its share
                opts.batch = opts.batch // num_gpus
                loader = DataLoader(train_set, batch_size=opts.batch, sampler=DistributedSampler(train_set))
                net = DistributedDataParallel(Net().cuda(gpu), device_ids=[gpu])
                opt = torch.optim.SGD(net.parameters(), lr=opts.lr, momentum=0.9)

            if __name__ == "__main__":
                count = torch.cuda.device_count()
                mp.spawn(worker, args=(count, parse()), nprocs=count)
            """
        ),
        Example(
            """
            import numpy as np
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            def one_epoch(net, opt, loader, schedule, epoch):
                for i, (x, y) in enumerate(loader):
                    step = epoch * len(loader) + i
                    for group in opt.param_groups:
                        group["lr"] = schedule[step]  # the schedule already holds the scaled rate
                    loss = net(x, y)
                    loss.backward()
                    opt.step()

            def main(cfg):
                net = DDP(Model().cuda(), device_ids=[cfg.local_rank])
                opt = torch.optim.AdamW(net.parameters(), lr=0.0)  # set every step below
                peak = cfg.base_lr * cfg.batch_per_gpu * dist.get_world_size() / 256
                schedule = np.linspace(peak, 0.0, cfg.epochs * len(loader))
                for epoch in range(cfg.epochs):
                    one_epoch(net, opt, loader, schedule, epoch)

            if __name__ == "__main__":
                main(get_cfg())
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if ctx.uses_horovod or next(iter(ctx.calls(DDP)), None) is None:
            return
        if batch_divided_by_workers(ctx):
            return
        if _lr_rescaled_later(ctx):
            return
        for trace in ctx.traces:
            for step, call in trace.calls():
                value = trace.value(call, step)
                if value is None or value.kind != kinds.OPTIMIZER:
                    continue
                lr = syntax.argument(call, 1, "lr")
                if lr is None or scaled_by_workers(ctx, trace, step, lr):
                    continue
                yield Report(
                    call,
                    "the learning rate does not depend on the world size while each rank keeps its own batch size, "
                    "so the global batch grows with every GPU: consider the linear scaling rule "
                    "(`lr = base_lr * dist.get_world_size()`, with warm-up).",
                )






def _lr_rescaled_later(ctx: LintContext) -> bool:
    """`group["lr"] = ... * world_size` anywhere: the script scales it in its own way."""
    for trace in ctx.traces:
        for step in trace.steps:
            node = step.node
            if not isinstance(node, cst.Assign):
                continue
            for target in node.targets:
                if is_lr_slot(target.target) and scaled_by_workers(ctx, trace, step, node.value):
                    return True
    return False
