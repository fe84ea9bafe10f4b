"""DD304 print-on-every-rank: training progress printed by every process."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor import flow
from distdoctor.context import LintContext
from distdoctor.flow import Step, Trace
from distdoctor.names import dotted
from distdoctor.rule import Example, Report, Rule

LOG_METHODS = frozenset({"info", "warning", "warn", "debug", "error", "critical", "log", "exception"})
# The script silences the other ranks itself: DeiT/DETR's `setup_for_distributed` replaces
# `builtins.print`; loggers set up per rank (`setup_logger(distributed_rank=...)`).
PRINT_OVERRIDE = re.compile(r"setup_for_distributed|builtins\.print\s*=|__builtin__\.print\s*=|\bdef print\(")


class PrintOnEveryRank(Rule):
    """
    ## What it does
    Flags `print(...)` and `logging` calls (`logging.info`, `logger.info` on a logger from
    `logging.getLogger`) inside a training loop (a loop that runs `backward()`) of a distributed
    script, when no rank condition guards them.

    Silent when the message names the rank (per-rank output is then deliberate), when the script
    replaces `print` for non-master ranks (`setup_for_distributed`), and, for `logging`, when the
    script sets the logging level or handlers under a rank condition.

    ## Why is this bad?
    Every process prints the same progress line: with 8 GPUs per node and 4 nodes, 32 copies of
    every line, interleaved, which buries real warnings and slows the loop on slow terminals.
    This is advice (info): the training itself is unaffected.

    ## Example
    ```python
    for step, (x, y) in enumerate(loader):
        ...
        if step % 100 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    ```

    ## Use instead
    ```python
        if step % 100 == 0 and dist.get_rank() == 0:
            print(f"step {step} loss {loss.item():.4f}")
    ```

    ## Fix safety
    No autofix: the rank variable to test is the script's choice.
    """

    code = "DD304"
    name = "print-on-every-rank"
    severity = "info"
    summary = "training progress printed by every rank"

    invalid = (
        Example(
            """
            import torch.distributed as dist

            dist.init_process_group("nccl")
            for epoch in range(epochs):
                for step, (x, y) in enumerate(loader):
                    loss = criterion(model(x), y)
                    loss.backward()
                    optimizer.step()
                    if step % 50 == 0:
                        print(f"epoch {epoch} step {step} loss {loss.item():.4f}")  # expect: DD304
            """
        ),
        Example(
            """
            import logging
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            logger = logging.getLogger(__name__)

            def train_epoch(model, loader, optimizer, epoch):
                for x, y in loader:
                    loss = model(x, y)
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()
                logger.info("epoch %d finished, loss %.3f", epoch, loss.item())  # expect: DD304

            def main(local_rank):
                model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
                for epoch in range(10):
                    train_epoch(model, loader, optimizer, epoch)

            if __name__ == "__main__":
                main(int(os.environ["LOCAL_RANK"]))
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            hvd.init()
            for batch_idx, (data, target) in enumerate(train_loader):
                loss = F.nll_loss(model(data), target)
                loss.backward()
                optimizer.step()
                if batch_idx % 10 == 0:
                    print("Train Epoch: {} [{}/{}]\\tLoss: {:.6f}".format(  # expect: DD304
                        epoch, batch_idx * len(data), len(train_sampler), loss.item()))
            """
        ),
    )
    valid = (
        Example(
            """
            import torch.distributed as dist

            dist.init_process_group("nccl")
            rank = dist.get_rank()
            for step, (x, y) in enumerate(loader):
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
                if step % 50 == 0 and rank == 0:
                    print(f"step {step} loss {loss.item():.4f}")
                if step % 1000 == 0:
                    print(f"[rank {rank}] memory {torch.cuda.max_memory_allocated()}")
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from util.misc import setup_for_distributed

            dist.init_process_group("nccl")
            setup_for_distributed(dist.get_rank() == 0)
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
                print("loss", loss.item())
            """
        ),
        Example(
            """
            import torch.distributed as dist

            dist.init_process_group("nccl")
            print("starting")  # once per rank at start-up, not in the loop
            for x in val_loader:
                print(model(x).shape)  # no backward: not a training loop
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.runs_multi_process or PRINT_OVERRIDE.search(ctx.source):
            return
        logging_rank_aware = _logging_rank_aware(ctx)
        for trace in ctx.traces:
            if not ctx.is_entry(trace):
                continue
            training_loops = _training_loops(ctx, trace)
            if not training_loops:
                continue
            for step, call in trace.calls():
                kind = _output_kind(ctx, trace, step, call)
                if kind is None or (kind == "logging" and logging_rank_aware):
                    continue
                if not any(id(loop) in training_loops for loop in step.loops):
                    continue
                if ctx.rank_guards(trace, step) or _mentions_rank(trace, step, call):
                    continue
                yield Report(
                    call,
                    "training progress is printed by every rank (N copies of each line): guard it with "
                    "`if dist.get_rank() == 0:` (or your is_main_process()).",
                )


def _training_loops(ctx: LintContext, trace: Trace) -> set[int]:
    loops: set[int] = set()
    for step, call in trace.calls():
        if ctx.is_backward(call):
            loops.update(id(loop) for loop in step.loops)
    return loops


def _output_kind(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> str | None:
    func = call.func
    if isinstance(func, cst.Name) and func.value == "print":
        if ctx.qualname(func) is None and "print" not in ctx.info.functions:
            return "print"
        return None
    if not (isinstance(func, cst.Attribute) and func.attr.value in LOG_METHODS):
        return None
    qual = ctx.qualname(func)
    if qual is not None:
        return "logging" if qual.startswith("logging.") else None
    found = ctx.binding(trace, step, func.value)
    if found is not None and isinstance(found[1], cst.Call) and ctx.qualname(found[1].func) == "logging.getLogger":
        return "logging"
    return None


def _mentions_rank(trace: Trace, step: Step, call: cst.Call) -> bool:
    for arg in call.args:
        for node in flow.walk(arg.value):
            if isinstance(node, (cst.Name, cst.Attribute, cst.Call)):
                value = trace.value(node, step)
                if value is not None and value.is_rank_like:
                    return True
                if isinstance(node, cst.Name) and "rank" in node.value.lower():
                    return True
    return False


def _logging_rank_aware(ctx: LintContext) -> bool:
    """Whether the script configures logging per rank: `setLevel`/`basicConfig`/`disable` under a
    rank condition or with a rank-dependent argument, or a logger set up with the rank."""
    for trace in ctx.traces:
        for step, call in trace.calls():
            name = dotted(call.func) or ""
            last = name.rsplit(".", 1)[-1]
            if last in ("setLevel", "basicConfig", "disable", "addHandler", "setup_logger", "create_logger", "get_logger"):
                if ctx.rank_guards(trace, step) or _mentions_rank(trace, step, call):
                    return True
                if any(arg.keyword is not None and "rank" in arg.keyword.value for arg in call.args):
                    return True
    return False
