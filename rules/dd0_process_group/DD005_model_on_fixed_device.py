"""DD005 model-on-fixed-device: a model put on a literal GPU (`cuda:0`) while each process has its own."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, guarded_calls, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.devices import SET_DEVICE, SET_DEVICE_INDEX, TORCH_DEVICE
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

MAX_DEPTH = 4


class ModelOnFixedDevice(Rule):
    """
    ## What it does
    Flags a model moved to a fixed GPU (`.to("cuda:0")`, `.cuda(0)`, `.to(torch.device("cuda", 0))`,
    or a name bound to such a device) and then wrapped in `DistributedDataParallel`, when the same
    script gives each process its own device: `device_ids=[local_rank]` (any index that is not a
    literal) on that wrap, or an earlier `torch.cuda.set_device(local_rank)`. The finding points
    at the move.

    Silent when the script sets `CUDA_VISIBLE_DEVICES` itself (then every process sees its own GPU
    as `cuda:0`), when the wrap names literal devices too, under a rank condition, and when a
    later move before the wrap puts the model on the process's own device (`model =
    model.to(torch.device(f"cuda:{local_rank}"))`): the last move decides.

    ## Why is this bad?
    `cuda:0` is the same GPU for every process of a node. On rank 1, DDP is asked to run on
    `device_ids=[1]` a module whose parameters live on GPU 0 and raises at construction; without
    `device_ids`, every rank of the node trains on GPU 0, which runs out of memory, while NCCL
    reports duplicate GPUs. `set_device(local_rank)` does not help: a literal index overrides the
    current device.

    ## Example
    ```python
    torch.cuda.set_device(local_rank)
    model = Net().to("cuda:0")
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    torch.cuda.set_device(local_rank)
    model = Net().to(local_rank)  # or .cuda(): the current device, set above
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No fix is offered: the right index (the local rank, or the current device) is the script's.
    """

    code = "DD005"
    name = "model-on-fixed-device"
    severity = "error"
    summary = "model moved to a literal GPU index while each process selects its own device"
    requires = (frameworks.MULTI_PROCESS_WORDS, frameworks.DDP_WORDS)

    invalid = (
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = Net().to("cuda:0")  # expect: DD005
            model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            import torch.nn as nn

            def build(args):
                net = Net()
                net.cuda(0)  # expect: DD005
                return nn.parallel.DistributedDataParallel(net, device_ids=[args.gpu])

            def main(args):
                dist.init_process_group("nccl", init_method=args.dist_url, world_size=args.world_size, rank=args.rank)
                model = build(args)

            main(parse())
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            device = torch.device("cuda", 0)

            def main():
                dist.init_process_group("nccl")
                torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
                model = Net()
                model = model.to(device)  # expect: DD005
                model = DistributedDataParallel(model)

            main()
            """
        ),
    )
    valid = (
        Example(
            # A literal GPU bound only where one process runs: the `else` of `if local_rank >= 0:` (no
            # launcher set LOCAL_RANK), while the launched processes bind their own current device.
            """
            import os

            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            local_rank = int(os.environ.get("LOCAL_RANK", -1))
            if local_rank >= 0:
                torch.cuda.set_device(local_rank)
                dist.init_process_group("nccl")
                device = torch.device("cuda")
            else:
                device = torch.device("cuda:0")

            model = torch.nn.Linear(8, 2)
            model.to(device)
            if local_rank >= 0:
                model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            # The literal device belongs to the single-process branch of the same test as the wrap.
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            is_ddp = "WORLD_SIZE" in os.environ
            if is_ddp:
                dist.init_process_group("nccl")
                device = dist.get_rank() % torch.cuda.device_count()
                torch.cuda.set_device(device)
            else:
                device = "cuda:0"
            model = Net()
            if is_ddp:
                model = DDP(model.to(device), device_ids=[device])
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = Net().to(f"cuda:{local_rank}")
            model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            # One GPU visible per process: it is cuda:0 in every process.
            os.environ["CUDA_VISIBLE_DEVICES"] = os.environ["LOCAL_RANK"]
            dist.init_process_group("nccl")
            model = DDP(Net().to("cuda:0"), device_ids=[0])
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            model = DDP(Net().cuda(), device_ids=[local_rank])
            if dist.get_rank() == 0:
                reference = Net().to("cuda:0")  # a copy for checks on rank 0, never wrapped
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.runs_multi_process or "CUDA_VISIBLE_DEVICES" in ctx.source:
            return
        reported: set[int] = set()
        for trace, step, call in ctx.calls(frameworks.DDP):
            module = syntax.argument(call, 0, "module")
            if module is None or ctx.rank_guards(trace, step, uncertain=True):
                continue
            own = _per_process_device(ctx, trace, step, call)
            if own is None:
                continue
            move = _moved_to_fixed_device(ctx, trace, step, module)
            if move is None or id(move) in reported:
                continue
            reported.add(id(move))
            yield Report(
                move,
                f"the model goes to a fixed GPU here, but each process selects its own device "
                f"(`{ctx.code(own)}`): every rank puts it on the same GPU, and DDP refuses it on the "
                f"other ranks. Move it to the local rank's device (`.to(local_rank)`, or `.cuda()` "
                f"after set_device).",
            )


def _per_process_device(ctx: LintContext, trace: Trace, step: Step, ddp: cst.Call) -> cst.CSTNode | None:
    """The non-literal device index of the wrap (`device_ids=[local_rank]`), or an earlier
    `set_device(local_rank)` on the trace: the device the script means each process to use."""
    ids = syntax.keyword(ddp, "device_ids")
    if isinstance(ids, (cst.List, cst.Tuple)):
        if any(_is_literal(element.value) for element in ids.elements):
            return None  # `device_ids=[0]`: it means GPU 0 (and says so)
        if ids.elements:
            return ids
    for earlier in reversed(trace.steps[: step.index]):
        for call in syntax.own_calls(earlier.node):
            if ctx.qualname(call.func) in (SET_DEVICE, SET_DEVICE_INDEX):
                arg = syntax.argument(call, 0, "device")
                if arg is not None and not _is_literal(arg) and _fixed_index(ctx, trace, earlier, arg) is None:
                    return call
    return None


def _moved_to_fixed_device(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> cst.Call | None:
    """The `.to(...)`/`.cuda(...)` with a literal GPU that put the object `expr` holds where it is:
    in the expression's own chain (`Net().to("cuda:0")`), in a statement on that name between its
    binding and `step` (`model.cuda(0)`), or further back through the names it was bound from."""
    node: cst.BaseExpression = expr
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute):
        if node.func.attr.value in ("to", "cuda"):
            if _moves_to_fixed(ctx, trace, step, node):
                return node
            if _moves_to_own_device(ctx, trace, step, node):
                return None  # `model = model.to(device)` with the per-process device: moved again
        node = node.func.value
    if depth >= MAX_DEPTH or not isinstance(node, (cst.Name, cst.Attribute)):
        return None
    text = dotted(node)
    found = ctx.binding(trace, step, node)
    start = found[0].index if found is not None else 0
    for between in reversed(trace.steps[start : step.index]):  # the last move decides
        if between.frame is not step.frame:
            continue
        for call in syntax.own_calls(between.node):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda") and dotted(call.func.value) == text:
                if _moves_to_fixed(ctx, trace, between, call):
                    return call
                if _moves_to_own_device(ctx, trace, between, call):
                    return None
    if found is None:
        return None
    return _moved_to_fixed_device(ctx, trace, found[0], found[1], depth + 1)


def _moves_to_own_device(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> bool:
    """`.cuda()`, `.cuda(local_rank)`, `.to(local_rank)`, `.to(device)` with `device =
    torch.device(f"cuda:{local_rank}")`: a move to a device that is not one literal GPU."""
    arg = syntax.argument(call, 0, "device")
    if call.func.attr.value == "cuda":  # type: ignore[union-attr]
        return arg is None or (not _is_integer(arg) and _fixed_index(ctx, trace, step, arg) is None)
    if arg is None or _is_integer(arg) or _fixed_index(ctx, trace, step, arg) is not None:
        return False
    value = trace.value(arg, step)
    if value is not None and value.is_rank_like:
        return True
    made = arg
    if isinstance(arg, (cst.Name, cst.Attribute)):
        found = ctx.binding(trace, step, arg)
        made = found[1] if found is not None else arg
    if isinstance(made, cst.Call) and ctx.qualname(made.func) == TORCH_DEVICE:
        return True
    return isinstance(made, cst.FormattedString) and "cuda" in ctx.code(made)


def _moves_to_fixed(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> bool:
    if ctx.qualname(call.func) is not None:
        return False
    arg = syntax.argument(call, 0, "device")
    if arg is None:
        return False
    if call.func.attr.value == "cuda":  # type: ignore[union-attr]
        return _is_integer(arg) or _fixed_index(ctx, trace, step, arg) is not None
    return _fixed_index(ctx, trace, step, arg) is not None or _is_integer(arg)


def _fixed_index(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> int | None:
    """The GPU index of a literal device: `"cuda:0"`, `torch.device("cuda:1")`,
    `torch.device("cuda", 0)`, or a name bound to one of them."""
    if isinstance(expr, cst.SimpleString):
        text = expr.evaluated_value
        if isinstance(text, str) and text.startswith("cuda:") and text[5:].isdigit():
            return int(text[5:])
        return None
    if isinstance(expr, cst.Call) and ctx.qualname(expr.func) == TORCH_DEVICE:
        kind = syntax.argument(expr, 0, "type")
        index = syntax.argument(expr, 1, "index")
        if kind is None:
            return None
        if index is None:
            return _fixed_index(ctx, trace, step, kind, depth + 1)
        if isinstance(kind, cst.SimpleString) and kind.evaluated_value == "cuda" and _is_integer(index):
            return int(index.value)  # type: ignore[union-attr]
        return None
    if depth < 2 and isinstance(expr, (cst.Name, cst.Attribute)):
        found = ctx.binding(trace, step, expr)
        # `device = rank % n` under `if is_ddp:`, `device = "cuda:0"` in its `else`: where the
        # later `if is_ddp:` moves the model, the literal was not what the name held.
        # The same for `device = "cuda:0"` bound only where one process runs (the `else` of
        # `if local_rank >= 0:`, where the distributed branch bound `torch.device("cuda")`).
        if found is not None and not found[0].excludes(step) and not guarded_calls.single_process_only(ctx, found[0]):
            return _fixed_index(ctx, trace, found[0], found[1], depth + 1)
    return None


def _is_integer(node: cst.CSTNode) -> bool:
    return isinstance(node, cst.Integer)


def _is_literal(node: cst.CSTNode) -> bool:
    return isinstance(node, (cst.Integer, cst.SimpleString))
