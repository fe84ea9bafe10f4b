"""DD409 hvd-backward-passes-mismatch: backward_passes_per_step differs from the loop's
accumulation."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import kinds, syntax
from distdoctor.lint.analysis.context import LintContext
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
                entry[1].add(ctx.backward_passes_per_step(trace, step))
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
