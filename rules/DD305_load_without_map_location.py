"""DD305 load-without-map-location: torch.load restores tensors onto the device they were saved from."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor import flow
from distdoctor.context import LintContext
from distdoctor.finding import Edit, Fix
from distdoctor.rule import Example, Report, Rule

LOAD = "torch.load"
GPU_WORDS = re.compile(r"\bcuda\b|\.cuda\(|nccl|device_ids|set_device")


class LoadWithoutMapLocation(Rule):
    """
    ## What it does
    Flags `torch.load(...)` without `map_location` (keyword, or the second positional argument)
    in a distributed script that trains on GPUs.

    ## Why is this bad?
    Without `map_location`, `torch.load` puts every tensor back on the device it was saved from,
    usually `cuda:0` (the rank that wrote the checkpoint). Every rank of the job then allocates a
    full copy of the checkpoint on GPU 0: the first GPU runs out of memory or is slowed down by
    N-1 foreign contexts, and the process on it can be killed.

    ## Example
    ```python
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    ```

    ## Use instead
    ```python
    checkpoint = torch.load(args.resume, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    ```

    ## Fix safety
    Safe for the usual use, which the fix assumes: the loaded tensors are copied into a model or
    optimizer with `load_state_dict`. `map_location="cpu"` is the choice that is right on every
    rank whatever the script calls its device variable: `Module.load_state_dict` copies into the
    parameters on their own device, and `Optimizer.load_state_dict` casts its state to the device
    of the parameters, so nothing else changes but the transient host copy. A device-specific
    `map_location=f"cuda:{local_rank}"` also works, but needs a name the fixer cannot know. If the
    script uses the loaded tensors directly in GPU computations, move them with `.to(device)`
    after the fix.
    """

    code = "DD305"
    name = "load-without-map-location"
    severity = "warning"
    summary = "torch.load without map_location in a distributed GPU script: every rank loads onto GPU 0"

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume)  # expect: DD305
            model.load_state_dict(checkpoint["model"])
            """,
            fixed="""
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume, map_location="cpu")  # expect: DD305
            model.load_state_dict(checkpoint["model"])
            """,
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def resume(model, optimizer, path):
                state = torch.load(path, weights_only=True)  # expect: DD305
                model.module.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])

            def main(local_rank):
                model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
                resume(model, optimizer, "last.pt")
            """,
            fixed="""
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def resume(model, optimizer, path):
                state = torch.load(path, weights_only=True, map_location="cpu")  # expect: DD305
                model.module.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])

            def main(local_rank):
                model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
                resume(model, optimizer, "last.pt")
            """,
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch import load as torch_load

            hvd.init()
            torch.cuda.set_device(hvd.local_rank())
            if hvd.rank() == 0:
                model.load_state_dict(torch_load(  # expect: DD305
                    "pretrained.pt",
                ))
            """,
            fixed="""
            import horovod.torch as hvd
            from torch import load as torch_load

            hvd.init()
            torch.cuda.set_device(hvd.local_rank())
            if hvd.rank() == 0:
                model.load_state_dict(torch_load(  # expect: DD305
                    "pretrained.pt", map_location="cpu",
                ))
            """,
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume, map_location="cpu")
            loc = f"cuda:{local_rank}"
            other = torch.load(args.pretrained, loc)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")  # CPU-only training
            state = torch.load("ckpt.pt")
            """
        ),
        Example(
            """
            import torch

            model = Net().cuda()  # single process: nothing to share GPU 0 with
            model.load_state_dict(torch.load("model.pt"))
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            state = torch.load(path, **load_kwargs)  # map_location may be in there
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed or not GPU_WORDS.search(ctx.source):
            return
        for _trace, _step, call in ctx.calls(LOAD):
            if flow.argument(call, 1, "map_location") is not None:
                continue
            if not call.args or any(arg.star for arg in call.args):
                continue
            last = call.args[-1]
            end = ctx.position(last.value).end
            fix = Fix(
                message='add map_location="cpu"',
                edits=(Edit(end.line, end.column + 1, end.line, end.column + 1, ', map_location="cpu"'),),
            )
            yield Report(
                call,
                "torch.load without map_location restores tensors onto the GPU they were saved from (usually "
                "cuda:0) on every rank: pass `map_location=\"cpu\"` (or this rank's device).",
                fix=fix,
            )
