"""Which loops draw batches from which `DataLoader`, and whether those loops train.

Data-loading rules ask the same two questions: which loader a loop iterates (through
`enumerate`, `tqdm`, `zip`, `iter`/`next`, a logger's `log_every(loader)`), and whether that loop
trains (calls `backward()` in its body, directly or in a helper it runs) or only evaluates.
Answered here once, along the traces.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.names import dotted

EVAL_WORDS = frozenset(
    {
        "val", "valid", "validation", "eval", "evaluation", "evaluate", "test", "testing", "dev", "holdout", "calib",
        "calibration", "pred", "predict", "prediction", "inference", "infer",
    }
)
# Calls whose result is consumed like the loader they wrap.
WRAPPERS = frozenset({"enumerate", "tqdm", "iter", "zip", "islice", "cycle", "next", "trange", "track"})
MAX_DEPTH = 4


@dataclass(frozen=True)
class LoaderLoop:
    """A loop step that draws from a loader: the expression it iterates, the loader, and
    whether the loop calls backward()."""

    trace: Trace
    step: Step
    iterated: cst.BaseExpression
    loader: Value
    trains: bool


def loader_loops(ctx) -> Iterator[LoaderLoop]:
    """Loops drawing from a `DataLoader`: `for b in loader`, `for i, b in enumerate(tqdm(loader))`,
    `it = iter(loader)` ... `next(it)` inside a loop."""
    if not ctx.may_call(*frameworks.LOADER_QUALS):
        return  # a loader value comes from a DataLoader(...) call
    for trace in ctx.traces:
        training = loops_with_backward(trace)
        for step in trace.steps:
            if isinstance(step.node, cst.For):
                for iterated in drawn_from(step.node.iter):
                    loader = loader_value(trace, step, iterated)
                    if loader is not None:
                        yield LoaderLoop(trace, step, iterated, loader, id(step.node) in training)
            elif step.loops:
                for call in syntax.own_calls(step.node):
                    if isinstance(call.func, cst.Name) and call.func.value == "next" and call.args:
                        for iterated in drawn_from(call.args[0].value):
                            loader = loader_value(trace, step, iterated)
                            if loader is not None:
                                trains = any(id(loop) in training for loop in step.loops)
                                yield LoaderLoop(trace, step, iterated, loader, trains)


def loops_with_backward(trace: Trace) -> set[int]:
    """id() of every loop whose body (or a helper it runs) calls `.backward()`."""
    loops: set[int] = set()
    for step, call in trace.calls():
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "backward":
            loops.update(id(loop) for loop in step.loops)
    return loops


def drawn_from(expr: cst.BaseExpression) -> Iterator[cst.BaseExpression]:
    """The expressions a loop draws batches from, looking through enumerate/tqdm/zip/iter."""
    if isinstance(expr, cst.Call):
        name = (dotted(expr.func) or "").rsplit(".", 1)[-1]
        if name in WRAPPERS:
            for arg in expr.args:
                if arg.keyword is None:
                    yield from drawn_from(arg.value)
                    if name != "zip":
                        return
            return
        # `metric_logger.log_every(loader, 10)`, `prefetcher(loader)`: a wrapper of unknown
        # kind most likely yields the batches of the loader it is handed first.
        positional = [arg.value for arg in expr.args if arg.keyword is None and not arg.star]
        if positional:
            yield from drawn_from(positional[0])
    yield expr


def loader_value(trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> Value | None:
    """The loader `expr` holds, following `it = iter(loader)` bindings the flow does not model."""
    value = trace.value(expr, step)
    if value is not None and value.kind == kinds.LOADER:
        return value
    if depth < MAX_DEPTH and value is not None and value.kind == kinds.UNKNOWN:
        bound = bound_expression(value)
        if bound is not None:
            for inner in drawn_from(bound):
                found = loader_value(trace, step, inner, depth + 1)
                if found is not None:
                    return found
    return None


def bound_expression(value: Value) -> cst.BaseExpression | None:
    """The right-hand side an unknown value was bound from, if it came from an assignment."""
    node = value.node
    if isinstance(node, (cst.Assign, cst.AnnAssign)) and node.value is not None:
        return node.value
    return None


def name_words(name: str) -> set[str]:
    """The lower-case words of a name, split at `_`, `.` and camelCase (`samplerVal`, `FakeData`)."""
    name = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)
    return {w for w in re.split(r"[^a-z0-9]+", name.lower()) if w}


def says_eval(name: str) -> bool:
    """Whether a variable or function name says evaluation: `val_loader`, `self.testset`,
    `evaluate`, `loader_eval`."""
    words = name_words(name)  # camelCase parts too: `dataloaderVal`, `samplerVal`, `testLoader`
    words |= {w[: -len("loader")] for w in words if w.endswith("loader")}
    words |= {w[: -len("set")] for w in words if w.endswith("set")}
    words |= {w[: -len("sampler")] for w in words if w.endswith("sampler")}
    return bool(words & EVAL_WORDS)
