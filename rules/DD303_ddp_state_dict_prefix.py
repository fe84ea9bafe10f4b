"""DD303 ddp-state-dict-prefix: saving the DDP wrapper's state_dict (keys start with `module.`)."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor import flow
from distdoctor.context import LintContext
from distdoctor.finding import Edit, Fix
from distdoctor.rule import Example, Report, Rule

SAVE = "torch.save"


class DDPStateDictPrefix(Rule):
    """
    ## What it does
    Flags `ddp_model.state_dict()` whose result is saved with `torch.save`, directly, inside a
    checkpoint dict, through a variable, or through a helper that saves what it is given, when
    `ddp_model` is a `DistributedDataParallel` wrapper.

    ## Why is this bad?
    The wrapper holds the model as its `module` attribute, so every key of its state dict starts
    with `module.` (`module.fc.weight`). The checkpoint then fails to load into the plain model
    (`Missing key(s) in state_dict: "fc.weight"`, for evaluation, export or a single-GPU run),
    unless every loader strips the prefix by hand.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    ...
    torch.save({"model": model.state_dict()}, "ckpt.pt")
    ```

    ## Use instead
    ```python
    torch.save({"model": model.module.state_dict()}, "ckpt.pt")
    ```

    ## Fix safety
    Safe: `.module` is inserted before `.state_dict()`. The saved keys lose the `module.` prefix,
    which is what a plain model (and `ddp_model.module.load_state_dict`) expects; a loader in the
    same project that loads into the wrapper itself must change to `model.module.load_state_dict`
    too.
    """

    code = "DD303"
    name = "ddp-state-dict-prefix"
    severity = "warning"
    summary = "saved state_dict of the DDP wrapper: keys carry the `module.` prefix"

    invalid = (
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            train(model)
            if rank == 0:
                torch.save(model.state_dict(), "model.pt")  # expect: DD303
            """,
            fixed="""
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            train(model)
            if rank == 0:
                torch.save(model.module.state_dict(), "model.pt")  # expect: DD303
            """,
        ),
        Example(
            """
            import torch
            import torch.nn as nn

            def save_checkpoint(state, filename="checkpoint.pth.tar"):
                torch.save(state, filename)

            def main_worker(gpu, args):
                model = nn.parallel.DistributedDataParallel(build(args).cuda(gpu), device_ids=[gpu])
                for epoch in range(args.epochs):
                    train(model, epoch)
                    if args.rank % 8 == 0:
                        save_checkpoint({
                            "epoch": epoch + 1,
                            "state_dict": model.state_dict(),  # expect: DD303
                            "optimizer": optimizer.state_dict(),
                        })
            """,
            fixed="""
            import torch
            import torch.nn as nn

            def save_checkpoint(state, filename="checkpoint.pth.tar"):
                torch.save(state, filename)

            def main_worker(gpu, args):
                model = nn.parallel.DistributedDataParallel(build(args).cuda(gpu), device_ids=[gpu])
                for epoch in range(args.epochs):
                    train(model, epoch)
                    if args.rank % 8 == 0:
                        save_checkpoint({
                            "epoch": epoch + 1,
                            "state_dict": model.module.state_dict(),  # expect: DD303
                            "optimizer": optimizer.state_dict(),
                        })
            """,
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn import parallel

            class Trainer:
                def __init__(self, net, gpu):
                    self.net = parallel.DistributedDataParallel(net, device_ids=[gpu])

                def checkpoint(self, path):
                    ckpt = {"epoch": self.epoch}
                    ckpt["net"] = self.net.state_dict()  # expect: DD303
                    if dist.get_rank() == 0:
                        torch.save(ckpt, path)
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            model_without_ddp = model.module
            torch.save({"model": model_without_ddp.state_dict()}, "ckpt.pt")
            """
        ),
        Example(
            """
            import copy
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            best = copy.deepcopy(model.state_dict())  # kept in memory, loaded back into the wrapper
            model.load_state_dict(best)
            """
        ),
        Example(
            """
            import torch

            class DDP(torch.nn.Module):  # a local class, not DistributedDataParallel
                pass

            model = DDP()
            torch.save(model.state_dict(), "model.pt")
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.calls(SAVE):
            obj = flow.argument(call, 0, "obj")
            if obj is None:
                continue
            for part_step, part in ctx.parts_of(trace, step, obj):
                if not (
                    isinstance(part, cst.Call)
                    and isinstance(part.func, cst.Attribute)
                    and part.func.attr.value == "state_dict"
                ):
                    continue
                wrapper = trace.value(part.func.value, part_step)
                if wrapper is None or wrapper.kind != flow.DDP:
                    continue
                name = ctx.code(part.func.value)
                end = ctx.position(part.func.value).end
                fix = Fix(
                    message=f"save `{name}.module.state_dict()`",
                    edits=(Edit(end.line, end.column + 1, end.line, end.column + 1, ".module"),),
                )
                yield Report(
                    part,
                    f"`{name}` is a DistributedDataParallel wrapper: its state_dict keys start with `module.` "
                    f"and will not load into the plain model. Save `{name}.module.state_dict()` instead.",
                    fix=fix,
                )
