"""DD304 print-on-every-rank: training progress printed by every process."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, _assigned_names
from distdoctor.lint.analysis.loops import training_loops
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

LOG_METHODS = frozenset({"info", "warning", "warn", "debug", "error", "critical", "log", "exception"})
# The script silences the other ranks itself: DeiT/DETR's `setup_for_distributed` replaces
# `builtins.print`; loggers set up per rank (`setup_logger(distributed_rank=...)`).
PRINT_OVERRIDE = re.compile(r"setup_for_distributed|builtins\.print\s*=|__builtin__\.print\s*=|\bdef print\(")
# The torchvision-references helper that DeiT, DETR, DINO, MAE, ConvNeXt copy into their utils:
# it starts the process group and calls `setup_for_distributed(rank == 0)`.
SILENCING_INIT = "init_distributed_mode"
# Calls that name the process: its RPC worker name, its host.
PROCESS_NAMES = ("torch.distributed.rpc.get_worker_info", "socket.gethostname", "platform.node")


class PrintOnEveryRank(Rule):
    """
    ## What it does
    Flags `print(...)` and `logging` calls (`logging.info`, `logger.info` on a logger from
    `logging.getLogger`) inside a training loop (a loop that runs `backward()`) of a distributed
    script, when no rank condition guards them.

    Silent when the message names the process (the rank, or an RPC worker name from
    `rpc.get_worker_info()`, also when passed through a logging helper's parameter or a local
    variable): per-process output is then deliberate, as in RPC parameter-server scripts where
    ranks have different roles; likewise when it reports progress through the process's own
    shard (`len(train_sampler)` of a `DistributedSampler`, as Horovod's examples do). Only output
    that changes from one iteration to the next is progress (it reads the loop counter, the loss,
    anything the loop rebinds); a fixed line printed once is not. A loop that only runs training
    runs (a hyperparameter search rebuilding the optimizer each
    iteration) is no training loop: its per-trial summary is not progress output. Silent for
    `print` when the script replaces it for non-master
    ranks: a `setup_for_distributed` / `builtins.print = ...` in the file, a call to an imported
    `init_distributed_mode` (the torchvision-references helper copied by DeiT, DETR, DINO and MAE,
    which calls `setup_for_distributed(rank == 0)`), or any `print(..., force=True)` (the builtin
    has no `force` keyword: it only runs because `print` was replaced). For `logging`, silent
    when the script sets the logging level or handlers under a rank condition or from the rank
    (`logging.basicConfig(level=INFO if rank in [-1, 0] else WARN)`, `set_logging(rank)`), and
    when the file never configures logging at all (then it is configured elsewhere, per rank or
    not, or not at all, and `logger.info` prints nothing). Silent inside `except` blocks: an
    error report from each rank says what went wrong on that rank.
    Under a condition that may or may not restrict the ranks (`if debug or rank == 0:`), silent.

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

    ## Why it is off by default
    On real training code most unguarded output turned out to be made rank-aware somewhere the
    rule cannot see: a project's logger that writes one file per rank and tags each line with the
    rank, `print` replaced by an imported module, stdout sent to /dev/null on other ranks by the
    repository's own launcher, a rank test stored in a config flag. Measured on the real-world
    corpus, about half of its findings were true (the figure is printed above), far below the 0.9
    a default-on rule must reach. Select it (`--extend-select DD304`) in a script whose output you
    know is not routed per rank elsewhere.

    ## Fix safety
    No autofix: the rank variable to test is the script's choice.
    """

    code = "DD304"
    name = "print-on-every-rank"
    severity = "info"
    default_on = False
    summary = "training progress printed by every rank"
    requires = (frameworks.MULTI_PROCESS_WORDS,)

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

            logging.basicConfig(level=logging.INFO)  # the same level on every rank
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
        Example(
            """
            import os
            import torch
            import torch.distributed as dist

            def init_distributed_mode(args):  # defined here, and it leaves print alone
                args.local_rank = int(os.environ["LOCAL_RANK"])
                torch.cuda.set_device(args.local_rank)
                dist.init_process_group("nccl")

            def say(text):
                print("[train]", text)  # expect: DD304

            def main(args):
                init_distributed_mode(args)
                shard = data.cuda(args.local_rank)
                for it in range(args.iters):
                    loss = model(shard).mean()
                    loss.backward()
                    opt.step()
                    say(f"iter {it} loss {loss.item():.3f}")

            if __name__ == "__main__":
                main(parse_args())
            """
        ),
    )
    valid = (
        Example(
            """
            import logging
            import torch.distributed as dist
            from utils.logging import setup_logging  # configures the levels, per rank or not: unseen

            logger = logging.getLogger(__name__)
            dist.init_process_group("nccl")
            setup_logging(args)
            for step, batch in enumerate(loader):
                try:
                    loss = model(batch).sum()
                    loss.backward()
                    opt.step()
                except RuntimeError:
                    print(f"step {step}: batch of shape {batch.shape} failed")  # each rank's own error
                    raise
                logger.info("step %d loss %.4f", step, loss.item())
            """
        ),
        Example(
            """
            import torch.distributed as dist

            dist.init_process_group("nccl")
            for epoch in range(args.epochs):
                for x, y in loader:
                    loss = model(x).sum()
                    loss.backward()
                    opt.step()
                    if epoch == args.warmup_epochs:
                        print("warm-up over: switching on the KL term")  # a fixed line, once
                if best_loss < args.threshold:
                    print(f"hit threshold {args.threshold}, stopping")
                    break
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            hvd.init()
            sampler = DistributedSampler(ds, num_replicas=hvd.size(), rank=hvd.rank())
            loader = DataLoader(ds, batch_size=64, sampler=sampler)
            for epoch in range(10):
                sampler.set_epoch(epoch)
                for i, (x, y) in enumerate(loader):
                    loss = model(x).sum()
                    loss.backward()
                    opt.step()
                    if i % 10 == 0:
                        # this worker's progress through its own partition: differs per rank
                        print(f"epoch {epoch} [{i * len(x)}/{len(sampler)}] loss {loss.item():.4f}")
            """
        ),
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
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            import misc  # the project's copy of the torchvision-references helpers

            def fit(args, net, loader, opt):
                misc.init_distributed_mode(args)  # replaces print on every rank but 0
                model = DDP(net.cuda(args.gpu), device_ids=[args.gpu])
                for epoch in range(args.epochs):
                    for images, labels in loader:
                        loss = model(images, labels)
                        opt.zero_grad()
                        loss.backward()
                        opt.step()
                        print(f"epoch {epoch} loss {loss.item():.3f}")

            if __name__ == "__main__":
                fit(get_args(), Net(), make_loader(), make_opt())
            """
        ),
        Example(
            """
            import math
            import torch.distributed as dist

            dist.init_process_group("nccl")
            for step, batch in enumerate(loader):
                loss = model(**batch).loss
                if not math.isfinite(loss.item()):
                    print(f"non-finite loss at step {step}", force=True)  # print was replaced elsewhere
                    raise SystemExit(1)
                loss.backward()
                opt.step()
                if step % 100 == 0:
                    print(f"step {step}: {loss.item():.4f}")
            """
        ),
        Example(
            """
            import time
            import torch.distributed as dist
            import torch.distributed.rpc as rpc
            import torch.multiprocessing as mp

            def stamp(msg):
                print(time.strftime("%H:%M:%S"), msg)

            def trainer_loop(steps):
                me = rpc.get_worker_info().name
                net = make_net()
                for x, y in make_batches(steps):
                    loss = net(x).sub(y).pow(2).mean()
                    loss.backward()
                    stamp(f"{me}: batch done")  # each worker names itself: different roles, not copies

            def run(rank, world):
                dist.init_process_group("gloo", rank=rank, world_size=world)
                rpc.init_rpc(f"worker{rank}", rank=rank, world_size=world)
                if rank == 0:
                    futures = [rpc.rpc_async(f"worker{i}", trainer_loop, args=(100,)) for i in range(1, world)]
                    for fut in futures:
                        fut.wait()
                rpc.shutdown()

            if __name__ == "__main__":
                mp.spawn(run, args=(3,), nprocs=3)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.runs_multi_process or PRINT_OVERRIDE.search(ctx.source):
            return
        # Logging that this file does not configure is configured elsewhere (per rank or not:
        # unknown) or not at all (then `info` prints nothing): either way, say nothing.
        logging_rank_aware = _logging_rank_aware(ctx) or not _configures_logging(ctx)
        print_replaced = _print_replaced(ctx)
        for trace in ctx.traces:
            if not ctx.is_entry(trace):
                continue
            training_loops = _training_loops(ctx, trace)
            if not training_loops:
                continue
            for step, call in trace.calls():
                kind = _output_kind(ctx, trace, step, call)
                if kind is None or (kind == "logging" and logging_rank_aware) or (kind == "print" and print_replaced):
                    continue
                if not any(id(loop) in training_loops for loop in step.loops):
                    continue
                if _in_except_handler(ctx, step):
                    continue  # error reports: each rank says what went wrong on it
                if ctx.rank_guards(trace, step, uncertain=True) or _mentions_rank(trace, step, call):
                    continue
                if any(_names_process(ctx, trace, step, arg.value) for arg in call.args):
                    continue
                if _reports_own_shard(trace, step, call):
                    continue
                if not _reports_progress(trace, step, call, training_loops):
                    continue
                yield Report(
                    call,
                    "training progress is printed by every rank (N copies of each line): guard it with "
                    "`if dist.get_rank() == 0:` (or your is_main_process()).",
                )


def _training_loops(ctx: LintContext, trace: Trace) -> set[int]:
    # Not a hyperparameter search around them: its per-trial output is no training progress.
    return training_loops(ctx, trace)


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
        for node in syntax.walk(arg.value):
            if isinstance(node, (cst.Name, cst.Attribute, cst.Call)):
                value = trace.value(node, step)
                if value is not None and value.is_rank_like:
                    return True
                if isinstance(node, cst.Name) and "rank" in node.value.lower():
                    return True
    return False


LOGGING_SETUP = frozenset({"basicConfig", "setLevel", "addHandler", "dictConfig", "fileConfig"})


def _configures_logging(ctx: LintContext) -> bool:
    for call in ctx.nodes(cst.Call):
        if (dotted(call.func) or "").rsplit(".", 1)[-1] in LOGGING_SETUP:
            return True
    return False


def _in_except_handler(ctx: LintContext, step: Step) -> bool:
    """Whether the step runs inside an `except` block, in its function or at the call site that
    ran it."""
    node = ctx.parent(step.node)
    frame = step.frame
    while node is not None:
        if isinstance(node, cst.ExceptHandler):
            return True
        if isinstance(node, cst.FunctionDef):
            while frame is not None and frame.function is not node:
                frame = frame.parent
            if frame is None or frame.call is None or frame.parent is None:
                return False
            node, frame = ctx.parent(frame.call), frame.parent
            continue
        node = ctx.parent(node)
    return False


def _reports_progress(trace: Trace, step: Step, call: cst.Call, training_loops: set[int]) -> bool:
    """Whether the output changes from iteration to iteration: it reads a name the training loop
    (re)binds (its counter, the loss), or runs in a helper the loop calls. A fixed line
    (`print("Begin hard attention loss")`, `print(f"Hit threshold {args.threshold}")`) printed
    once is no progress report."""
    read = set()
    for arg in call.args:
        read |= _names_read(arg.value)
    if not read:
        return False
    loops = [loop for loop in step.loops if id(loop) in training_loops]
    loop_frames = {id(other.frame) for other in trace.steps if other.node in loops}
    if id(step.frame) not in loop_frames:
        return True  # a helper called in the loop: its arguments are per-iteration values
    for other in trace.steps:
        if other.frame is not step.frame or not any(other.in_loop(loop) or other.node is loop for loop in loops):
            continue
        if read & _assigned_names(other.node):
            return True
    return False


def _names_read(expr: cst.BaseExpression) -> set[str]:
    attribute_names: set[int] = set()
    names: set[str] = set()
    for node in syntax.walk(expr, skip=(cst.Lambda,)):
        if isinstance(node, cst.Attribute):
            attribute_names.add(id(node.attr))
        elif isinstance(node, cst.Name) and id(node) not in attribute_names:
            names.add(node.value)
    return names


def _reports_own_shard(trace: Trace, step: Step, call: cst.Call) -> bool:
    """`print(..., len(train_sampler), ...)`: progress through this process's own partition of the
    data (Horovod's examples), which differs per rank, so each rank's line says something."""
    for arg in call.args:
        for node in syntax.walk(arg.value, skip=(cst.Lambda,)):
            if isinstance(node, cst.Call) and isinstance(node.func, cst.Name) and node.func.value == "len" and node.args:
                value = trace.value(node.args[0].value, step)
                if value is not None and value.kind == kinds.SAMPLER:
                    return True
    return False


def _print_replaced(ctx: LintContext) -> bool:
    """Whether `print` is replaced by a rank-aware one outside this file: an imported
    `init_distributed_mode` is called, or a `print(..., force=True)` appears."""
    for call in ctx.nodes(cst.Call):
        func = call.func
        if isinstance(func, cst.Name) and func.value == "print":
            if any(arg.keyword is not None and arg.keyword.value == "force" for arg in call.args):
                return True
        elif (dotted(func) or "").rsplit(".", 1)[-1] == SILENCING_INIT and not (
            isinstance(func, cst.Name) and func.value in ctx.info.functions
        ):
            return True  # imported: the helper replaces print; one defined here is read as it is
    return False


def _names_process(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0, text: bool = True) -> bool:
    """Whether the printed `expr` names the process that prints it: the rank, or a name from
    `rpc.get_worker_info()` / the host name. Names are followed to what they were bound to: a
    helper's parameter to the argument at the call site (`log(f"{worker} done")`), a local to its
    assignment (`worker = rpc.get_worker_info().name`). In a followed assignment that is not a
    string, only a process-naming call counts (`batch.cuda(rank)` does not name the process)."""
    attribute_names: set[int] = set()
    params = set()
    if step.frame.function is not None:
        params = {p.name.value for p in step.frame.function.params.params}
    for node in syntax.walk(expr, skip=(cst.Lambda,)):
        if isinstance(node, cst.Attribute):
            attribute_names.add(id(node.attr))
        if isinstance(node, cst.Call) and ctx.qualname(node.func) in PROCESS_NAMES:
            return True
        if depth > 0 and text and isinstance(node, (cst.Name, cst.Attribute)) and id(node) not in attribute_names:
            value = trace.value(node, step)
            if (value is not None and value.is_rank_like) or (isinstance(node, cst.Name) and "rank" in node.value.lower()):
                return True
        if isinstance(node, cst.Name) and id(node) not in attribute_names and depth < 4:
            found = ctx.binding(trace, step, node)
            if found is None:
                continue
            source_step, source = found
            follow_text = text and (node.value in params or _is_text(source))
            if _names_process(ctx, trace, source_step, source, depth + 1, follow_text):
                return True
    return False


def _is_text(expr: cst.BaseExpression) -> bool:
    """A string being built: an f-string, a literal, `"...".format(...)`, `"..." % x`, `+` of them."""
    if isinstance(expr, (cst.FormattedString, cst.SimpleString, cst.ConcatenatedString)):
        return True
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "format":
        return _is_text(expr.func.value)
    if isinstance(expr, cst.BinaryOperation) and isinstance(expr.operator, (cst.Add, cst.Modulo)):
        return _is_text(expr.left) or _is_text(expr.right)
    return False


def _logging_rank_aware(ctx: LintContext) -> bool:
    """Whether the script configures logging per rank: `setLevel`/`basicConfig`/`disable` under a
    rank condition or with a rank-dependent argument, or a logger set up with the rank."""
    for trace in ctx.traces:
        for step, call in trace.calls():
            name = dotted(call.func) or ""
            last = name.rsplit(".", 1)[-1]
            # ... or a project helper that sets logging up with the rank (`set_logging(rank)`,
            # `setup_logging(args.rank)`): its body is elsewhere, its arguments say enough.
            if last in ("setLevel", "basicConfig", "disable", "addHandler", "setup_logger", "create_logger", "get_logger") or "logging" in last.lower() or "logger" in last.lower():
                if ctx.rank_guards(trace, step, uncertain=True) or _mentions_rank(trace, step, call):
                    return True
                if any(arg.keyword is not None and "rank" in arg.keyword.value for arg in call.args):
                    return True
    return False
