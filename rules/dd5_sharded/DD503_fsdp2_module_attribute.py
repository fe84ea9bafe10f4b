"""DD503 fsdp2-module-attribute: `.module` read on an FSDP2 model, which is not a wrapper."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP2, type_checked


class FSDP2ModuleAttribute(Rule):
    """
    ## What it does
    Flags `model.module` where `model` was sharded in place by FSDP2's `fully_shard` earlier on
    the code path (`model.module(x)`, `model.module.state_dict()`, `model.module.config`).

    It stays silent on FSDP (v1) and DDP wrappers, which do have `.module`, and where the code
    checks first (`model.module if hasattr(model, "module") else model`, an enclosing
    `if hasattr(...)` / `if isinstance(...)`).

    ## Why is this bad?
    `fully_shard(model)` does not wrap the model: it changes the class of the same object in
    place and returns it. There is no `.module`, so the line raises `AttributeError` — after the
    whole training, when it sits in the final save. When the model has an attribute of its own
    called `module`, it silently returns that submodule instead of the model: the checkpoint or
    the evaluation covers part of the network.

    ## Example
    ```python
    fully_shard(model)
    ...
    torch.save(model.module.state_dict(), "final.pt")
    ```

    ## Use instead
    ```python
    fully_shard(model)
    ...
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if rank == 0:
        torch.save(state, "final.pt")
    ```

    ## Fix safety
    No autofix: code that unwraps usually needs a different API under FSDP2, not just a shorter
    attribute chain.
    """

    code = "DD503"
    name = "fsdp2-module-attribute"
    severity = "error"
    summary = "`.module` on a model sharded with fully_shard(), which is not a wrapper"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            config = model.module.config  # expect: DD503
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            class Runner:
                def __init__(self, model):
                    for block in model.blocks:
                        fully_shard(block)
                    self.model = fully_shard(model)

                def evaluate(self, batch):
                    with torch.no_grad():
                        return self.model.module(batch)  # expect: DD503
            """
        ),
        Example(
            """
            import torch
            import torch.distributed._composable.fsdp as fsdp2

            def main(net):
                net = fsdp2.fully_shard(net)
                train(net)
                torch.save(net.module.state_dict(), "final.pt")  # expect: DD503
            """
        ),
    )
    valid = (
        Example(
            """
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model)
            config = model.module.config
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            unwrapped = model.module if hasattr(model, "module") else model
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard
            from torch.nn.parallel import DistributedDataParallel as DDP

            def build(model, use_fsdp):
                if use_fsdp:
                    fully_shard(model)
                else:
                    model = DDP(model)
                return model

            config = model.module.config  # before any sharding
            fully_shard(other)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            if isinstance(model, torch.nn.parallel.DistributedDataParallel):
                model = model.module
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP2):
            return
        reported: set[int] = set()
        for trace in ctx.traces:
            for step in trace.steps:
                for attr in _module_reads(step):
                    if id(attr) in reported or type_checked(ctx, step, attr):
                        continue
                    event = sharding.in_place_sharded(trace, step, attr.value, FSDP2)
                    if event is None:
                        continue
                    reported.add(id(attr))
                    line = ctx.position(event.call).start.line
                    yield Report(
                        attr,
                        f"`{ctx.code(attr)}`: the model was sharded in place by fully_shard() (line {line}), which "
                        f"returns the same module, not a wrapper: there is no `.module` (AttributeError, or the "
                        f"model's own submodule of that name). Use the model itself.",
                    )


def _header(node: cst.CSTNode) -> list[cst.CSTNode]:
    if isinstance(node, (cst.If, cst.While)):
        return [node.test]
    if isinstance(node, cst.For):
        return [node.iter]
    if isinstance(node, cst.With):
        return list(node.items)
    if isinstance(node, (cst.Try, cst.TryStar, cst.FunctionDef, cst.ClassDef, cst.Match)):
        return []
    return [node]


def _module_reads(step: Step) -> Iterator[cst.Attribute]:
    """`x.module` reads in the statement (not `x.module = ...`, which writes)."""
    for part in _header(step.node):
        yield from _reads(part)


def _reads(node: cst.CSTNode) -> Iterator[cst.Attribute]:
    if isinstance(node, cst.Lambda):
        return
    if isinstance(node, cst.Assign):
        for target in node.targets:
            if isinstance(target.target, cst.Attribute) and target.target.attr.value == "module":
                yield from _reads(target.target.value)  # `x.module = ...` writes, it does not read
            else:
                yield from _reads(target.target)
        yield from _reads(node.value)
        return
    if isinstance(node, cst.Attribute) and node.attr.value == "module":
        yield node
    for name in syntax._code_fields(type(node)):
        value = getattr(node, name)
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, cst.CSTNode):
                yield from _reads(item)

