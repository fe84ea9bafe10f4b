"""DD107 compile-before-ddp: torch.compile applied to the model before the DDP wrap."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, names, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

COMPILE = "torch.compile"
DDP = frameworks.DDP
PASSTHROUGH = frozenset({"to", "cuda", "train", "float", "half", "bfloat16"})


class CompileBeforeDDP(Rule):
    """
    ## What it does
    Flags `torch.compile(model)` whose result is then wrapped in `DistributedDataParallel`
    (directly, through a variable, through a helper's parameter, or as what a builder of the same
    module returns: `DDP(build_model(), ...)` where `build_model` ends in `return torch.compile(m)`).
    Silent when the compile sits in a branch that cannot run: `if use_compile:` where
    `use_compile` is bound to the literal `False` and assigned nowhere else in the file, and in
    a file that turns the DDP graph optimizer off (`torch._dynamo.config.optimize_ddp = False`):
    then neither order splits the graph, and the advice gains nothing.

    ## Why is this bad?
    The PyTorch documentation of DDP with TorchDynamo says to apply the DDP wrapper first and
    compile the wrapped model: DDP's optimizer then splits the compiled graph at the gradient
    bucket boundaries, so all-reduce overlaps with the backward pass. Compiling first works, but
    the wrapper sees an `OptimizedModule` (its state dict keys gain `_orig_mod.`) and the
    compiled graph cannot be split for communication overlap. This is advice (info), not an error.

    ## Example
    ```python
    model = torch.compile(model)
    model = DDP(model, device_ids=[local_rank])
    ```

    ## Use instead
    ```python
    model = DDP(model, device_ids=[local_rank])
    model = torch.compile(model)
    ```

    ## Fix safety
    No autofix: code between the two lines may rely on the compiled module.
    """

    code = "DD107"
    name = "compile-before-ddp"
    severity = "info"
    summary = "torch.compile before the DDP wrap: wrap first, then compile"
    requires = (frameworks.DDP_WORDS, frozenset({"compile"}))

    invalid = (
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = GPT(config).to(device)
            model = torch.compile(model)  # expect: DD107
            model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch
            import torch.nn as nn

            def build(cfg, gpu):
                net = ResNet(cfg).cuda(gpu)
                return nn.parallel.DistributedDataParallel(torch.compile(net, mode="max-autotune"), device_ids=[gpu])  # expect: DD107
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel

            def wrap(m, rank):
                return DistributedDataParallel(m, device_ids=[rank])

            def main(rank):
                compiled = torch.compile(Net()).to(rank)  # expect: DD107
                model = wrap(compiled, rank)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            def build_model(compile_model=True):
                model = Net()
                if compile_model:
                    model = torch.compile(model)  # expect: DD107
                return model
            def main(gpu):
                model = DDP(build_model().cuda(gpu), device_ids=[gpu])
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            use_compile = False
            if args.compile:
                use_compile = True
            model = Net().cuda()
            if use_compile:
                model = torch.compile(model)  # expect: DD107
            model = DDP(model, device_ids=[local_rank])
            """
        ),
    )
    valid = (
        Example(
            # The wrapper is never called: training runs through the plain module (DD102 reports
            # that); there is no DDP graph to split.
            """
            import os

            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP


            def main():
                dist.init_process_group("nccl")
                local_rank = int(os.environ["LOCAL_RANK"])
                torch.cuda.set_device(local_rank)
                model = GPT(config).cuda()
                compiled_model = torch.compile(model)
                wrapped_model = DDP(compiled_model, device_ids=[local_rank])
                raw_model = model
                optimizer = torch.optim.AdamW(wrapped_model.parameters(), lr=3e-4)
                for x, y in batches():
                    _, loss = raw_model(x, targets=y)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()


            if __name__ == "__main__":
                main()
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = torch.compile(build_model().cuda())
            torch._dynamo.config.optimize_ddp = False  # worked around a compiler error
            model = DDP(model, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().to(device), device_ids=[local_rank])
            model = torch.compile(model)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            loss_fn = torch.compile(compute_loss)
            model = DDP(Net().cuda(), device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch

            class DDP:  # a local class, not DistributedDataParallel
                def __init__(self, m):
                    self.m = m

            model = DDP(torch.compile(Net()))
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            # compiling is switched off by a literal on this path: the branch never runs
            enable_compile = False
            net = Net().cuda()
            if enable_compile:
                net = torch.compile(net)
            net = DDP(net, device_ids=[local_rank])
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP
            def build_model():
                model = Net()
                model.loss = torch.compile(model.loss)
                return model
            def main(gpu):
                model = torch.compile(DDP(build_model().cuda(gpu), device_ids=[gpu]))
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        optimizer_off: bool | None = None  # read from the whole tree only once there is a finding
        for trace, step, call in ctx.calls(DDP):
            wrapped = syntax.argument(call, 0, "module")
            if wrapped is None:
                continue
            compiled = _compile_call(ctx, trace, step, wrapped, 0)
            if compiled is None or _dead(ctx, trace, _step_of(trace, compiled)):
                continue
            if _never_called(ctx, call):
                continue  # the training forward goes around the wrapper (DD102's finding): no DDP graph to split
            if optimizer_off is None:
                optimizer_off = _ddp_optimizer_off(ctx)
            if optimizer_off:
                return  # no graph split at bucket boundaries in either order: the advice gains nothing
            yield Report(
                compiled,
                "torch.compile runs before the model is wrapped in DistributedDataParallel: wrap first and compile "
                "the wrapper (`model = torch.compile(DDP(model, ...))`), as the PyTorch docs advise, so DDP can "
                "overlap its all-reduce with the compiled backward.",
            )


# Calls that look at a wrapper without running it.
_INSPECTING = frozenset({"isinstance", "hasattr", "getattr", "type", "id", "print", "len", "str", "repr"})


def _never_called(ctx: LintContext, wrap: cst.Call) -> bool:
    """Whether the wrapper built by `wrap` is never called for a forward in this file and never
    leaves it (passed to a function of another module, returned, stored on an object), while
    the file trains (runs a backward): the model is trained around it, through the plain module."""
    if not ctx.may_call_method("backward"):
        return False  # the training is not in this file: the wrapper may well be used there
    if not isinstance(ctx.parent(wrap), cst.Assign) or any(
        not isinstance(target.target, cst.Name) for target in ctx.parent(wrap).targets
    ):
        return False  # `self.model = DDP(...)`, `return DDP(...)`: used where this cannot follow
    for trace in ctx.traces:
        for step, call in trace.calls():
            value = trace.value(call.func, step)
            if value is not None and value.kind == kinds.DDP and value.node is wrap:
                return False  # a forward through the wrapper
            callee = (names.dotted(call.func) or "").rsplit(".", 1)[-1]
            if callee in ctx.info.functions or callee in _INSPECTING:
                continue
            for arg in call.args:
                held = trace.value(arg.value, step)
                if held is not None and held.kind == kinds.DDP and held.node is wrap:
                    return False  # handed to code this file does not show
        for step in trace.steps:
            if isinstance(step.node, cst.Return) and step.node.value is not None:
                held = trace.value(step.node.value, step)
                if held is not None and held.kind == kinds.DDP and held.node is wrap:
                    return False
    return True


def _step_of(trace: Trace, call: cst.Call) -> Step | None:
    return next((s for s in trace.steps if any(c is call for c in syntax.own_calls(s.node))), None)


def _dead(ctx: LintContext, trace: Trace, step: Step | None) -> bool:
    """Whether `step` sits in a branch that cannot run: `if use_compile:` where `use_compile` is
    bound to the literal `False` on this path and assigned nowhere else in the file (so no loop
    iteration, branch or other call can make it true)."""
    if step is None:
        return False
    for guard in step.guards:
        test, runs_when = guard.test, not guard.negated
        while isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
            test, runs_when = test.expression, not runs_when
        text = names.dotted(test)
        if text is None or not isinstance(test, (cst.Name, cst.Attribute)):
            continue
        if isinstance(test, cst.Name) and test.value in ("True", "False"):
            if (test.value == "True") != runs_when:
                return True
            continue
        found = ctx.binding(trace, step, test)
        if found is None:
            continue
        known, value = syntax.const_value(found[1])
        if known and isinstance(value, bool) and value != runs_when and _assigned_once(ctx, text):
            return True
    return False


def _assigned_once(ctx: LintContext, text: str) -> bool:
    """Whether exactly one statement of the module binds `text` (by any kind of assignment)."""
    count = 0
    for node in ctx.nodes(cst.Assign, cst.AnnAssign, cst.AugAssign, cst.For, cst.WithItem, cst.NamedExpr, cst.Param):
        if isinstance(node, cst.Assign):
            targets = [t.target for t in node.targets]
        elif isinstance(node, cst.For):
            targets = [node.target]
        elif isinstance(node, cst.WithItem):
            targets = [node.asname.name] if node.asname is not None else []
        elif isinstance(node, cst.Param):
            targets = [node.name]
        else:
            targets = [node.target]
        for target in targets:
            for leaf in _leaves(target):
                if names.dotted(leaf) == text:
                    count += 1
    return count == 1


def _leaves(target: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(target, (cst.Tuple, cst.List)):
        return [leaf for element in target.elements for leaf in _leaves(element.value)]
    if isinstance(target, cst.StarredElement):
        return _leaves(target.value)
    return [target]


def _compile_call(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int) -> cst.Call | None:
    """The `torch.compile(...)` call whose result `expr` is, through `.to()`/`.cuda()`, names and
    helper parameters."""
    if depth > 6:
        return None
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in PASSTHROUGH:
        expr = expr.func.value
    if isinstance(expr, cst.Call):
        if ctx.qualname(expr.func) == COMPILE:
            return expr
        # A builder of this module (`wrap(build_model(), gpu)`): what its last `return` gives back.
        returns = [s for s in trace.steps[: step.index] if s.frame.call is expr and isinstance(s.node, cst.Return)]
        if returns and returns[-1].node.value is not None:
            return _compile_call(ctx, trace, returns[-1], returns[-1].node.value, depth + 1)
        return None
    if isinstance(expr, (cst.Name, cst.Attribute)):
        found = ctx.binding(trace, step, expr)
        if found is not None:
            return _compile_call(ctx, trace, found[0], found[1], depth + 1)
    return None


def _ddp_optimizer_off(ctx: LintContext) -> bool:
    """`torch._dynamo.config.optimize_ddp = False` somewhere in the file."""
    for node in ctx.nodes(cst.Assign):
        if not (isinstance(node.value, cst.Name) and node.value.value == "False"):
            continue
        for target in node.targets:
            if ctx.qualname(target.target) == "torch._dynamo.config.optimize_ddp":
                return True
    return False
