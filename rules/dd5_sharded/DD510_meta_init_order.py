"""DD510 meta-init-order: a meta-device model sharded and trained without materialising it."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP2, Key, Sharding

# Methods of a module that neither materialise nor initialise it.
INERT_METHODS = frozenset(
    {
        "parameters", "named_parameters", "buffers", "named_buffers", "modules", "named_modules",
        "children", "named_children", "train", "eval", "state_dict", "forward", "zero_grad",
        "requires_grad_", "register_forward_hook", "register_forward_pre_hook", "to", "cuda",
        "set_requires_gradient_sync", "set_reshard_after_backward", "num_parameters", "get_submodule",
    }
)
REINIT_WORDS = ("init", "reset", "load", "apply")


class MetaInitOrder(Rule):
    """
    ## What it does
    Flags a model built under `with torch.device("meta"):` (or accelerate's
    `init_empty_weights()`), sharded with `fully_shard`, and then trained without
    `model.to_empty(device=...)` followed by a re-initialisation: `reset_parameters()`,
    `init_weights()`, `model.apply(init_fn)`, `reset_parameters()` of each module in a loop over
    `model.modules()`, a loaded state dict (`load_state_dict`,
    `set_model_state_dict`, `dcp.load`). The finding points at the sharding call when
    `to_empty` is missing, and at `to_empty` when nothing initialises the model after it (an
    initialisation that ran *before* `to_empty` touched meta tensors and did nothing).

    It stays silent when both happen before the optimizer's first step, and when the model is
    handed to a function it cannot see into, which may initialise it.

    ## Why is this bad?
    A meta-device model has no storage. `fully_shard` shards the meta parameters (still meta);
    without `to_empty` the first forward fails, and `to_empty` only allocates *uninitialised*
    memory: training then starts from whatever bytes were in that memory, different on every
    rank and every run, typically with NaNs. The FSDP2 recipe (torchtitan, pytorch/examples
    FSDP2) is: build on meta, shard, `to_empty(device=...)`, then initialise or load weights.

    ## Example
    ```python
    with torch.device("meta"):
        model = Transformer(args)
    for block in model.layers:
        fully_shard(block)
    fully_shard(model)
    model.to_empty(device="cuda")
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Use instead
    ```python
    fully_shard(model)
    model.to_empty(device="cuda")
    model.init_weights()          # or load a checkpoint
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Fix safety
    No autofix: how the model initialises itself is model-specific.
    """

    code = "DD510"
    name = "meta-init-order"
    severity = "error"
    summary = "meta-device model sharded and trained without to_empty() and a re-initialisation"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            fully_shard(model)  # expect: DD510
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            def main(loader):
                with torch.device("meta"):
                    model = GPT()
                for block in model.blocks:
                    fully_shard(block)
                fully_shard(model)
                model.to_empty(device="cuda")  # expect: DD510
                optimizer = torch.optim.AdamW(model.parameters())
                for x in loader:
                    model(x).sum().backward()
                    optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.distributed._composable.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            model.init_weights()  # on meta tensors: does nothing
            fully_shard(model)
            model.to_empty(device="cuda")  # expect: DD510
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            fully_shard(model)
            model.to_empty(device="cuda")
            for module in model.modules():
                if hasattr(module, "reset_parameters"):
                    module.reset_parameters()
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            fully_shard(model)
            model.to_empty(device="cuda")
            model.init_weights()
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            import torch.distributed.checkpoint as dcp
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            fully_shard(model)
            model.to_empty(device="cuda")
            dcp.load({"model": model.state_dict()}, checkpoint_id=path)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            with torch.device("meta"):
                model = Transformer()
            fully_shard(model)
            materialize(model)  # cannot see what it does
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            with torch.device("cuda"):
                model = Transformer()
            fully_shard(model)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP2):
            return
        for trace in ctx.traces:
            for built, key in _meta_models(ctx, sharding, trace):
                events = [e for e in sharding.events_on(trace, key, FSDP2) if e.step.index > built.index]
                if not events:
                    continue
                yield from _check_model(ctx, sharding, trace, built, key, events[-1])


def _meta_models(ctx: LintContext, sharding: Sharding, trace: Trace) -> Iterator[tuple[Step, Key]]:
    """(step, object) for each assignment made inside `with torch.device("meta")`."""
    for step in trace.steps:
        node = step.node
        if not isinstance(node, cst.With) or not any(_is_meta(ctx, item.item) for item in node.items):
            continue
        for inner in trace.steps[step.index + 1 :]:
            if not _inside(ctx, inner.node, node):
                if inner.frame is step.frame:
                    break
                continue
            if isinstance(inner.node, cst.Assign) and len(inner.node.targets) == 1:
                key = sharding.key_after(trace, inner, inner.node.targets[0].target)
                if key is not None:
                    yield inner, key


def _is_meta(ctx: LintContext, expr: cst.BaseExpression) -> bool:
    if not isinstance(expr, cst.Call):
        return False
    qual = ctx.qualname(expr.func) or ""
    if qual.endswith("init_empty_weights"):
        return True
    if qual == "torch.device" and expr.args:
        value = expr.args[0].value
        return isinstance(value, cst.SimpleString) and value.evaluated_value == "meta"
    return False


def _inside(ctx: LintContext, node: cst.CSTNode, ancestor: cst.CSTNode) -> bool:
    current: cst.CSTNode | None = node
    while current is not None:
        if current is ancestor:
            return True
        current = ctx.parent(current)
    return False


def _check_model(ctx, sharding: Sharding, trace: Trace, built: Step, key: Key, event) -> Iterator:
    first_step = _first_optimizer_step(trace, event.step.index)
    to_empty: cst.Call | None = None
    for step in trace.steps[built.index + 1 : first_step]:
        for call in syntax.own_calls(step.node):
            func = call.func
            receiver = func.value if isinstance(func, cst.Attribute) else None
            on_model = receiver is not None and sharding.key(trace, step, receiver) in (key, *event.keys)
            method = func.attr.value if isinstance(func, cst.Attribute) else ""
            if on_model and method == "to_empty":
                to_empty = call
                continue
            reinit = on_model and any(word in method.lower() for word in REINIT_WORDS)
            if not on_model and receiver is not None and any(word in method.lower() for word in REINIT_WORDS):
                # `for m in model.modules(): m.reset_parameters()`: the model's submodules.
                reinit = _in_loop_over_model(sharding, trace, step, key, event)
            if not on_model and _passes_model(sharding, trace, step, call, key, event):
                name = (dotted(func) or "").rsplit(".", 1)[-1].lower()
                qual = ctx.qualname(func) or ""
                if any(word in name for word in REINIT_WORDS):
                    reinit = True
                elif not qual.startswith("torch.") and not _known_module_function(ctx, func):
                    return  # handed to code we cannot see: it may initialise the model
            elif on_model and method not in INERT_METHODS and method != "to_empty" and not reinit and not isinstance(func, cst.Name):
                return  # a method of the model's own: it may initialise it
            if reinit and to_empty is not None:
                return
    if to_empty is None:
        yield Report(
            event.call,
            f"the model was built on the meta device (line {ctx.position(built.node).start.line}) and is sharded here, "
            f"but never materialised: call `model.to_empty(device=...)` after fully_shard() and then initialise it "
            f"(`init_weights()`/`reset_parameters()`) or load a checkpoint, before the first optimizer step.",
        )
    else:
        yield Report(
            to_empty,
            "to_empty() allocates uninitialised memory, and nothing initialises the model after it (an "
            "initialisation before to_empty() ran on meta tensors and did nothing): call `init_weights()` / "
            "`reset_parameters()` or load a checkpoint after this line, before the first optimizer step.",
        )


def _in_loop_over_model(sharding: Sharding, trace: Trace, step: Step, key: Key, event) -> bool:
    for loop in step.loops:
        if not isinstance(loop, cst.For):
            continue
        loop_step = next((s for s in reversed(trace.steps[: step.index]) if s.node is loop), None)
        if loop_step is None:
            continue
        for sub in syntax.walk(loop.iter):
            if isinstance(sub, (cst.Name, cst.Attribute)) and sharding.key(trace, loop_step, sub) in (key, *event.keys):
                return True
    return False


def _passes_model(sharding: Sharding, trace: Trace, step: Step, call: cst.Call, key: Key, event) -> bool:
    for arg in call.args:
        for sub in syntax.walk(arg.value):
            if isinstance(sub, (cst.Name, cst.Attribute)) and sharding.key(trace, step, sub) in (key, *event.keys):
                return True
    return False


def _known_module_function(ctx: LintContext, func: cst.BaseExpression) -> bool:
    """Builtins that only read the model (len, isinstance, print...)."""
    return isinstance(func, cst.Name) and func.value in ("len", "isinstance", "print", "sum", "list", "id", "type", "str", "repr", "hasattr", "getattr")


def _first_optimizer_step(trace: Trace, after: int) -> int:
    for step in trace.steps[after + 1 :]:
        for call in syntax.own_calls(step.node):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "step":
                value = trace.value(call.func.value, step)
                if value is not None and value.kind == kinds.OPTIMIZER:
                    return step.index
    return len(trace.steps)
