"""DD306 metric-not-reduced: a validation metric over one rank's shard reported as the whole."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import evaluate, frameworks, guarded_calls, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, _assigned_names
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

LOG_METHODS = frozenset({"info", "warning", "log", "add_scalar", "add_scalars", "debug"})
# Helpers that combine results across ranks (project utilities, torchmetrics' compute(),
# accelerate's gather): when unknown, assume they reduce.
REDUCING_NAME = re.compile(r"reduce|gather|sync|all_|compute|average|metric_average|(^|_)(dist|ddp|hvd|world|global)(_|$)")
# Inside the loop, per batch: only names that say a cross-rank reduction (`reduce_tensor`,
# `all_gather`, `dist_sum`), not `compute_score(...)` or `average(...)` of the batch.
BATCH_REDUCING_NAME = re.compile(r"reduce|gather|all_|(^|_)(dist|ddp|hvd)(_|$)")


class MetricNotReduced(Rule):
    """
    ## What it does
    Flags a value computed in an evaluation loop (no `backward()`) over a `DataLoader` whose
    sampler is a `DistributedSampler`, then printed or logged (`print`, a logger, TensorBoard,
    `wandb.log`, a progress bar's `write`) under a rank-0 condition, when no
    collective (`all_reduce`, `all_gather`, `reduce`, `hvd.allreduce`, ...) and no helper whose
    name says it reduces (`reduce_tensor`, `dist_sum`, `synchronize_between_processes`,
    `metric.compute()`, `accelerator.gather`) runs in the loop (batch by batch) or between the
    loop and the report.

    ## Why is this bad?
    A `DistributedSampler` gives each rank 1/N of the validation set. A metric computed from one
    rank's shard and reported by rank 0 describes that shard only: it is noisier, and it moves
    when the number of GPUs changes. This is advice (info): the training itself is unaffected.

    ## Example
    ```python
    for x, y in val_loader:               # DistributedSampler
        correct += (model(x).argmax(1) == y).sum()
    if rank == 0:
        print("val acc", correct / len(val_loader.dataset))
    ```

    ## Use instead
    ```python
    for x, y in val_loader:
        correct += (model(x).argmax(1) == y).sum()
    dist.all_reduce(correct)
    if rank == 0:
        print("val acc", correct / len(val_loader.dataset))
    ```

    ## Fix safety
    No autofix: the metric's tensors, their reduction op and the padding of the sampler
    (see DD205) are the script's to choose.
    """

    code = "DD306"
    name = "metric-not-reduced"
    severity = "info"
    summary = "validation metric of one rank's shard reported without all-reduce"
    requires = (
        frameworks.DISTRIBUTED_WORDS,
        frameworks.SAMPLER_WORDS | frameworks.DGL_DDP_WORDS,
        frameworks.LOADER_WORDS | frameworks.DGL_LOADER_WORDS,
    )

    invalid = (
        Example(
            # Reported through the progress bar (`pbar.write`) on rank 0: still one rank's shard.
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            from tqdm import tqdm


            def evaluate(model, valid_set, step, pbar):
                loader = DataLoader(valid_set, batch_size=8, sampler=DistributedSampler(valid_set))
                valid_loss = 0.0
                with torch.no_grad():
                    for batch in loader:
                        valid_loss += model(batch.cuda()).mean().item()
                valid_loss /= len(loader)
                if dist.get_rank() == 0:
                    pbar.write(f"step {step}: valid_loss {valid_loss:.4f}")  # expect: DD306
            """
        ),
        Example(
            """
            import dgl
            import torch
            import torch.distributed as dist

            def run(rank, graph, val_ids, model):
                dist.init_process_group("nccl", rank=rank, world_size=4)
                sampler = dgl.dataloading.NeighborSampler([10, 10])
                val_loader = dgl.dataloading.DataLoader(graph, val_ids, sampler, use_ddp=True, batch_size=1024)
                correct = total = 0
                with torch.no_grad():
                    for input_nodes, seeds, blocks in val_loader:  # this rank's quarter of val_ids
                        pred = model(blocks).argmax(1)
                        correct += (pred == blocks[-1].dstdata["label"]).sum().item()
                        total += len(seeds)
                if rank == 0:
                    print("val acc", correct / total)  # expect: DD306
            """
        ),
        Example(
            # A per-batch helper named `compute_...` reduces nothing across ranks.
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            def evaluate(model, dataset):
                loader = DataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=False))
                score = 0.0
                for x, y in loader:
                    score += compute_score_with_logits(model(x), y).sum().item()
                score = score / len(loader.dataset)
                if dist.get_rank() == 0:
                    print("eval score", score)  # expect: DD306
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
            correct = total = 0
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum().item()
                    total += y.numel()
            if dist.get_rank() == 0:
                print(f"val acc {correct / total:.3f}")  # expect: DD306
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            @torch.no_grad()
            def evaluate(model, loader):
                losses = []
                for x, y in loader:
                    losses.append(criterion(model(x), y).item())
                return sum(losses) / len(losses)

            def main(args):
                sampler = DistributedSampler(val_set, shuffle=False)
                loader = DataLoader(val_set, batch_size=64, sampler=sampler)
                val_loss = evaluate(model, loader)
                if args.rank == 0:
                    writer.add_scalar("val/loss", val_loss, epoch)  # expect: DD306
            """
        ),
        Example(
            """
            import logging
            import horovod.torch as hvd
            import torch.utils.data.distributed

            logger = logging.getLogger("train")
            hvd.init()
            test_sampler = torch.utils.data.distributed.DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank())
            test_loader = torch.utils.data.DataLoader(test_set, batch_size=1000, sampler=test_sampler)
            test_accuracy = 0.0
            for data, target in test_loader:
                pred = model(data).argmax(dim=1)
                test_accuracy += pred.eq(target).float().sum()
            test_accuracy /= len(test_sampler)
            if hvd.rank() == 0:
                logger.info("Test accuracy: %.2f%%", 100.0 * test_accuracy)  # expect: DD306
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler, SequentialSampler

            def evaluate(args, model, dataset):
                sampler = SequentialSampler(dataset) if args.local_rank == -1 else DistributedSampler(dataset)
                correct = 0
                for x, y in DataLoader(dataset, sampler=sampler, batch_size=64):
                    correct += (model(x).argmax(1) == y).sum().item()
                return {"acc": correct / len(dataset)}

            def train(args, model, dataset):
                for step, batch in enumerate(loader):
                    model(batch).loss.backward()
                    if args.local_rank in [-1, 0] and step % args.save_steps == 0:
                        if args.local_rank == -1:  # only a single process evaluates during training
                            results = evaluate(args, model, dataset)
                            print("acc", results["acc"])
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            from utils.dist import dist_sum

            def evaluate(model, dataset):
                loader = DataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=False))
                correct = torch.zeros(1, device="cuda")
                seen = torch.zeros(1, device="cuda")
                for x, y in loader:
                    batch_correct = (model(x).argmax(1) == y).sum()
                    dist.all_reduce(batch_correct)  # reduced batch by batch
                    correct += batch_correct
                    seen += y.numel()
                seen = dist_sum(seen)  # a project helper that all-reduces
                if dist.get_rank() == 0:
                    print("val acc", (correct / seen).item())
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
            stats = torch.zeros(2, device="cuda")
            with torch.no_grad():
                for x, y in val_loader:
                    stats[0] += (model(x).argmax(1) == y).sum()
                    stats[1] += y.numel()
            dist.all_reduce(stats)
            if dist.get_rank() == 0:
                print(f"val acc {(stats[0] / stats[1]).item():.3f}")
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            import torch.utils.data.distributed

            def metric_average(val, name):
                return hvd.allreduce(torch.tensor(val), name=name).item()

            hvd.init()
            test_sampler = torch.utils.data.distributed.DistributedSampler(test_set, num_replicas=hvd.size(), rank=hvd.rank())
            test_loader = torch.utils.data.DataLoader(test_set, batch_size=1000, sampler=test_sampler)
            test_loss = 0.0
            for data, target in test_loader:
                test_loss += F.nll_loss(model(data), target).item()
            test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
            if hvd.rank() == 0:
                print("Test loss", test_loss)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader

            val_loader = DataLoader(val_set, batch_size=256)  # the whole set on each rank
            correct = 0
            for x, y in val_loader:
                correct += (model(x).argmax(1) == y).sum().item()
            if dist.get_rank() == 0:
                print("val acc", correct / len(val_set))
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            dist.init_process_group("nccl")
            rank = dist.get_rank()


            def my_part(batch):
                # Each rank takes its slice of the global batch: a copy, no evaluation.
                for part in DataLoader(batch, batch_size=len(batch), sampler=DistributedSampler(batch, shuffle=False)):
                    mine = part
                return mine


            for epoch in range(epochs):
                for batch in loader:
                    loss = model(my_part(batch)).mean()
                    loss.backward()
                    optimizer.step()
                path = f"ckpt-{epoch}.pt"
                if rank == 0:
                    print("saving " + path + f" after loss {loss.item()}")
            """
        ),
        Example(
            # A calibration pass over a sharded loader computes no metric: the batch it moves to
            # the device is not what the training loop's accuracy is made of.
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            calibration = DataLoader(data, sampler=DistributedSampler(data))
            with torch.no_grad():
                for inputs, _ in calibration:
                    inputs = inputs.to(device)
                    model(inputs)
            for epoch in range(epochs):
                correct = 0
                for inputs, labels in train_loader:
                    outputs = model(inputs)
                    criterion(outputs, labels).backward()
                    optimizer.step()
                    correct += (outputs.argmax(1) == labels).sum().item()
                if dist.get_rank() == 0:
                    print(f"train accuracy {correct}")
            """
        ),
        Example(
            # The sums go through a helper of the project's own utils, which may all-reduce them.
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler
            from utils.util import sum_main

            def evaluate(model, dataset, args):
                loader = DataLoader(dataset, sampler=DistributedSampler(dataset, shuffle=False))
                correct = torch.zeros(1)
                for inputs, labels in loader:
                    correct += (model(inputs).argmax(1) == labels).sum()
                correct = sum_main(correct, args)
                if dist.get_rank() == 0:
                    print(f"accuracy {correct.item() / len(dataset)}")
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed or not ctx.may_call(*frameworks.SAMPLER_QUALS, *frameworks.DGL_DDP_LOADERS):
            return  # an evaluation loop here iterates a DataLoader over a DistributedSampler
        for trace in ctx.traces:
            for loop_step in _eval_loops(ctx, trace):
                yield from _unreduced_reports(ctx, trace, loop_step)


def _eval_loops(ctx: LintContext, trace: Trace) -> Iterable[Step]:
    for step in trace.steps:
        if not isinstance(step.node, cst.For):
            continue
        source = _iterated(trace, step, step.node.iter)
        if source is None or source.kind != kinds.LOADER or source.inner is None or source.inner.kind != kinds.SAMPLER:
            continue
        if guarded_calls.single_process_only(ctx, step):
            continue  # `if args.local_rank == -1: evaluate(...)`: one process sees the whole set
        loop = step.node
        calls = [call for other in trace.steps if other.in_loop(loop) for call in syntax.own_calls(other.node)]
        # An evaluation runs something on each batch; a loop that only copies what it draws
        # (`for data in loader: batch = data`, a batch split across ranks) computes no metric.
        if calls and not any(ctx.is_backward(call) for call in calls):
            yield step


def _iterated(trace: Trace, step: Step, iterable: cst.BaseExpression) -> kinds.Value | None:
    inner = iterable
    while isinstance(inner, cst.Call) and inner.args and dotted(inner.func) in ("enumerate", "tqdm", "tqdm.tqdm", "iter"):
        inner = inner.args[0].value
    return trace.value(inner, step)


def _unreduced_reports(ctx: LintContext, trace: Trace, loop_step: Step) -> Iterable[Report]:
    loop = loop_step.node
    seeds: set[tuple[int, str]] = set()
    for other in trace.steps[loop_step.index + 1 :]:
        if not other.in_loop(loop):
            break
        if any(_reduces(ctx, call, BATCH_REDUCING_NAME) for call in syntax.own_calls(other.node)):
            return  # reduced batch by batch inside the loop (`dist.all_reduce(correct)`)
        seeds |= {(other.frame.id, name) for name in _accumulated_names(other.node)}
        for call in syntax.own_calls(other.node):
            # `losses.append(...)`, `meter.update(...)`: accumulators mutated in place.
            if isinstance(call.func, cst.Attribute) and call.func.attr.value in ("append", "extend", "update", "add", "add_", "add_batch"):
                base = call.func.value
                while isinstance(base, (cst.Attribute, cst.Subscript)):
                    base = base.value
                if isinstance(base, cst.Name):
                    seeds.add((other.frame.id, base.value))
    if not seeds:
        return
    for later, uses in ctx.data_flow(trace, loop_step, seeds):
        if later.in_loop(loop):
            continue
        for call in syntax.own_calls(later.node):
            if _reduces(ctx, call):
                return
            if uses and evaluate.project_module(ctx.qualname(call.func) or ""):
                return  # `sum_main(correct, args)` from the project's utils: it may all-reduce; cannot tell
        if not uses or not ctx.under_rank_zero(trace, later):
            continue
        for call in syntax.own_calls(later.node):
            if _is_report(ctx, call):
                yield Report(
                    call,
                    "this metric was computed on this rank's DistributedSampler shard only (1/N of the validation "
                    "set) and is reported without an all-reduce: `dist.all_reduce` the sums (or counts) first.",
                )
                return


def _accumulated_names(node: cst.CSTNode) -> set[str]:
    """The names a statement of the loop accumulates into: `correct += ...`, `preds =
    torch.cat([preds, out])`, `results[key] = ...`. A name bound afresh each batch
    (`inputs = inputs.to(device)`, the loop's own target) holds one batch, not a metric of the
    shard."""
    if isinstance(node, cst.AugAssign):
        return _assigned_names(node)
    if not isinstance(node, (cst.Assign, cst.AnnAssign)) or node.value is None:
        return set()
    read = {name.value for name in syntax.walk(node.value) if isinstance(name, cst.Name)}
    # `inputs = inputs.to(device)` reads `inputs` to move it, not to add to it.
    receiver = node.value
    while isinstance(receiver, cst.Call) and isinstance(receiver.func, cst.Attribute):
        receiver = receiver.func.value
    moved = receiver.value if receiver is not node.value and isinstance(receiver, cst.Name) else None
    targets = [t.target for t in node.targets] if isinstance(node, cst.Assign) else [node.target]
    while any(isinstance(target, (cst.Tuple, cst.List)) for target in targets):
        targets = [
            element.value for target in targets for element in (target.elements if isinstance(target, (cst.Tuple, cst.List)) else [])
        ] + [target for target in targets if not isinstance(target, (cst.Tuple, cst.List))]
    names: set[str] = set()
    for target in targets:
        for name in _assigned_names(cst.Assign([cst.AssignTarget(target)], cst.Name("None"))):
            if not isinstance(target, cst.Name) or (name in read and name != moved):
                names.add(name)
    return names


def _reduces(ctx: LintContext, call: cst.Call, names: re.Pattern[str] = REDUCING_NAME) -> bool:
    if ctx.collective_name(call) is not None:
        return True
    if (ctx.qualname(call.func) or "").startswith("torch."):
        return False  # `torch.cuda.synchronize()` waits for the GPU; it reduces nothing
    name = dotted(call.func) or ""
    return bool(names.search(name.rsplit(".", 1)[-1].lower()))


def _is_report(ctx: LintContext, call: cst.Call) -> bool:
    func = call.func
    if isinstance(func, cst.Name):
        return func.value == "print" and ctx.qualname(func) is None
    if isinstance(func, cst.Attribute):
        if func.attr.value in LOG_METHODS:
            return True
        if func.attr.value == "write":
            # A progress bar's own output line: `pbar.write(...)`, `tqdm.write(...)`.
            receiver = (dotted(func.value) or "").rsplit(".", 1)[-1].lower()
            return receiver == "tqdm" or "pbar" in receiver or receiver.endswith("bar")
        return dotted(func) in ("wandb.log",)
    return False
