"""DD006 local-rank-as-global-rank: the node-local rank passed to init_process_group as the rank."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import kinds, names, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

INIT = "torch.distributed.init_process_group"
# A world size that is one node's process count by construction: then the local rank is the rank.
ONE_NODE_SIZES = (
    "device_count", "LOCAL_WORLD_SIZE", "local_world_size", "nproc_per_node", "ngpus_per_node", "gpus_per_node",
    "num_gpus", "n_gpus", "ngpus", "nprocs",
)
LOCALHOST = ("127.0.0.1", "localhost")


class LocalRankAsGlobalRank(Rule):
    """
    ## What it does
    Flags `torch.distributed.init_process_group(..., rank=r)` where `r` is the node-local rank:
    read from the `LOCAL_RANK` environment variable, the `--local_rank` argument, or
    `hvd.local_rank()`, directly or through names and attributes it was copied to
    (`args.rank = args.local_rank`).

    Silent for `mp.spawn` worker indices (a one-node spawn job, where the index is the rank), when
    the world size passed is one node's process count (`torch.cuda.device_count()`,
    `LOCAL_WORLD_SIZE`, `num_gpus`, directly or through the name it was stored in), when the
    script pins `MASTER_ADDR` to this machine (`os.environ["MASTER_ADDR"] = "localhost"`, not as a
    fallback under `if "MASTER_ADDR" not in os.environ`), and when the rank expression adds a node
    offset (`node_rank * nproc + local_rank`).

    ## Why is this bad?
    On one node the local rank equals the global rank, so the script works in every test. On two
    nodes, process 0 of each node claims rank 0: the rendezvous rejects the duplicate ranks or
    waits forever for the ranks nobody claimed, and the job hangs at start-up.

    ## Example
    ```python
    local_rank = int(os.environ["LOCAL_RANK"])
    dist.init_process_group("nccl", rank=local_rank, world_size=int(os.environ["WORLD_SIZE"]))
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")  # torchrun's RANK and WORLD_SIZE are read from the environment
    # or: rank=int(os.environ["RANK"])
    ```

    ## Fix safety
    No autofix: where the global rank comes from (`RANK`, Slurm's `SLURM_PROCID`, a node offset)
    depends on the launcher.
    """

    code = "DD006"
    name = "local-rank-as-global-rank"
    severity = "error"
    summary = "the node-local rank passed to init_process_group as the global rank"

    invalid = (
        Example(
            """
            import os
            import torch.distributed as dist

            local_rank = int(os.environ["LOCAL_RANK"])
            world_size = int(os.environ["WORLD_SIZE"])
            dist.init_process_group("nccl", rank=local_rank, world_size=world_size)  # expect: DD006
            """
        ),
        Example(
            """
            import argparse
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)
            parser.add_argument("--world_size", type=int, default=1)
            args = parser.parse_args()
            args.rank = args.local_rank
            dist.init_process_group(backend="nccl", init_method="env://", world_size=args.world_size, rank=args.rank)  # expect: DD006
            """
        ),
    )
    valid = (
        Example(
            """
            import os
            import torch.distributed as dist

            dist.init_process_group("nccl", rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            import torch.multiprocessing as mp


            def worker(gpu, world_size):
                dist.init_process_group("nccl", init_method="tcp://127.0.0.1:29500", rank=gpu, world_size=world_size)


            mp.spawn(worker, nprocs=torch.cuda.device_count(), args=(torch.cuda.device_count(),))
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist

            local_rank = int(os.environ["LOCAL_RANK"])
            # One node by construction: the local rank is the rank.
            dist.init_process_group("nccl", rank=local_rank, world_size=torch.cuda.device_count())
            """
        ),
        Example(
            """
            import os
            import torch.distributed as dist

            local_rank = int(os.environ["LOCAL_RANK"])
            rank = int(os.environ["GROUP_RANK"]) * int(os.environ["LOCAL_WORLD_SIZE"]) + local_rank
            dist.init_process_group("nccl", rank=rank, world_size=int(os.environ["WORLD_SIZE"]))
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.calls(INIT):
            rank = syntax.argument(call, 4, "rank")
            if rank is None or _one_node(ctx, trace, step, call) or _pinned_to_localhost(ctx):
                continue
            value = trace.value(rank, step)
            source = _local_rank_source(ctx, trace, step, value)
            if source is None:
                continue
            yield Report(
                rank,
                f"the local rank ({source}) is passed as the global rank: on one node they are equal, but on "
                f"several nodes process 0 of every node claims rank 0 and the rendezvous hangs or fails. Pass "
                f"the global rank (`int(os.environ[\"RANK\"])`), or leave `rank` out under torchrun.",
            )


def _one_node(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> bool:
    return _one_node_size(ctx, trace, step, syntax.argument(call, 3, "world_size"), 0)


def _one_node_size(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression | None, depth: int) -> bool:
    """The world size is one node's process count (`torch.cuda.device_count()`), followed through
    the names it was stored in; a name is judged by what the file assigns to it (`h.num_gpus =
    int(os.environ["WORLD_SIZE"])` is the whole job's size), and by its own name only when the
    file never assigns it."""
    if expr is None or depth > 3:
        return False
    if isinstance(expr, (cst.Name, cst.Attribute)):
        bound = ctx.binding(trace, step, expr)
        if bound is not None:
            return _one_node_size(ctx, trace, bound[0], bound[1], depth + 1)
        text = names.dotted(expr)
        assigned = [
            node.value
            for node in ctx.nodes(cst.Assign)
            if text is not None and any(names.dotted(target.target) == text for target in node.targets)
        ]
        if assigned:
            return all(_is_one_node_count(ctx, value) for value in assigned)
    return _is_one_node_count(ctx, expr)


def _is_one_node_count(ctx: LintContext, expr: cst.BaseExpression) -> bool:
    """`torch.cuda.device_count()`, `int(os.environ["LOCAL_WORLD_SIZE"])`, `args.ngpus_per_node`:
    no arithmetic (`ngpus_per_node * nnodes` is the whole job)."""
    if any(isinstance(node, cst.BinaryOperation) for node in syntax.walk(expr)):
        return False
    return any(word in ctx.code(expr) for word in ONE_NODE_SIZES)


def _pinned_to_localhost(ctx: LintContext) -> bool:
    """`os.environ["MASTER_ADDR"] = "127.0.0.1"` outside any `if`: the job cannot span nodes."""
    for node in ctx.nodes(cst.Assign):
        if not (isinstance(node.value, cst.SimpleString) and node.value.evaluated_value in LOCALHOST):
            continue
        for target in node.targets:
            if isinstance(target.target, cst.Subscript) and "MASTER_ADDR" in ctx.code(target.target):
                if not any(isinstance(parent, cst.If) for parent in _ancestors(ctx, node)):
                    return True
    return False


def _ancestors(ctx: LintContext, node: cst.CSTNode) -> Iterable[cst.CSTNode]:
    current = ctx.parent(node)
    while current is not None:
        yield current
        current = ctx.parent(current)


def _local_rank_source(ctx: LintContext, trace: Trace, step: Step, value: Value | None) -> str | None:
    """What names the value as the node-local rank, or None when it may be anything else."""
    if value is None or value.kind != kinds.LOCAL_RANK:
        return None
    if value.origin == "env" and value.name == "LOCAL_RANK":
        return "LOCAL_RANK"
    if value.origin == "attr" and value.name.rsplit(".", 1)[-1] == "local_rank" and _parsed_flag(ctx, value.name):
        return f"`{value.name}`, the --local_rank argument"
    if value.origin == "call" and isinstance(value.node, cst.Call):
        if (ctx.qualname(value.node.func) or "") in ("horovod.torch.local_rank", "horovod.local_rank"):
            return "hvd.local_rank()"
    return None


def _parsed_flag(ctx: LintContext, name: str) -> bool:
    """`args.local_rank` comes from `add_argument("--local_rank")` and nothing in the file assigns
    it (a script that stores the global rank there, `args.local_rank = dist.get_rank()`, misnames
    it but passes the right value)."""
    declared = any(
        isinstance(call.func, cst.Attribute)
        and call.func.attr.value == "add_argument"
        and any(
            isinstance(arg.value, cst.SimpleString) and arg.value.evaluated_value in ("--local_rank", "--local-rank")
            for arg in call.args
        )
        for call in ctx.nodes(cst.Call)
    )
    if not declared:
        return False
    return not any(
        names.dotted(target) == name for node in ctx.nodes(cst.Assign) for target in syntax.assigned_targets(node)
    )
