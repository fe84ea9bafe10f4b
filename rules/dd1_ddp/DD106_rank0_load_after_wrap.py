"""DD106 rank0-load-after-wrap: weights loaded on rank 0 only, after DDP already broadcast them."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.context import wrapper_holding
from distdoctor.lint.analysis.sharding import FSDP2


class Rank0LoadAfterWrap(Rule):
    """
    ## What it does
    Flags `load_state_dict(...)` on a DDP-wrapped model (the wrapper, `wrapper.module`, or the
    module passed to `DDP(...)`) that runs only on rank 0 (`if rank == 0:`,
    `if is_main_process():`, a helper called under such a guard) after the wrap, when no
    broadcast (`dist.broadcast`, `broadcast_object_list`, `hvd.broadcast_parameters`) follows on
    every rank. The same on a model sharded by FSDP2's `fully_shard`, where each rank holds only
    its shard of every parameter (an FSDP (v1) wrapper's `load_state_dict` is a collective there:
    DD505 reports it).

    ## Why is this bad?
    DDP broadcasts rank 0's parameters once, when the wrapper is constructed; it never does so
    again (only buffers are re-broadcast in forward). Weights loaded afterwards on rank 0 alone
    stay on rank 0: every other rank trains from its own random initialisation, and gradient
    averaging mixes models that have nothing in common.

    ## Example
    ```python
    model = DDP(model, device_ids=[local_rank])
    if dist.get_rank() == 0:
        model.module.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))
    ```

    ## Use instead
    ```python
    model.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))  # every rank
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Fix safety
    No autofix: the load must move before the wrap and run on every rank, with a
    `map_location` valid on each.
    """

    code = "DD106"
    name = "rank0-load-after-wrap"
    severity = "error"
    summary = "load_state_dict on rank 0 only after the DDP wrap: ranks train from different weights"
    requires = (frozenset({"load_state_dict"}), frameworks.DDP_WORDS | frameworks.SHARDING_WORDS)

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            if dist.get_rank() == 0:
                model.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))  # expect: DD106
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            if dist.get_rank() == 0:
                state = torch.load("pretrained.pt", map_location="cpu")
                model.module.load_state_dict(state)  # expect: DD106
            train(model)
            """
        ),
        Example(
            """
            import torch
            from torch import nn
            from utils import is_main_process

            def resume(model, path):
                ckpt = torch.load(path, map_location="cpu")
                model.load_state_dict(ckpt["model"])  # expect: DD106

            def main(args):
                net = Net().cuda()
                model = nn.parallel.DistributedDataParallel(net, device_ids=[args.gpu])
                if args.resume and is_main_process():
                    resume(model, args.resume)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel

            class Runner:
                def __init__(self, net, rank):
                    self.rank = rank
                    self.net = net.cuda()
                    self.ddp = DistributedDataParallel(self.net, device_ids=[rank])

                def warm_start(self, path):
                    if self.rank != 0:
                        return
                    self.net.load_state_dict(torch.load(path, map_location="cpu"))  # expect: DD106
            """
        ),
    )
    valid = (
        Example(
            # The best weights reloaded after training, for an evaluation rank 0 runs alone: no rank trains on.
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            for epoch in range(epochs):
                for x, y in loader:
                    loss = criterion(model(x), y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
            if dist.get_rank() == 0:
                model.module.load_state_dict(torch.load("best.pt", map_location="cpu"))
                evaluate(model.module, test_loader)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            class Model:
                def __init__(self, local_rank=-1):
                    self.net = Net().cuda()
                    if local_rank != -1:
                        self.net = DDP(self.net, device_ids=[local_rank])

                # called by scripts of other modules, with the rank they run as
                def load_model(self, path, rank=0):
                    if rank <= 0:
                        self.net.load_state_dict(torch.load(path, map_location="cpu"))
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            model.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))  # every rank
            fully_shard(model)
            if dist.get_rank() == 0:
                reference.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))  # not sharded
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = Net().cuda()
            model.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))
            model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            if dist.get_rank() == 0:
                model.module.load_state_dict(torch.load("pretrained.pt", map_location="cpu"))
            for p in model.module.state_dict().values():
                dist.broadcast(p, src=0)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            model.module.load_state_dict(torch.load("last.pt", map_location="cpu"))  # every rank
            if dist.get_rank() == 0:
                optimizer.load_state_dict(torch.load("opt.pt", map_location="cpu"))
            """
        ),
        Example(
            """
            import copy
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            from mixed import prepare

            class Pair:
                def __init__(self, rank):
                    self.net = Net().cuda(rank)
                    self.avg = copy.deepcopy(self.net)
                    (self.net, self.avg), self.opt = prepare([self.net, self.avg], Adam())
                    self.ddp = DDP(self.net, device_ids=[rank])

                def reset_average(self):
                    if dist.get_rank() == 0:
                        # the averaged copy (never wrapped) takes the live weights: nothing diverges
                        self.avg.load_state_dict(self.net.state_dict())
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.method_calls("load_state_dict"):
            wrapper = wrapper_holding(trace, step, call.func.value)
            if wrapper is None:
                receiver = trace.value(call.func.value, step)
                wrapper = receiver if receiver is not None and receiver.kind == kinds.DDP else None
            if not ctx.under_rank_zero(trace, step):
                continue
            if _after_the_training(ctx, trace, step):
                continue  # the best checkpoint reloaded for a rank-0 evaluation after training
            if not ctx.is_entry(trace) and _guard_reads_a_parameter(ctx, trace, step):
                continue  # `def load_model(self, path, rank=0): if rank <= 0: ...`, called from elsewhere
            if wrapper is None:
                event = ctx.sharding.in_place_sharded(trace, step, call.func.value, FSDP2)
                if event is not None and not _broadcast_follows(ctx, trace, step):
                    yield Report(
                        call,
                        f"weights are loaded on rank 0 only, after fully_shard() sharded the model (line "
                        f"{ctx.position(event.call).start.line}): each rank holds its own shard of every parameter, so "
                        f"the other ranks keep their initial shards. Load on every rank (or use set_model_state_dict "
                        f"with StateDictOptions(full_state_dict=True, broadcast_from_rank0=True) on every rank).",
                    )
                continue
            if _broadcast_follows(ctx, trace, step):
                continue
            line = ctx.position(wrapper.node).start.line if wrapper.node is not None else "?"
            yield Report(
                call,
                f"weights are loaded on rank 0 only, after DistributedDataParallel broadcast them at construction "
                f"(line {line}): the other ranks keep their own weights. Load on every rank before wrapping "
                f"(or broadcast the parameters from rank 0 afterwards).",
            )


def _after_the_training(ctx: LintContext, trace: Trace, step: Step) -> bool:
    """Whether the path shows its training, and all of it runs before the load: every backward
    pass comes earlier and none sits in a loop that holds the load. The best checkpoint reloaded
    for a rank-0 evaluation once training is over leaves no rank training from other weights."""
    backwards = [other for other, call in trace.calls() if ctx.is_backward(call)]
    return bool(backwards) and all(
        other.index < step.index and not any(other.in_loop(loop) for loop in step.loops) for other in backwards
    )


def _guard_reads_a_parameter(ctx: LintContext, trace: Trace, step: Step) -> bool:
    """A rank-0 guard on a rank parameter of a function nothing in the file calls: the rank its
    callers pass (and whether they run distributed at all) cannot be seen."""
    root = trace.root
    if not isinstance(root, cst.FunctionDef):
        return False
    params = {p.name.value for p in (*root.params.params, *root.params.kwonly_params, *root.params.posonly_params)}
    params &= kinds.RANK_NAMES | kinds.LOCAL_RANK_NAMES  # `rank`, `local_rank`: not `self` or `args`
    return any(
        isinstance(node, cst.Name) and node.value in params
        for guard in ctx.rank_guards(trace, step)
        for node in syntax.walk(guard.guard.test)
    )


def _broadcast_follows(ctx: LintContext, trace: Trace, step: Step) -> bool:
    for later in trace.steps[step.index + 1 :]:
        for call in syntax.own_calls(later.node):
            name = ctx.collective_name(call)
            if name is not None and "broadcast" in name and not ctx.rank_guards(trace, later):
                return True
            if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("_sync_params", "_sync_module_states", "sync_params"):
                return True
    return False
