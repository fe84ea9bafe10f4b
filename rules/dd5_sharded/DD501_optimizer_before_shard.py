"""DD501 optimizer-before-shard: an optimizer built on a model's parameters before FSDP shards it."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.trace import Trace
from distdoctor.lint.analysis.sharding import FSDP1, FSDP2, TP, Key, ShardEvent, Sharding, line_to_change


class OptimizerBeforeShard(Rule):
    """
    ## What it does
    Flags an optimizer (`torch.optim.AdamW(model.parameters(), ...)`, with param groups,
    `filter(...)` or a comprehension over the parameters) created before `fully_shard(model)`
    (FSDP2), `FullyShardedDataParallel(model)` (FSDP) or `parallelize_module(model, ...)` (tensor
    parallelism) shards that model, when no optimizer over the model is created again after the
    last sharding call.

    When the optimizer is built in a helper, the finding points at the call to that helper (the
    line to move). It stays silent when the optimizer is built after the sharding, when FSDP is asked for
    `use_orig_params=True` (the original parameters stay the optimizer's), and when it cannot tell
    which model the parameters belong to.

    ## Why is this bad?
    Sharding replaces the module's parameters: FSDP2 and tensor parallelism swap each one for a
    new `DTensor` parameter, FSDP flattens them into `FlatParameter`s. An optimizer built before holds the old, unsharded
    tensors: `optimizer.step()` updates tensors the model no longer uses (or that were freed), so
    the model never learns, and the full-size copies waste memory on every rank. The FSDP and
    FSDP2 documentation both create the optimizer after sharding.

    ## Example
    ```python
    model = Transformer(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Use instead
    ```python
    model = Transformer(args)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ```

    ## Fix safety
    No autofix: the optimizer's construction may depend on values computed in between.
    """

    code = "DD501"
    name = "optimizer-before-shard"
    severity = "error"
    summary = "optimizer created on the parameters before fully_shard()/FSDP() sharded the model"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            optimizer = torch.optim.AdamW(model.parameters())  # expect: DD501
            model = parallelize_module(model, mesh, {"fc": ColwiseParallel()})
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)  # expect: DD501
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def main(net, local_rank):
                params = [p for p in net.parameters() if p.requires_grad]
                opt = torch.optim.SGD(params, lr=0.1)  # expect: DD501
                net = FSDP(net, device_id=local_rank)
                return net, opt
            """
        ),
        Example(
            """
            import torch.optim as optim
            from torch.distributed._composable.fsdp import fully_shard

            class Trainer:
                def __init__(self, model):
                    self.model = model
                    self.optimizer = optim.Adam([{"params": self.model.parameters(), "lr": 1e-4}])  # expect: DD501
                    self.model = fully_shard(self.model)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed import fsdp

            def build(model):
                for block in model.blocks:
                    fsdp.fully_shard(block)
                fsdp.fully_shard(model)
                return model

            model = GPT()
            optimizer = torch.optim.AdamW(model.parameters())  # expect: DD501
            model = build(model)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            def make_optimizer(model):
                return torch.optim.AdamW(model.parameters(), lr=1e-4)

            def main(model):
                optimizer = make_optimizer(model)  # expect: DD501
                fully_shard(model)
                return optimizer
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

            model = parallelize_module(model, mesh, {"fc": ColwiseParallel()})
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            for layer in model.layers:
                fully_shard(layer)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = Net()
            optimizer = torch.optim.AdamW(model.parameters())
            model = FSDP(model, use_orig_params=True)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            optimizer = torch.optim.AdamW(model.parameters())  # a first one, replaced below
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            teacher = Net()
            student = Net()
            optimizer = torch.optim.AdamW(student.parameters())
            fully_shard(teacher)  # a different model
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = Net()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            model = DDP(model)  # DDP keeps the parameters: fine
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP1, FSDP2, TP):
            return
        optimizers = list(sharding.optimizers())
        for trace, step, call in optimizers:
            params = syntax.argument(call, 0, "params")
            if params is None:
                continue
            for key, _ in sharding.params_owners(trace, step, params):
                later = [
                    event
                    for event in sharding.events_on(trace, key, FSDP1, FSDP2, TP)
                    if event.step.index > step.index and not _keeps_params(ctx, event)
                ]
                if not later:
                    continue
                last = later[-1]
                if _rebuilt_after(sharding, optimizers, trace, last, key):
                    continue
                what = {FSDP2: "fully_shard()", FSDP1: "FullyShardedDataParallel()", TP: "parallelize_module()"}[last.kind]
                line = ctx.position(last.call).start.line
                yield Report(
                    line_to_change(ctx, trace, step, call, last.step),
                    f"the optimizer is built from the parameters before {what} shards the model (line {line}): it "
                    f"keeps the unsharded tensors, so its steps never reach the sharded parameters. Create the "
                    f"optimizer after line {line}, from the sharded model's parameters.",
                )
                break


def _keeps_params(ctx: LintContext, event: ShardEvent) -> bool:
    """FSDP(..., use_orig_params=True) keeps the original parameter objects in use (a computed
    value may be True: silent too)."""
    if event.kind != FSDP1:
        return False
    value = syntax.keyword(event.call, "use_orig_params")
    return value is not None and not (isinstance(value, cst.Name) and value.value == "False")


def _rebuilt_after(sharding: Sharding, optimizers: list, trace: Trace, event: ShardEvent, key: Key) -> bool:
    """Whether an optimizer over the same model is created after the last sharding call (for
    FSDP1 also over the wrapper)."""
    for other_trace, step, call in optimizers:
        if other_trace is not trace or step.index <= event.step.index:
            continue
        params = syntax.argument(call, 0, "params")
        if params is None:
            continue
        for owner, _ in sharding.params_owners(trace, step, params):
            if owner == key or event.holds(owner) or owner == event.wrapper_key:
                return True
    return False
