"""DD409 hvd-backward-passes-mismatch: backward_passes_per_step differs from the loop's
accumulation."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule


class HorovodBackwardPassesMismatch(Rule):
    """
    ## What it does
    Flags `hvd.DistributedOptimizer(..., backward_passes_per_step=k)` (1 when not given) when the
    training loop calls `step()` once every m backward passes, m != k, both known from the code:
    `for _ in range(m): loss.backward()` before the step, `if (i + 1) % m == 0: optimizer.step()`,
    or backward and step once per iteration (m = 1).

    ## Why is this bad?
    Horovod counts backward passes per parameter and starts the allreduce of a gradient after the
    k-th one. With k smaller than the loop's accumulation (for example the default 1 with four
    micro-batches per step), the second backward pass before `step()` fails with "Gradients were
    computed more than backward_passes_per_step times before call to step()". With k larger than
    the accumulation, the allreduce never starts in the background: `step()` must reduce every
    gradient itself, and the overlap of communication with the backward pass is lost.

    Nothing is reported when either number comes from the command line or a computation the
    linter cannot evaluate, or when `set_backward_passes_per_step()` changes it later.

    ## Example
    ```python
    optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=1)
    for i, (x, y) in enumerate(loader):
        loss_fn(model(x), y).backward()
        if (i + 1) % 4 == 0:
            optimizer.step()
            optimizer.zero_grad()
    ```

    ## Use instead
    ```python
    optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=4)
    ```

    ## Fix safety
    No fix: whether the loop or the optimizer holds the intended number is for the author to say.
    """

    code = "DD409"
    name = "hvd-backward-passes-mismatch"
    severity = "warning"
    summary = "backward_passes_per_step differs from the number of backward passes per step()"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import horovod.torch as hvd

            ACCUM = 4
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # expect: DD409
            for epoch in range(10):
                for i, (x, y) in enumerate(loader):
                    loss = criterion(model(x), y) / ACCUM
                    loss.backward()
                    if (i + 1) % ACCUM == 0:
                        optimizer.step()
                        optimizer.zero_grad()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            opt = hvd.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1 * hvd.size()),
                backward_passes_per_step=4,  # expect: DD409
            )
            for x, y in loader:
                opt.zero_grad()
                loss_fn(model(x), y).backward()
                opt.step()
            """
        ),
        Example(
            """
            import torch
            from horovod import torch as hvd

            class Trainer:
                def __init__(self, model):
                    self.model = model
                    base = torch.optim.Adam(model.parameters())
                    self.opt = hvd.DistributedOptimizer(base, backward_passes_per_step=2)  # expect: DD409

                def train_step(self, batch):
                    self.opt.zero_grad()
                    for chunk in range(4):
                        self.model(batch[chunk]).sum().backward()
                    self.opt.step()

                def fit(self, loader):
                    for batch in loader:
                        self.train_step(batch)
            """
        ),
    )
    valid = (
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=4)
            for i, (x, y) in enumerate(loader):
                loss = criterion(model(x), y)
                loss.backward()
                if (i + 1) % 4 == 0:
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            # Horovod's ImageNet example: both numbers come from the command line.
            optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=args.batches_per_allreduce)
            for batch_idx, (data, target) in enumerate(train_loader):
                optimizer.zero_grad()
                for i in range(0, len(data), args.batch_size):
                    loss = F.cross_entropy(model(data[i:i + args.batch_size]), target[i:i + args.batch_size])
                    loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                if use_amp:
                    scaler.scale(loss).backward()
                else:
                    loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=2)
            optimizer.set_backward_passes_per_step(1)
            for x, y in loader:
                criterion(model(x), y).backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer, backward_passes_per_step=2)
            for x, y in loader:
                for micro in range(2):
                    criterion(model(x[micro]), y[micro]).backward()
                optimizer.step()
                optimizer.zero_grad()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod:
            return
        if any(True for _ in ctx.method_calls("set_backward_passes_per_step")):
            return
        periods: dict[int, tuple[cst.Call, set[int | None]]] = {}
        for trace in ctx.traces:
            for step, call in trace.calls():
                optimizer = ctx.stepped_optimizer(trace, step, call)
                if optimizer is None or optimizer.kind != kinds.HVD_OPTIMIZER or not isinstance(optimizer.node, cst.Call):
                    continue
                if not step.loops:
                    continue  # a step function traced on its own; its callers' traces count it
                entry = periods.setdefault(id(optimizer.node), (optimizer.node, set()))
                entry[1].add(backward_passes_per_step(ctx, trace, step))
        for wrap, found in periods.values():
            if len(found) != 1 or None in found:
                continue  # several loops, or one the linter cannot count: stay silent
            actual = next(iter(found))
            declared, where = _declared_passes(ctx, wrap)
            if declared is None or actual is None or declared == actual:
                continue
            yield Report(
                where,
                f"backward_passes_per_step is {declared}, but the training loop runs {actual} backward "
                f"pass{'es' if actual != 1 else ''} per optimizer step: pass `backward_passes_per_step={actual}` "
                f"(or change the loop) so Horovod allreduces once per step.",
            )


def _declared_passes(ctx: LintContext, wrap: cst.Call) -> tuple[int | None, cst.CSTNode]:
    given = syntax.keyword(wrap, "backward_passes_per_step")
    if given is None:
        positional = [arg for arg in wrap.args if arg.keyword is None and not arg.star]
        if len(positional) > 3 or any(arg.star for arg in wrap.args):
            return None, wrap  # passed by position or through **kwargs: not worth guessing
        return 1, wrap
    for trace in ctx.traces:
        for step, call in trace.calls():
            if call is wrap:
                value = trace.value(given, step)
                if value is not None and value.kind == kinds.CONST and isinstance(value.attrs.get("value"), int):
                    return value.attrs["value"], given
                return None, given
    return None, given


def backward_passes_per_step(ctx: LintContext, trace: Trace, step: Step) -> int | None:
    """How many backward passes run for each execution of the optimizer step at `step`,
    when statically known: backward and step once per iteration of the same loop (1), the
    step under `if (i + 1) % k == 0` (k), the backward inside `for _ in range(k)` nested in
    the step's loop (k), several unconditional backward calls per iteration (their number),
    or `if amp: scaler.scale(loss).backward() else: loss.backward()` (1). None otherwise."""
    if not step.loops:
        return None
    loop = step.loops[-1]
    step_guards = {(id(g.test), g.negated) for g in step.guards}
    passes: list[tuple[int, tuple[tuple[int, bool], ...], set[tuple[int, bool]]]] = []
    updates = 0
    for other in trace.steps:
        if not other.in_loop(loop):
            continue
        for call in syntax.own_calls(other.node):
            if isinstance(call.func, cst.Attribute) and call.func.attr.value == "step" and ctx.stepped_optimizer(trace, other, call) is not None:
                updates += 1
            if not ctx.is_backward(call):
                continue
            inner = other.loops[other.loops.index(loop) + 1 :]
            count = 1
            for nested in inner:
                times = _static_range_length(trace, other, nested)
                if times is None or step.in_loop(nested):
                    return None
                count *= times
            extra = tuple((id(g.test), g.negated) for g in other.guards if (id(g.test), g.negated) not in step_guards)
            passes.append((count, extra, {(id(g.test), g.negated) for g in other.guards}))
    if not passes or updates != 1:
        return None
    unconditional = [count for count, extra, _ in passes if not extra]
    conditional = [(count, extra) for count, extra, _ in passes if extra]
    if conditional:
        # One if/else pair choosing between two spellings of the same backward pass.
        if unconditional or len(conditional) != 2:
            return None
        (c1, e1), (c2, e2) = conditional
        if not (len(e1) == len(e2) == 1 and e1[0][0] == e2[0][0] and e1[0][1] != e2[0][1] and c1 == c2):
            return None
        per_iteration = c1
    else:
        per_iteration = sum(unconditional)
    # Conditions on the step that not every backward pass shares: `if (i + 1) % k == 0`.
    shared = set.intersection(*(guards for _, _, guards in passes))
    step_only = [g for g in step.guards if (id(g.test), g.negated) not in shared]
    if not step_only:
        return per_iteration
    if len(step_only) != 1 or step_only[0].negated:
        return None
    period = _modulo_period(trace, step, step_only[0].test)
    return None if period is None else period * per_iteration


def _static_int(trace: Trace, step: Step, expr: cst.BaseExpression) -> int | None:
    value = trace.value(expr, step)
    if value is None or value.kind != kinds.CONST:
        return None
    number = value.attrs.get("value")
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _static_range_length(trace: Trace, step: Step, loop: cst.CSTNode) -> int | None:
    """The number of iterations of `for _ in range(k)` / `range(a, b)` with known bounds."""
    if not (isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call) and dotted(loop.iter.func) == "range"):
        return None
    args = [arg.value for arg in loop.iter.args if arg.keyword is None and not arg.star]
    if not 1 <= len(args) <= 2 or len(args) != len(loop.iter.args):
        return None
    bounds = [_static_int(trace, step, arg) for arg in args]
    if any(bound is None for bound in bounds):
        return None
    start, stop = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    return max(0, stop - start)


def _modulo_period(trace: Trace, step: Step, test: cst.BaseExpression) -> int | None:
    """k for `(i + 1) % k == 0`, `not i % k`, `... % k == 0 or last_batch`, with k known."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        periods = [p for p in (_modulo_period(trace, step, test.left), _modulo_period(trace, step, test.right)) if p is not None]
        return periods[0] if len(periods) == 1 else None
    modulo: cst.BaseExpression | None = None
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        modulo = test.expression
    elif isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal):
        # `(i + 1) % k == 0`, `i % k == k - 1`: once every k iterations, whatever the remainder.
        left, right = test.left, test.comparisons[0].comparator
        if _static_int(trace, step, left) is not None:
            left, right = right, left
        if _static_int(trace, step, right) is not None:
            modulo = left
    if not (isinstance(modulo, cst.BinaryOperation) and isinstance(modulo.operator, cst.Modulo)):
        return None
    period = _static_int(trace, step, modulo.right)
    return period if period is not None and period > 0 else None
