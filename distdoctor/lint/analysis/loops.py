"""The role of each loop on a trace: training, evaluation, or search.

A loop *trains* when a `backward()` runs in it (in its body, or in a helper it calls). A loop
that builds a new optimizer or DDP wrapper on every iteration, outside the loops that run the
backward passes, is a *search* (a hyperparameter sweep, k-fold runs, repeated seeds): the
training loops are inside it, and what it runs around them (a `print` of the trial's result) is
not training progress. A loop with no backward that draws from an evaluation loader, or runs
with autograd off, *evaluates*.
"""

from __future__ import annotations

import libcst as cst

from distdoctor.lint.analysis import kinds
from distdoctor.lint.analysis.loaders import drawn_from, says_eval
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.trace import Trace

TRAINING = "training"
EVALUATION = "evaluation"
SEARCH = "search"

_BUILT_PER_RUN = (kinds.OPTIMIZER, kinds.HVD_OPTIMIZER, kinds.DDP)


def loop_roles(ctx, trace: Trace) -> dict[int, str]:
    """id(loop) -> TRAINING, EVALUATION or SEARCH for the loops of `trace` that have one."""
    backward_loops: set[int] = set()
    backward_steps = []
    for step, call in trace.calls():
        if ctx.is_backward(call):
            backward_loops.update(id(loop) for loop in step.loops)
            backward_steps.append(step)
    builds = [
        step
        for step, call in trace.calls()
        if step.loops and _builds(trace, step, call)
    ]
    roles: dict[int, str] = {}
    for step in trace.steps:
        loop = step.node
        if not isinstance(loop, (cst.For, cst.While)):
            continue
        if id(loop) in backward_loops:
            roles[id(loop)] = SEARCH if _rebuilds_per_iteration(loop, backward_steps, builds, backward_loops) else TRAINING
        elif _evaluates(ctx, trace, step, loop):
            roles[id(loop)] = EVALUATION
    return roles


def _builds(trace: Trace, step, call: cst.Call) -> bool:
    """`torch.optim.SGD(...)`, `DDP(...)`: a call that makes a new optimizer or wrapper (not
    `model.train()`, which hands back the wrapper it was called on)."""
    value = trace.value(call, step)
    return value is not None and value.kind in _BUILT_PER_RUN and value.node is call


def _rebuilds_per_iteration(loop, backward_steps, builds, backward_loops: set[int]) -> bool:
    """Every backward pass of `loop` runs in a loop nested in it, and an optimizer or DDP wrapper
    is built in `loop` outside those nested training loops: one training run per iteration."""
    inner_only = all(
        any(id(nested) in backward_loops for nested in step.loops[step.loops.index(loop) + 1 :])
        for step in backward_steps
        if step.in_loop(loop)
    )
    if not inner_only:
        return False
    for build in builds:
        if not build.in_loop(loop):
            continue
        deeper = build.loops[build.loops.index(loop) + 1 :]
        if not any(id(nested) in backward_loops for nested in deeper):
            return True
    return False


def _evaluates(ctx, trace: Trace, step, loop) -> bool:
    if ctx.grad_disabled(step):
        return True
    if isinstance(loop, cst.For):
        return any(says_eval((dotted(expr) or "").rsplit(".", 1)[-1]) for expr in drawn_from(loop.iter))
    return False


def training_loops(ctx, trace: Trace) -> set[int]:
    """id() of the loops of `trace` that train (a search loop around them does not)."""
    return {loop for loop, role in ctx.loop_roles(trace).items() if role == TRAINING}
