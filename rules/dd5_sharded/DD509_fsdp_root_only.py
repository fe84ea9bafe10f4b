"""DD509 fsdp-root-only: fully_shard applied to the root module only."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import syntax
from distdoctor.lint.analysis.names import dotted

from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP2, TP, is_fully_shard


class FSDPRootOnly(Rule):
    """
    ## What it does
    Flags a script whose only `fully_shard(...)` call shards the whole model, once, outside any
    loop: no transformer block, layer or other submodule gets its own `fully_shard` first.

    It stays silent when any other `fully_shard` call exists in the file (per-block sharding in
    a loop, in a helper, over `model.modules()`), when the only call sits in a loop, in a
    function called from one or in a function that recurses over submodules, and when the model
    is also split by tensor parallelism (`parallelize_module`), where each block is already
    divided across ranks (the 2-D example in pytorch/examples shards the root only). Default
    off: it is advice about speed and memory, not a bug.

    ## Why is this bad?
    Each `fully_shard` call makes one communication group: its parameters are all-gathered
    together before its forward and reduce-scattered together after its backward. With the root
    as the only group, the whole model is gathered at once — peak memory as without sharding —
    and no communication overlaps computation. The FSDP2 documentation and torchtitan shard each
    transformer block, then the root.

    ## Example
    ```python
    model = Transformer(args)
    fully_shard(model)
    ```

    ## Use instead
    ```python
    model = Transformer(args)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    ```

    ## Fix safety
    No autofix: which submodules to shard depends on the model.
    """

    code = "DD509"
    name = "fsdp-root-only"
    severity = "info"
    default_on = False
    summary = "fully_shard() on the root module only: no per-block sharding, no overlap"
    requires = (frozenset({"fully_shard"}),)

    invalid = (
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            fully_shard(model)  # expect: DD509
            """
        ),
        Example(
            """
            import torch.distributed.fsdp as fsdp

            def main(net, mesh):
                net = fsdp.fully_shard(net, mesh=mesh)  # expect: DD509
                return net
            """
        ),
        Example(
            """
            from torch.distributed._composable.fsdp import fully_shard, MixedPrecisionPolicy

            class Trainer:
                def __init__(self, model):
                    self.model = fully_shard(model, mp_policy=MixedPrecisionPolicy())  # expect: DD509
            """
        ),
    )
    valid = (
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            for block in model.layers:
                fully_shard(block)
            fully_shard(model)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            def shard(module):
                fully_shard(module)

            for block in model.layers:
                shard(block)
            shard(model)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            for module in model.modules():
                if isinstance(module, Block):
                    fully_shard(module)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            def shard_tree(module):
                for child in module.children():
                    shard_tree(child)
                if is_block(module):
                    fully_shard(module)

            shard_tree(model)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.tensor.parallel import parallelize_module

            model = parallelize_module(model, tp_mesh, plan)
            model = fully_shard(model, mesh=dp_mesh)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        calls = [node for node in ctx.nodes(cst.Call) if is_fully_shard(ctx.qualname(node.func))]
        if len(calls) != 1:
            return
        events = [e for e in ctx.sharding.events if e.kind == FSDP2 and e.call is calls[0]]
        if not events or any(e.step.loops for e in events) or _recursive(ctx, calls[0]):
            return
        if any(ctx.sharding.events_on(e.trace, key, TP) for e in events for key in e.keys):
            return  # tensor parallelism already splits each block across ranks
        yield Report(
            calls[0],
            "fully_shard() is applied to the root module only: the whole model is all-gathered at once (peak "
            "memory as without sharding) and communication never overlaps compute. Call fully_shard() on each "
            "block first (`for block in model.layers: fully_shard(block)`), then on the root.",
        )


def _recursive(ctx: LintContext, call: cst.Call) -> bool:
    """Whether the call sits in a function that calls itself (a walk over `module.children()`
    that shards every level)."""
    node: cst.CSTNode | None = call
    while node is not None and not isinstance(node, cst.FunctionDef):
        node = ctx.parent(node)
    if node is None:
        return False
    name = node.name.value
    return any(
        isinstance(sub, cst.Call) and (dotted(sub.func) or "").rsplit(".", 1)[-1] == name
        for sub in syntax.walk(node.body)
    )
