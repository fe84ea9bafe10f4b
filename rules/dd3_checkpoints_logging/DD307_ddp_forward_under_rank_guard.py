"""DD307 ddp-forward-under-rank-guard: a forward through the DDP wrapper on some ranks only."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, guarded_calls
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.guarded_calls import DDP_FORWARD, Event
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule


class DDPForwardUnderRankGuard(Rule):
    """
    ## What it does
    Flags a forward pass through a `DistributedDataParallel` wrapper (`ddp_model(x)`, directly or
    in a helper such as `evaluate(ddp_model, loader)`) that runs only under a rank condition:
    `if rank == 0:`, `if is_main_process():`, `if args.local_rank in [-1, 0]:`, or code after
    `if rank != 0: return`. Off by default: whether it hangs depends on the model and on what
    the other ranks do next, which a linter cannot see (see below).

    It stays silent when the wrapper was built with `broadcast_buffers=False` (the forward makes
    no collective), when the forward goes through the plain module (`ddp_model.module(x)`), in
    the `else` branch of `if hasattr(model, "module"):` (the model is not wrapped there), under a
    condition that holds in single-process runs only (`if args.local_rank == -1 and ...:`), and when
    the other ranks run a DDP forward on the other side of the condition.

    ## Why is this bad?
    A DDP forward makes a collective only to broadcast the module's buffers from rank 0
    (`broadcast_buffers=True`, the default): a model with no buffers (no BatchNorm running
    statistics, no registered buffers) makes none, and the forward is harmless. When the model
    has buffers, rank 0's extra broadcast waits for a partner. If the other ranks' next
    collective is a forward of the same wrapper (they went on training), the broadcasts pair up
    and the run goes on, with rank 0 skipping one sync later. It hangs when the other ranks'
    next collective is something else: a `dist.barrier()` after the evaluation, an
    `all_reduce` of a metric, or nothing at all because training ended (an evaluation after the
    last epoch), and NCCL kills the job at its timeout. Evaluating through `.module` on rank 0
    avoids the question entirely.

    ## Example
    ```python
    if dist.get_rank() == 0:
        acc = evaluate(ddp_model, val_loader)   # DDP forward: a buffer broadcast on rank 0 only
    dist.barrier()                              # the other ranks are here: mismatched collectives
    ```

    ## Use instead
    ```python
    if dist.get_rank() == 0:
        acc = evaluate(ddp_model.module, val_loader)  # the plain module: no collectives
    dist.barrier()
    ```

    ## Fix safety
    No autofix: whether `.module` is right depends on how the helper uses the model.
    """

    code = "DD307"
    name = "ddp-forward-under-rank-guard"
    severity = "warning"
    default_on = False
    summary = "forward through the DDP wrapper on some ranks only: hangs when the model has buffers"
    requires = (frameworks.DISTRIBUTED_WORDS, frameworks.DDP_WORDS)

    invalid = (
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            def evaluate(model, loader):
                with torch.no_grad():
                    for x, y in loader:
                        out = model(x)  # expect: DD307
                return out

            def main():
                local_rank = int(os.environ["LOCAL_RANK"])
                dist.init_process_group("nccl")
                model = DDP(Net().cuda(), device_ids=[local_rank])
                if dist.get_rank() == 0:
                    evaluate(model, val_loader)
                dist.barrier()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch import nn

            def run(rank, net, batches):
                model = nn.parallel.DistributedDataParallel(net.cuda(rank), device_ids=[rank])
                for batch in batches:
                    model(batch).sum().backward()
                if rank != 0:
                    return
                with torch.no_grad():
                    print(model(batches[0]).mean())  # expect: DD307
            """
        ),
    )
    valid = (
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
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            def render(net, clips):
                with torch.no_grad():
                    for clip in clips:
                        if hasattr(net, "module"):
                            audio = net.module(clip)
                        else:
                            audio = net(clip)  # only when `net` is not a wrapper
                        store(audio)

            def main(rank, world):
                net = Vocoder().cuda(rank)
                if world > 1:
                    net = DistributedDataParallel(net, device_ids=[rank])
                fit(net)
                if rank == 0:
                    render(net, held_out)
            """
        ),
        Example(
            """
            import torch
            from torch import nn

            def score(args, model, batches):
                with torch.no_grad():
                    return sum(model(b).item() for b in batches)

            def train(args, model, batches):
                if args.local_rank != -1:
                    model = nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])
                for step, batch in enumerate(batches):
                    model(batch).backward()
                    if args.local_rank in [-1, 0] and step % 100 == 0:
                        if args.local_rank == -1 and args.eval_while_training:
                            score(args, model, batches)  # single-process runs only: no wrapper
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.may_call(frameworks.DDP):
            return  # every finding needs a DDP wrapper, built by a DistributedDataParallel(...) call
        if not ctx.is_distributed:
            return
        for trace in ctx.traces:
            found = [event for event in guarded_calls.events(ctx, trace) if event.what == DDP_FORWARD]
            for event in guarded_calls.unmatched(ctx, trace, found):
                if _not_wrapped_here(event):
                    continue
                guard = event.guards[-1]
                where = "rank 0" if guard.zero else "the ranks other than 0"
                if guard.local:
                    where = "local rank 0" if guard.zero else "the ranks other than local rank 0"
                guard_line = ctx.position(guard.guard.test).start.line
                wrapper = dotted(event.call.func) or "the model"
                yield Report(
                    event.call,
                    f"forward through the DDP wrapper `{wrapper}` runs only on {where} (condition on line "
                    f"{guard_line}): if the model has buffers, DDP broadcasts them from rank 0 in forward, and "
                    f"the job hangs unless the other ranks' next collective is the same wrapper's forward. Use "
                    f"`{wrapper}.module` on one rank, or evaluate on every rank.",
                )


def _not_wrapped_here(event: Event) -> bool:
    """The forward sits where its model is known not to be a wrapper: the false side of
    `if hasattr(model, "module"):`."""
    name = dotted(event.call.func)
    if name is None:
        return False
    for guard in event.step.guards:
        test = guard.test
        if not guard.negated or not isinstance(test, cst.Call) or dotted(test.func) != "hasattr" or len(test.args) != 2:
            continue
        attr = test.args[1].value
        if isinstance(attr, cst.SimpleString) and attr.evaluated_value == "module" and dotted(test.args[0].value) == name:
            return True
    return False
