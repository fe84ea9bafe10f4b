"""DD301 collective-in-rank-branch: a collective (or a DDP forward) that only some ranks reach."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from distdoctor.lint.analysis import kinds, syntax
from distdoctor.lint.analysis.context import LintContext, RankGuard
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.sharding import FSDP2
from distdoctor.lint.rule import Example, Report, Rule

DDP_FORWARD = "a forward through the DistributedDataParallel wrapper"
FSDP1_FORWARD = "forward an FSDP (v1) model"
FSDP2_FORWARD = "forward a model sharded by fully_shard()"
SHARDED_FORWARDS = (FSDP1_FORWARD, FSDP2_FORWARD)


@dataclass(frozen=True)
class _Event:
    step: Step
    call: cst.Call
    what: str  # the collective's qualified name, or DDP_FORWARD
    guards: tuple[RankGuard, ...]


class CollectiveInRankBranch(Rule):
    """
    ## What it does
    Flags a collective call (`dist.barrier`, `all_reduce`, `broadcast`, `all_gather`, `reduce`,
    `gather`, `scatter`, `reduce_scatter`, `all_gather_object`, `broadcast_object_list`,
    `new_group`, `hvd.allreduce`, `hvd.broadcast*`, `hvd.allgather`, ...) or a forward pass
    through a `DistributedDataParallel` or FSDP wrapper, or through a model sharded by FSDP2's
    `fully_shard`, that runs only under a rank condition:
    `if rank == 0:`, `if dist.get_rank() == 0:`, `if is_main_process():`,
    `if args.local_rank in [-1, 0]:`, or code after `if rank != 0: return`. The condition may be
    at the call site of a helper that makes the collective.

    It stays silent when the other ranks make the same collective on their side: in the `else`
    branch, or in the opposite guard elsewhere on the same path (the "first process downloads,
    the others wait" idiom: `if local_rank not in [-1, 0]: dist.barrier()` ... then
    `if local_rank == 0: dist.barrier()`). Point-to-point `send`/`recv` are not collectives.

    ## Why is this bad?
    Every rank of the process group must enter a collective. When only rank 0 calls
    `dist.barrier()` (or `all_reduce`, ...), it waits for peers that never come, and the job
    hangs until the NCCL timeout kills it. A forward through an FSDP model (the wrapper, or a
    module sharded by FSDP2's `fully_shard`) all-gathers parameter shards from every rank, so it
    hangs the same way. A DDP forward counts too: with `broadcast_buffers=True`
    (the default) DDP broadcasts the module's buffers from rank 0 at the start of a forward, so
    evaluating the wrapped model on rank 0 alone hangs in the same way (not when the wrapper was
    built with `broadcast_buffers=False`: then the forward makes no collective, and it is silent).

    ## Example
    ```python
    if dist.get_rank() == 0:
        acc = evaluate(ddp_model, val_loader)   # DDP forward on rank 0 only
        dist.barrier()                          # the other ranks never arrive
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        acc = evaluate(ddp_model.module, val_loader)  # the plain module: no collectives
    dist.barrier()                                    # every rank
    ```

    ## Fix safety
    No autofix: moving a collective out of a branch changes what the program computes.
    """

    code = "DD301"
    name = "collective-in-rank-branch"
    severity = "error"
    summary = "collective or DDP forward reachable on some ranks only: the job hangs"

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            def main(model, val_batch):
                dist.init_process_group("nccl")
                for block in model.layers:
                    fully_shard(block)
                fully_shard(model)
                train(model)
                if dist.get_rank() == 0:
                    with torch.no_grad():
                        print(model(val_batch).mean())  # expect: DD301
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(Net(), device_id=local_rank)
            if dist.get_rank() == 0:
                sample = model.generate(prompt)
                logits = model(prompt)  # expect: DD301
            """
        ),
        Example(
            """
            import torch.distributed as dist

            def main():
                dist.init_process_group("nccl")
                rank = dist.get_rank()
                train()
                if rank == 0:
                    save()
                    dist.barrier()  # expect: DD301
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            def evaluate(model, loader):
                with torch.no_grad():
                    for x, y in loader:
                        out = model(x)  # expect: DD301
                return out

            def main():
                local_rank = int(os.environ["LOCAL_RANK"])
                dist.init_process_group("nccl")
                model = DDP(Net().cuda(), device_ids=[local_rank])
                if dist.get_rank() == 0:
                    evaluate(model, val_loader)
            """
        ),
        Example(
            """
            import torch
            from torch import distributed

            def log_metrics(args, loss):
                if args.rank != 0:
                    return
                total = loss.clone()
                distributed.all_reduce(total)  # expect: DD301
                print(total.item() / distributed.get_world_size())
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            hvd.init()
            model = Net()
            if hvd.rank() == 0:
                config = load_config("run.yaml")
                config = hvd.broadcast_object(config, root_rank=0)  # expect: DD301
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from utils import is_main_process

            def gather_predictions(preds):
                out = [None] * dist.get_world_size()
                dist.all_gather_object(out, preds)  # expect: DD301
                return out

            class Evaluator:
                def finish(self, preds):
                    if is_main_process():
                        merged = gather_predictions(preds)
                        write(merged)
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            with torch.no_grad():
                loss = model(val_batch).mean()  # every rank runs the forward
            if dist.get_rank() == 0:
                print(loss.item())
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
            model = DDP(Net().cuda(local_rank), device_ids=[local_rank], broadcast_buffers=False)
            train(model)
            if dist.get_rank() == 0:
                with torch.no_grad():
                    print(model(sample.cuda(local_rank)))  # no buffer broadcast: no collective
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            model = Net()
            if hvd.rank() == 0:
                # a Horovod state broadcast under a rank guard is DD402's finding, not this rule's
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            def load_and_cache(args):
                if args.local_rank not in [-1, 0]:
                    dist.barrier()  # the other ranks wait while the first one downloads
                data = download_or_load()
                if args.local_rank == 0:
                    dist.barrier()  # the first one releases them
                return data
            """
        ),
        Example(
            """
            import torch.distributed as dist

            def main():
                dist.init_process_group("nccl")
                if dist.get_rank() == 0:
                    torch.save(model.module.state_dict(), "ckpt.pt")
                    print("saved")
                dist.barrier()
            """
        ),
        Example(
            """
            import torch.distributed as dist

            if dist.get_rank() == 0:
                prepare_dataset()
                dist.barrier()
            else:
                dist.barrier()
                load_dataset()
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            local_rank = int(os.environ["LOCAL_RANK"])
            model = DDP(Net().cuda(), device_ids=[local_rank])
            if dist.get_rank() == 0:
                with torch.no_grad():
                    preview = model.module(sample)  # the plain module: no collectives
            """
        ),
        Example(
            """
            import torch.distributed as dist

            def exchange(t, rank):
                if rank == 0:
                    dist.send(t, dst=1)
                else:
                    dist.recv(t, src=0)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed:
            return
        for trace in ctx.traces:
            events = list(_events(ctx, trace))
            for event in events:
                if not event.guards or _matched(event, events):
                    yield from ()
                    continue
                guard = event.guards[-1]
                where = "rank 0" if guard.zero else "the ranks other than 0"
                if guard.local:
                    where = "local rank 0" if guard.zero else "the ranks other than local rank 0"
                guard_line = ctx.position(guard.guard.test).start.line
                if event.what in SHARDED_FORWARDS:
                    model = dotted(event.call.func) or "the model"
                    message = (
                        f"forward through `{model}`, {event.what.split(' ', 1)[1]}, runs only on {where} (condition "
                        f"on line {guard_line}): the forward all-gathers each block's parameter shards from every "
                        f"rank, and the other ranks never join, so the job hangs. Run the forward on every rank."
                    )
                elif event.what == DDP_FORWARD:
                    wrapper = dotted(event.call.func) or "the model"
                    message = (
                        f"forward through the DDP wrapper `{wrapper}` runs only on {where} (condition on line "
                        f"{guard_line}): DDP broadcasts buffers from rank 0 in forward, and the other ranks never "
                        f"join, so the job hangs. Use `{wrapper}.module` on one rank, or evaluate on every rank."
                    )
                else:
                    short = event.what.rsplit(".", 1)[-1]
                    message = (
                        f"`{short}` is a collective but runs only on {where} (condition on line {guard_line}): the "
                        f"other ranks never join it and the job hangs. Call it on every rank (outside the `if`), "
                        f"or make the matching call in the other branch."
                    )
                yield Report(event.call, message)


# A Horovod state broadcast under a rank guard is DD402's finding (the spec gives it that case):
# one bug, one code.
LEFT_TO_DD402 = ("horovod.torch.broadcast_parameters", "horovod.torch.broadcast_optimizer_state")


def _events(ctx: LintContext, trace: Trace) -> Iterable[_Event]:
    for step, call in trace.calls():
        what = ctx.collective_name(call)
        if what in LEFT_TO_DD402:
            continue
        if what is None:
            func = trace.value(call.func, step)
            if func is not None and func.kind == kinds.DDP:
                what = DDP_FORWARD if _broadcasts_buffers(func) else None
            else:
                what = _sharded_forward(ctx, trace, step, call)
            if what is None:
                continue
        yield _Event(step, call, what, tuple(ctx.rank_guards(trace, step)))


def _sharded_forward(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> str | None:
    """A forward (a call of the model itself) through an FSDP wrapper or an FSDP2 model: both
    all-gather parameter shards, a collective."""
    if not isinstance(call.func, (cst.Name, cst.Attribute)):
        return None
    sharding = ctx.sharding
    if not sharding.any:
        return None
    if sharding.fsdp1_wrapper(trace, step, call.func) is not None:
        return FSDP1_FORWARD
    if sharding.in_place_sharded(trace, step, call.func, FSDP2) is not None:
        return FSDP2_FORWARD
    return None


def _broadcasts_buffers(wrapper: kinds.Value) -> bool:
    """`DDP(model, broadcast_buffers=False)` makes no collective in forward."""
    if isinstance(wrapper.node, cst.Call):
        flag = syntax.keyword(wrapper.node, "broadcast_buffers")
        if isinstance(flag, cst.Name) and flag.value == "False":
            return False
    return True


def _matched(event: _Event, events: list[_Event]) -> bool:
    """Whether the ranks this event skips make the same collective on the other side of a rank
    condition (an `else` branch, or the opposite test elsewhere on the path)."""
    sides = {guard.zero for guard in event.guards}
    if len(sides) > 1:
        return True  # contradictory guards: we cannot tell who runs it
    side = sides.pop()
    for other in events:
        if other is event or other.what != event.what:
            continue
        if any(guard.zero != side for guard in other.guards):
            return True
    return False
