"""DD204 sampler-seed-differs-per-rank: a DistributedSampler seed that is not the same on all ranks."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

SAMPLER = "torch.utils.data.DistributedSampler"
TIME_CALLS = frozenset(
    {
        "time.time", "time.time_ns", "time.perf_counter", "time.perf_counter_ns", "time.monotonic",
        "time.monotonic_ns", "time.process_time", "datetime.datetime.now", "datetime.datetime.utcnow",
        "datetime.datetime.today", "datetime.now",
    }
)
RANDOM_CALLS = frozenset(
    {
        "torch.randint", "torch.rand", "torch.randn", "torch.randperm", "torch.seed", "os.urandom",
        "os.getpid", "uuid.uuid4", "uuid.uuid1", "torch.cuda.seed",
    }
)
RANDOM_PREFIXES = ("random.", "numpy.random.", "secrets.")
# Calls that pass a value through unchanged enough that what feeds them feeds the seed.
TRANSPARENT = frozenset({"int", "float", "abs", "hash", "str", "round", "max", "min", "sum"})
TRANSPARENT_METHODS = frozenset({"item", "tolist", "int", "long", "numpy", "cpu"})
MAX_DEPTH = 4


class SamplerSeedDiffersPerRank(Rule):
    """
    ## What it does
    Flags `DistributedSampler(..., seed=...)` whose seed depends on the rank (`seed + rank`,
    `args.seed + dist.get_rank()`, `hvd.rank()`, the local rank), on the clock
    (`time.time()`, `datetime.now()`) or on a random source (`random.randint`, `np.random.*`,
    `torch.randint`, `os.getpid()`), directly or through variables computed from them.

    A seed that varies per rank for *model* initialisation or augmentation is fine elsewhere;
    this rule only looks at the sampler's seed.

    ## Why is this bad?
    Every rank shuffles the full index list with `seed + epoch` and then takes its own slice.
    The slices only partition the dataset when all ranks shuffled identically. With a per-rank
    (or random, or time-based) seed each rank slices a different permutation: some samples are
    seen by several ranks and others by none, every epoch, silently.

    ## Example
    ```python
    sampler = DistributedSampler(train_set, seed=args.seed + rank)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(train_set, seed=args.seed)  # the same on every rank
    ```

    ## Fix safety
    No fix is offered: which part of the expression is the intended shared seed is not always
    clear (`int(time.time())` has none).
    """

    code = "DD204"
    name = "sampler-seed-differs-per-rank"
    severity = "error"
    summary = "DistributedSampler seed depends on the rank, the time or a random source"
    requires = (frameworks.SAMPLER_WORDS,)

    invalid = (
        Example(
            """
            import torch.distributed as dist
            from torch.utils.data import DistributedSampler

            rank = dist.get_rank()
            sampler = DistributedSampler(train_set, seed=args.seed + rank)  # expect: DD204
            """
        ),
        Example(
            """
            import time
            import torch

            seed = int(time.time())
            sampler = torch.utils.data.distributed.DistributedSampler(dataset, shuffle=True, seed=seed)  # expect: DD204
            """
        ),
        Example(
            """
            import numpy as np
            import horovod.torch as hvd
            from torch.utils.data.distributed import DistributedSampler as DS

            hvd.init()
            sampler = DS(dataset, num_replicas=hvd.size(), rank=hvd.rank(),
                         seed=np.random.randint(0, 10000))  # expect: DD204
            """
        ),
        Example(
            """
            import os
            from torch.utils.data import DistributedSampler

            class Data:
                def __init__(self, args, dataset):
                    args.seed = args.seed + int(os.environ["LOCAL_RANK"])
                    self.sampler = DistributedSampler(dataset, seed=args.seed)  # expect: DD204
            """
        ),
    )
    valid = (
        Example(
            # With shuffle=False the seed is never used: every rank slices the same order.
            """
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler


            def main(rank, world_size, dataset):
                dist.init_process_group("nccl", rank=rank, world_size=world_size)
                sampler = DistributedSampler(dataset, shuffle=False, num_replicas=world_size, rank=rank, seed=rank)
                loader = DataLoader(dataset, batch_size=32, sampler=sampler)
                for epoch in range(10):
                    train_one_epoch(loader)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DistributedSampler

            rank = dist.get_rank()
            torch.manual_seed(args.seed + rank)  # per-rank model/augmentation seed: fine
            sampler = DistributedSampler(train_set, seed=args.seed)
            """
        ),
        Example(
            """
            from torch.utils.data import DistributedSampler

            SEED = 1234
            sampler = DistributedSampler(train_set, num_replicas=world_size, rank=rank, seed=SEED)
            """
        ),
        Example(
            """
            import random
            import torch
            import torch.distributed as dist
            from torch.utils.data import DistributedSampler

            seed = torch.tensor([random.randint(0, 2**31)], device="cuda")
            dist.broadcast(seed, src=0)  # one random seed, shared by every rank
            sampler = DistributedSampler(train_set, seed=int(seed.item()))
            """
        ),
        Example(
            """
            from torch.utils.data import DistributedSampler

            sampler = DistributedSampler(train_set, seed=cfg.seed + epoch_offset)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        reported: set[int] = set()
        for trace, step, call in ctx.calls(SAMPLER):
            if id(call) in reported:
                continue
            seed = syntax.argument(call, 4, "seed")
            if seed is None:
                continue
            shuffle = syntax.argument(call, 3, "shuffle")
            if shuffle is not None and syntax.const_value(shuffle) == (True, False):
                continue  # `shuffle=False`: the seed is never used, every rank slices the same order
            cause = _varies(ctx, trace, step, seed, 0)
            if cause is None:
                continue
            reported.add(id(call))
            yield Report(
                syntax.arg_node(call, seed),
                f"the DistributedSampler seed `{ctx.code(seed)}` depends on {cause}, so it differs "
                "between ranks: each rank shuffles differently before taking its slice, and the "
                "shards overlap while other samples are never seen. Give every rank the same seed "
                "(args.seed, a constant).",
            )


def _varies(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int) -> str | None:
    """What makes `expr` differ between processes (rank, time, randomness), if anything known."""
    if depth > MAX_DEPTH:
        return None
    if isinstance(expr, cst.BinaryOperation):
        return _varies(ctx, trace, step, expr.left, depth + 1) or _varies(ctx, trace, step, expr.right, depth + 1)
    if isinstance(expr, cst.UnaryOperation):
        return _varies(ctx, trace, step, expr.expression, depth + 1)
    if isinstance(expr, cst.IfExp):
        return _varies(ctx, trace, step, expr.body, depth + 1) or _varies(ctx, trace, step, expr.orelse, depth + 1)
    if isinstance(expr, cst.Call):
        qual = ctx.qualname(expr.func)
        if qual is not None:
            if qual in TIME_CALLS or qual.startswith("time."):
                return f"the clock ({qual}())"
            if qual in RANDOM_CALLS or qual.startswith(RANDOM_PREFIXES):
                return f"a random source ({qual}())"
        value = trace.value(expr, step)
        if value is not None and value.is_rank_like:
            return f"the rank ({ctx.code(expr)})"
        if qual is None and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in TRANSPARENT_METHODS:
            return _varies(ctx, trace, step, expr.func.value, depth + 1)  # torch.randint(...).item()
        if qual is None and isinstance(expr.func, cst.Name) and expr.func.value in TRANSPARENT:
            for arg in expr.args:
                found = _varies(ctx, trace, step, arg.value, depth + 1)
                if found:
                    return found
        return None
    if isinstance(expr, (cst.Name, cst.Attribute)):
        value = trace.value(expr, step)
        if value is None:
            return None
        if value.is_rank_like:
            return f"the rank ({ctx.code(expr)})"
        if value.kind == kinds.UNKNOWN and isinstance(value.node, (cst.Assign, cst.AnnAssign)) and value.node.value is not None:
            return _varies(ctx, trace, step, value.node.value, depth + 1)
    return None
