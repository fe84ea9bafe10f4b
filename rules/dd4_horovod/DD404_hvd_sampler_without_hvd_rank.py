"""DD404 hvd-sampler-without-hvd-rank: a DistributedSampler in a Horovod script that asks
torch.distributed (never initialised) for the rank and world size."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.loaders import bound_expression
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

SAMPLER = "torch.utils.data.DistributedSampler"


class HorovodSamplerWithoutHorovodRank(Rule):
    """
    ## What it does
    Flags `DistributedSampler(dataset)` in a Horovod script, when `num_replicas` or `rank` is not
    passed, or is read from `torch.distributed` (`dist.get_world_size()`, `dist.get_rank()`), and
    the script never initialises a `torch.distributed` process group. Also flags a sampler sharded
    by `hvd.local_size()` / `hvd.local_rank()`, which repeats the same shards on every node,
    unless the dataset itself is built per node (from a rank or node of its own, such as the
    keys of a node's own database).

    ## Why is this bad?
    Without `num_replicas` and `rank`, `DistributedSampler` asks `torch.distributed` for them, and
    raises `RuntimeError: Default process group has not been initialized` when, as under Horovod,
    no process group exists. The local rank and local size describe one node only: with them,
    node 2 reads exactly the samples node 1 reads. Horovod's examples pass both:
    `DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())`.

    A script that also calls `init_process_group` (or a helper named like `init_distributed_mode`)
    is not reported: there the sampler can read the process group.

    ## Example
    ```python
    hvd.init()
    sampler = DistributedSampler(train_set)
    ```

    ## Use instead
    ```python
    hvd.init()
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank())
    ```

    ## Fix safety
    No fix: the Horovod module's local name, and whether the sampler should use a process set's
    size and rank, are for the author to decide.
    """

    code = "DD404"
    name = "hvd-sampler-without-hvd-rank"
    severity = "error"
    summary = "DistributedSampler without num_replicas=hvd.size(), rank=hvd.rank() under Horovod"
    requires = (frameworks.HOROVOD_WORDS, frameworks.SAMPLER_WORDS)

    invalid = (
        Example(
            """
            import torch
            import horovod.torch as hvd
            from torch.utils.data import DataLoader
            from torch.utils.data.distributed import DistributedSampler

            hvd.init()
            sampler = DistributedSampler(train_set)  # expect: DD404
            loader = DataLoader(train_set, batch_size=32, sampler=sampler)
            """
        ),
        Example(
            """
            import torch.utils.data
            from horovod import torch as hv

            def loaders(args, dataset):
                sampler = torch.utils.data.distributed.DistributedSampler(  # expect: DD404
                    dataset, rank=hv.rank(), shuffle=True
                )
                return torch.utils.data.DataLoader(dataset, sampler=sampler)
            """
        ),
        Example(
            """
            import horovod.torch
            import torch.utils.data as tud

            class Data:
                def __init__(self, ds):
                    horovod.torch.init()
                    self.sampler = tud.DistributedSampler(ds, num_replicas=horovod.torch.size())  # expect: DD404
            """
        ),
        Example(
            """
            import torch.distributed as dist
            import horovod.torch as hvd
            from torch.utils.data import DistributedSampler

            hvd.init()
            sampler = DistributedSampler(
                train_set,
                num_replicas=dist.get_world_size(),  # expect: DD404
                rank=dist.get_rank(),
            )
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch.utils.data import DistributedSampler

            hvd.init()
            local = hvd.local_rank()
            sampler = DistributedSampler(train_set, num_replicas=hvd.local_size(), rank=local)  # expect: DD404
            """
        ),
    )
    valid = (
        Example(
            # The same with a dataset class of the script's own, given the node's head rank.
            """
            import horovod.torch as hvd
            import torch
            from torch.utils.data.distributed import DistributedSampler


            class RankStepDataset(torch.utils.data.Dataset):
                def __init__(self, keys, head_rank):
                    self.keys, self.head_rank = keys, head_rank

                def __len__(self):
                    return len(self.keys)

                def __getitem__(self, idx):
                    return fetch(self.keys[idx], self.head_rank)


            hvd.init()
            dataset = RankStepDataset(node_keys(), node_info()["head_rank"])
            sampler = DistributedSampler(dataset, num_replicas=args.ppn, rank=hvd.local_rank())
            """
        ),
        Example(
            # A dataset built from this node's own data (keys offset by its head rank): sharding it by
            # the local rank is the design.
            """
            import horovod.torch as hvd
            from torch.utils.data.distributed import DistributedSampler

            hvd.init()
            head_rank = node_database_info()["head_rank"]
            dataset = NodeTensorDataset(node_database_keys(), head_rank)
            sampler = DistributedSampler(dataset, num_replicas=hvd.local_size(), rank=hvd.local_rank())
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            hvd.init()
            sampler = torch.utils.data.distributed.DistributedSampler(
                train_set, num_replicas=hvd.size(), rank=hvd.rank())
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch.utils.data import DistributedSampler

            hvd.init()
            # positional num_replicas and rank
            sampler = DistributedSampler(train_set, hvd.size(), hvd.rank(), True)
            """
        ),
        Example(
            """
            import torch.distributed as dist
            import horovod.torch as hvd
            from torch.utils.data import DistributedSampler

            def setup(args):
                if args.backend == "horovod":
                    hvd.init()
                else:
                    dist.init_process_group("nccl")
                return DistributedSampler(train_set)
            """
        ),
        Example(
            """
            from torch.utils.data import DistributedSampler

            # not a Horovod script
            sampler = DistributedSampler(train_set)
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch.utils.data import DistributedSampler

            kwargs = dict(num_replicas=hvd.size(), rank=hvd.rank())
            sampler = DistributedSampler(train_set, **kwargs)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod or ctx.process_group_initialised:
            return
        wanted = {"num_replicas": "num_replicas=hvd.size()", "rank": "rank=hvd.rank()"}
        for trace, step, call in ctx.calls(SAMPLER):
            if any(arg.star for arg in call.args):
                continue  # `**kwargs` may carry them
            given = {name: syntax.argument(call, position, name) for position, name in ((1, "num_replicas"), (2, "rank"))}
            missing = [name for name, expr in given.items() if expr is None]
            if missing:
                yield Report(
                    call,
                    f"DistributedSampler without {' and '.join(missing)} reads them from torch.distributed, "
                    f"which this Horovod script never initialises (RuntimeError at construction). Pass "
                    f"{', '.join(wanted[name] for name in missing)}.",
                )
                continue
            values = {name: trace.value(expr, step) for name, expr in given.items()}
            from_torch = [name for name, value in values.items() if value is not None and value.origin == "dist"]
            per_node = [
                name
                for name, value in values.items()
                if value is not None and value.origin == "hvd" and value.kind in (kinds.LOCAL_RANK, kinds.LOCAL_SIZE)
            ]
            if from_torch:
                yield Report(
                    given[from_torch[0]],
                    f"{' and '.join(from_torch)} come{'s' if len(from_torch) == 1 else ''} from torch.distributed, "
                    f"which this Horovod script never initialises (RuntimeError). Pass "
                    f"{', '.join(wanted[name] for name in from_torch)}.",
                )
            elif per_node and not _built_per_node(ctx, trace, step, syntax.argument(call, 0, "dataset")):
                yield Report(
                    given[per_node[0]],
                    "the sampler is sharded by the local rank and local size: on several nodes, every node "
                    "trains on the same shards. Pass num_replicas=hvd.size(), rank=hvd.rank().",
                )


def _built_per_node(ctx: LintContext, trace: Trace, step: Step, dataset: cst.BaseExpression | None) -> bool:
    """The dataset was built from a rank or node of its own (`RankStepDataset(n, steps,
    head_rank)`, data a node's own database holds): it already differs between nodes, and
    sharding it by the local rank is the design."""
    value = trace.value(dataset, step) if dataset is not None else None
    built = None
    if value is not None:
        built = value.node if isinstance(value.node, cst.Call) else bound_expression(value)
    if not isinstance(built, cst.Call):
        return False
    return any(_PER_NODE_WORD.search(ctx.code(arg.value).lower()) for arg in built.args)


_PER_NODE_WORD = re.compile(r"rank|node|host")
