"""Shared facts about sharded training: which objects were sharded, how, and where.

FSDP2 (`fully_shard`) and tensor parallelism (`parallelize_module`) change a module in place and
return it: there is no wrapper, so "is this an FSDP2 model?" is a question about *which object* a
name holds at a step, not about the name's value kind. FSDP (v1) returns a wrapper
(`flow` gives it kind `fsdp`, with the wrapped module as `inner`). The DD5xx rules ask these
questions here, once per file, instead of re-deriving them.

An object is identified by the node its abstract value was made at (see `kinds.Value.node`); when
the value is unknown (a parameter of a function traced on its own), by its dotted name in its
frame. Two expressions that may or may not hold the same object never match: the rules stay
silent on what cannot be known.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

import libcst as cst

from distdoctor.lint.analysis import evaluate, frameworks, kinds, syntax
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted


class Context(Protocol):
    """What these facts read of the file's context (`distdoctor.lint.analysis.context.LintContext`, which
    builds them: named here, not imported, so that the dependency runs one way)."""

    source: str

    @property
    def traces(self) -> list[Trace]: ...

    def calls(self, *qualnames: str, suffix: str | None = None) -> Iterator[tuple[Trace, Step, cst.Call]]: ...

    def qualname(self, node: cst.CSTNode) -> str | None: ...

    def binding(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> tuple[Step, cst.BaseExpression] | None: ...

    def parts_of(self, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> Iterator[tuple[Step, cst.BaseExpression]]: ...

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None: ...

    def position(self, node: cst.CSTNode): ...


FSDP2 = "fsdp2"  # torch.distributed.fsdp.fully_shard: in place, no wrapper, DTensor parameters
FSDP1 = "fsdp1"  # FullyShardedDataParallel: a wrapper around flat parameters
TP = "tp"  # parallelize_module: in place, DTensor parameters

FULLY_SHARD = frozenset(
    {
        "torch.distributed.fsdp.fully_shard",
        "torch.distributed.fsdp._fully_shard.fully_shard",
        "torch.distributed.fsdp._fully_shard._fully_shard.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard",
        "torch.distributed._composable.fsdp.fully_shard.fully_shard",
    }
)
FSDP_CLASS = frameworks.FSDP_CLASS
PARALLELIZE = frozenset(
    {
        "torch.distributed.tensor.parallel.parallelize_module",
        "torch.distributed.tensor.parallel.api.parallelize_module",
    }
)
LOW_PRECISION = frozenset({"torch.float16", "torch.half", "torch.bfloat16"})
FLOAT16 = frozenset({"torch.float16", "torch.half"})

Key = tuple


@dataclass(frozen=True)
class ShardEvent:
    """One sharding call on the code path: `fully_shard(x)`, `FSDP(x)`, `parallelize_module(x)`."""

    trace: Trace
    step: Step
    call: cst.Call
    kind: str  # FSDP2, FSDP1 or TP
    target: cst.BaseExpression
    keys: frozenset  # the sharded object (and, for in-place APIs, what the result was bound to)
    wrapper_key: Key | None  # FSDP1: the wrapper object

    def holds(self, key: Key | None) -> bool:
        return key is not None and key in self.keys


def is_fully_shard(qual: str | None) -> bool:
    return qual in FULLY_SHARD


def shard_kind(qual: str | None) -> str | None:
    if qual in FULLY_SHARD:
        return FSDP2
    if qual in FSDP_CLASS:
        return FSDP1
    if qual in PARALLELIZE:
        return TP
    return None


class Sharding:
    """The sharding facts of one file (built lazily by `LintContext.sharding`)."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        self.events: list[ShardEvent] = []
        # The APIs' names must appear in the text (imports, aliases): most files skip the walk.
        if not any(word in ctx.source for word in frameworks.SHARDING_WORDS):
            return
        for trace, step, call in ctx.calls(*FULLY_SHARD, *FSDP_CLASS, *PARALLELIZE):
            kind = shard_kind(ctx.qualname(call.func))
            target = syntax.argument(call, 0, "module")
            if kind is None or target is None:
                continue
            keys = {self.key(trace, step, target)}
            wrapper_key: Key | None = None
            after = self._value_after(trace, step, call)
            if kind == FSDP1:
                wrapper_key = ("v", id(call))
            elif after is not None:
                keys.add(after)
            keys.discard(None)
            self.events.append(ShardEvent(trace, step, call, kind, target, frozenset(keys), wrapper_key))

    @cached_property
    def _step_of(self) -> dict[tuple[int, int], Step]:
        found: dict[tuple[int, int], Step] = {}
        for trace in self.ctx.traces:
            for step in trace.steps:
                found.setdefault((id(trace), id(step.node)), step)
        return found

    @cached_property
    def _returns(self) -> dict[tuple[int, int], Step]:
        """(trace, call) -> the called function's last `return x` step on that trace."""
        found: dict[tuple[int, int], Step] = {}
        for trace in self.ctx.traces:
            for step in trace.steps:
                if isinstance(step.node, cst.Return) and step.node.value is not None and step.frame.call is not None:
                    found[(id(trace), id(step.frame.call))] = step
        return found

    @property
    def any(self) -> bool:
        return bool(self.events)

    def uses(self, *shard_kinds: str) -> bool:
        return any(event.kind in shard_kinds for event in self.events)

    # --- object identity ---------------------------------------------------------------------
    def key(self, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> Key | None:
        """Which object `expr` holds just before `step`, as a comparable key (None: unknowable)."""
        value = trace.value(expr, step)
        if value is not None and value.node is not None and value.kind not in (kinds.TUPLE,):
            node = value.node
            # `self.model = model` where `model` was unknown: the object is the right-hand side's.
            if value.kind == kinds.UNKNOWN and isinstance(node, cst.Assign) and depth < 4:
                source_step = self._step_of.get((id(trace), id(node)))
                rhs = _strip_passthrough(node.value)
                if source_step is not None and isinstance(rhs, (cst.Name, cst.Attribute)):
                    inner = self.key(trace, source_step, rhs, depth + 1)
                    if inner is not None:
                        return inner
                # `model = build(...)` where the helper returns a module it got or made: that one.
                returned = self._returns.get((id(trace), id(rhs))) if isinstance(rhs, cst.Call) else None
                if returned is not None:
                    inner = self.key(trace, returned, _strip_passthrough(returned.node.value), depth + 1)
                    if inner is not None:
                        return inner
            return ("v", id(node))
        text = dotted(_strip_passthrough(expr))
        if text is None or text in ("None", "True", "False"):
            return None
        if isinstance(expr, cst.Name) and step.frame.call is not None and depth < 6:
            # A parameter the caller passed something unknown for: the caller's object.
            found = self.ctx.binding(trace, step, expr)
            if found is not None and found[0].frame is step.frame.parent:
                inner = self.key(trace, found[0], found[1], depth + 1)
                if inner is not None:
                    return inner
        if text.startswith("self.") and step.frame.cls is not None:
            return ("n", step.frame.cls.name.value, text)
        return ("n", step.frame.id, text)

    def _value_after(self, trace: Trace, step: Step, call: cst.Call) -> Key | None:
        """For `m = fully_shard(model)`, the object `m` holds after the statement."""
        node = step.node
        if not isinstance(node, (cst.Assign, cst.AnnAssign)) or _strip_passthrough(node.value) is not call:
            return None
        target = node.targets[0].target if isinstance(node, cst.Assign) and len(node.targets) == 1 else getattr(node, "target", None)
        return None if target is None else self.key_after(trace, step, target)

    def key_after(self, trace: Trace, step: Step, target: cst.BaseExpression) -> Key | None:
        """The object `target` holds right after `step` (which assigns it)."""
        if step.index + 1 >= len(trace.steps):
            return None
        later = trace.steps[step.index + 1]
        value = evaluate.Evaluator(trace.ctx, later.env, step.frame, {}).eval(target)
        if value is not None and value.node is not None:
            return ("v", id(value.node))
        return None

    # --- queries -----------------------------------------------------------------------------
    def sharded_before(self, trace: Trace, step: Step, expr: cst.BaseExpression, *shard_kinds: str) -> ShardEvent | None:
        """The latest sharding call of one of `shard_kinds`, earlier on this trace, on the object
        `expr` holds at `step` (for FSDP1: the wrapper it returned, or the module it wraps)."""
        key = self.key(trace, step, expr)
        if key is None:
            return None
        found = None
        for event in self.events:
            if event.trace is not trace or event.step.index >= step.index or event.kind not in shard_kinds:
                continue
            if event.holds(key) or (event.wrapper_key is not None and event.wrapper_key == key):
                found = event
        return found

    def fsdp1_wrapper(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> ShardEvent | None:
        """The FSDP (v1) wrapper `expr` holds at `step`, if any (only the wrapper itself)."""
        key = self.key(trace, step, expr)
        for event in self.events:
            if event.trace is trace and event.kind == FSDP1 and event.wrapper_key == key and event.step.index < step.index:
                if event.step.excludes(step):
                    continue  # wrapped in the other branch: `if args.use_fsdp: FSDP(m) else: DDP(m)`
                return event
        return None

    def in_place_sharded(self, trace: Trace, step: Step, expr: cst.BaseExpression, *shard_kinds: str, depth: int = 0) -> ShardEvent | None:
        """An FSDP2 / tensor-parallel sharding of the object `expr` holds, earlier on this trace,
        unless that object was later wrapped (FSDP1/DDP give a new object, checked by identity)."""
        shard_kinds = shard_kinds or (FSDP2, TP)
        value = trace.value(expr, step)
        if value is not None and value.kind in (kinds.DDP, "fsdp"):
            return None
        found = self.sharded_before(trace, step, expr, *shard_kinds)
        if found is None and value is None and depth < 2:
            # A helper traced on its own (`with maybe_no_sync(model, ...)`: calls in a `with`
            # header are not inlined): what its callers pass for this parameter.
            for caller_trace, caller_step, arg in self._call_site_arguments(trace, step, expr):
                found = self.in_place_sharded(caller_trace, caller_step, arg, *shard_kinds, depth=depth + 1)
                if found is not None:
                    break
        return found

    def _call_site_arguments(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> Iterator[tuple[Trace, Step, cst.BaseExpression]]:
        frame = step.frame
        function = trace.root
        if not (isinstance(expr, cst.Name) and isinstance(function, cst.FunctionDef)):
            return
        # The function's own frame, entered from the trace's empty root frame.
        root = frame.parent
        if frame.function is not function or frame.cls is not None or root is None or root.parent is not None or root.function is not None:
            return
        params = [p.name.value for p in function.params.params]
        if expr.value not in params:
            return
        index = params.index(expr.value)
        for other in self.ctx.traces:
            for other_step, call in other.calls():
                if isinstance(call.func, cst.Name) and call.func.value == function.name.value:
                    arg = syntax.argument(call, index, expr.value)
                    if arg is not None:
                        yield other, other_step, arg

    def events_on(self, trace: Trace, key: Key | None, *shard_kinds: str) -> list[ShardEvent]:
        return [e for e in self.events if e.trace is trace and e.holds(key) and (not shard_kinds or e.kind in shard_kinds)]

    def params_owners(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> Iterator[tuple[Key, cst.Call]]:
        """The objects whose `.parameters()` / `.named_parameters()` make up `expr` (an optimizer's
        first argument): directly, through names, param-group dicts, `filter(...)` and
        comprehensions."""
        for part_step, part in self.ctx.parts_of(trace, step, expr):
            for node in syntax.walk(part, skip=(cst.Lambda,)):
                if (
                    isinstance(node, cst.Call)
                    and isinstance(node.func, cst.Attribute)
                    and node.func.attr.value in ("parameters", "named_parameters")
                ):
                    key = self.key(trace, part_step, node.func.value)
                    if key is not None:
                        yield key, node

    def optimizers(self) -> Iterator[tuple[Trace, Step, cst.Call]]:
        """`torch.optim.X(...)` constructions on the code path (schedulers excluded)."""
        return self.ctx.optimizer_calls()


def line_to_change(ctx: Context, trace: Trace, step: Step, node: cst.CSTNode, other: Step) -> cst.CSTNode:
    """Where a finding about `node` (made at `step`) should point when `step` sits in a helper
    entered after the frame of `other` began: the call to that helper in the frame `other` runs in
    (`optimizer = build_optimizer(model)` rather than the constructor inside the helper)."""
    frame = step.frame
    wanted = {id(f) for f in other.frame.chain()}
    while id(frame) not in wanted and frame.call is not None and frame.parent is not None:
        try:
            ctx.position(frame.call)
        except KeyError:
            break  # a function traced on its own: its caller is not in the file
        node, frame = frame.call, frame.parent
    return node


TYPE_CHECKS = frozenset({"isinstance", "hasattr", "getattr", "type", "callable", "issubclass"})


def type_checked(ctx: Context, step: Step, node: cst.CSTNode) -> bool:
    """Whether `node` runs only after a check of what an object is: an enclosing `if` (here or at
    a call site that led here) or `a if <check> else b` whose test calls `isinstance`, `hasattr`,
    ... Code written for several kinds of model (`if isinstance(model, FSDP): ... else: ...`)
    must not be judged as if every branch ran on the sharded one."""
    if any(_calls_check(guard.test) for guard in step.guards):
        return True
    current: cst.CSTNode | None = node
    while current is not None and current is not step.node:
        parent = ctx.parent(current)
        if isinstance(parent, cst.IfExp) and current is not parent.test and _calls_check(parent.test):
            return True
        current = parent
    return False


def _calls_check(test: cst.BaseExpression) -> bool:
    return any(
        isinstance(sub, cst.Call) and isinstance(sub.func, cst.Name) and sub.func.value in TYPE_CHECKS
        for sub in syntax.walk(test)
    )


def _strip_passthrough(expr: cst.BaseExpression) -> cst.BaseExpression:
    """`model.cuda().train()` -> `model`: methods that return the module itself."""
    while (
        isinstance(expr, cst.Call)
        and isinstance(expr.func, cst.Attribute)
        and expr.func.attr.value in ("to", "cuda", "cpu", "train", "eval", "float", "half", "bfloat16", "to_empty", "requires_grad_")
    ):
        expr = expr.func.value
    return expr


def dtype_name(ctx: Context, expr: cst.BaseExpression | None) -> str | None:
    """`torch.float16` for `torch.float16` / `torch.half` (through aliases), else None."""
    if expr is None:
        return None
    qual = ctx.qualname(expr)
    if qual is not None and qual.startswith("torch."):
        return qual
    return None


def low_precision_cast(ctx: Context, call: cst.Call) -> str | None:
    """The dtype a `.half()` / `.bfloat16()` / `.to(torch.bfloat16)` / `.to(dtype=...)` call casts
    a module to, when it is a low-precision float; else None."""
    if not isinstance(call.func, cst.Attribute):
        return None
    method = call.func.attr.value
    if method == "half" and not call.args:
        return "torch.float16"
    if method == "bfloat16" and not call.args:
        return "torch.bfloat16"
    if method == "to":
        for arg in call.args:
            if arg.keyword is None or arg.keyword.value == "dtype":
                name = dtype_name(ctx, arg.value)
                if name in LOW_PRECISION:
                    return "torch.float16" if name in FLOAT16 else name
    return None
