"""Calls every rank must join (collectives, forwards through DDP or FSDP models) and the rank
conditions they run under: shared by DD301 (collectives, sharded forwards) and DD307 (DDP forwards)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import libcst as cst

from distdoctor.lint.analysis import evaluate, frameworks, kinds, scope, syntax
from distdoctor.lint.analysis.context import LintContext, RankGuard
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.sharding import FSDP2, FSDP_CLASS, FULLY_SHARD, PARALLELIZE
from distdoctor.lint.analysis.trace import Step, Trace

DDP_FORWARD = "a forward through the DistributedDataParallel wrapper"
FSDP1_FORWARD = "forward an FSDP (v1) model"
FSDP2_FORWARD = "forward a model sharded by fully_shard()"
SHARDED_FORWARDS = (FSDP1_FORWARD, FSDP2_FORWARD)

# A Horovod state broadcast under a rank guard is DD402's finding (the spec gives it that case):
# one bug, one code.
LEFT_TO_DD402 = ("horovod.torch.broadcast_parameters", "horovod.torch.broadcast_optimizer_state")


@dataclass(frozen=True)
class Event:
    step: Step
    call: cst.Call
    what: str  # the collective's qualified name, DDP_FORWARD or one of SHARDED_FORWARDS
    guards: tuple[RankGuard, ...]


def may_join(ctx: LintContext) -> bool:
    """Whether the file calls anything every rank must join, anywhere: a collective, a DDP or
    sharding constructor (a DDP or sharded model's forward and backward are collectives), or a
    project's gradient reducer. Without one, no event, value check or loop exit can be found, and
    the traces need not be built to say so."""
    if ctx.may_call(frameworks.DDP, *FULLY_SHARD, *FSDP_CLASS, *PARALLELIZE) or ctx.may_call_collective():
        return True
    if not any(is_gradient_reducer_name(name) for name in ctx.index.callees):
        return False  # no callee by a reducer's name: said from the index, without the tree
    return any(_gradient_reducer(ctx, call) is not None for call in ctx.nodes(cst.Call))


def events(ctx: LintContext, trace: Trace) -> list[Event]:
    """Every collective and every forward through a DDP (broadcasting buffers) or sharded model
    on the path, with the rank conditions it runs under."""
    found = []
    for step, call in trace.calls():
        what = ctx.collective_name(call)
        if what in LEFT_TO_DD402:
            continue
        if what is None:
            func = trace.value(call.func, step)
            if func is not None and func.kind == kinds.DDP:
                what = DDP_FORWARD if _broadcasts_buffers(func) else None
            else:
                what = _sharded_forward(ctx, trace, step, call)
            if what is None:
                continue
        found.append(Event(step, call, what, tuple(ctx.rank_guards(trace, step))))
    return found


def unmatched(ctx: LintContext, trace: Trace, found: list[Event]) -> Iterable[Event]:
    """The events under a rank condition whose skipped ranks make no matching call."""
    for event in found:
        if event.guards and not _matched(ctx, trace, event, found) and not single_process_only(ctx, event.step):
            yield event


def off_the_distributed_branch(ctx: LintContext, trace: Trace, step: Step) -> bool:
    """`step` is in another branch than every start of the process group on its path (`if
    command == "train": train()` ... `elif command == "export": torch.save(...)`; `if "--ddp" in
    sys.argv: train_ddp() else: train_single_gpu()`): a single-process subcommand or baseline of a
    tool whose training is distributed, or the single-GPU branch beside `if args.multi_gpu:
    mp.spawn(worker, ...)`, which runs in one process."""
    return trace.only_in_other_branches(
        step,
        lambda call: (dotted(call.func) or "").rsplit(".", 1)[-1] in frameworks.PROCESS_GROUP_STARTERS
        or ctx.qualname(call.func) in (frameworks.HOROVOD_INIT, frameworks.DDP)
        or scope.is_spawn(ctx.qualname(call.func) or ""),
    )


def single_process_only(ctx: LintContext, step: Step) -> bool:
    """Whether `step` runs only in a single-process run: under `if args.local_rank == -1 and ...:`
    or `if world_size == 1:` (or in the `else` of `if distributed:`). There is no other rank to
    wait for there, and no DDP wrapper."""
    for guard in step.guards:
        # Every term of `a and b` holds; so does the negation of every term of `not (a or b)`.
        for term in syntax.operands(guard.test, cst.Or if guard.negated else cst.And):
            value = evaluate.Evaluator(ctx.info, step.env, guard.frame, guard.results).eval(term)
            if value is not None and value.kind == kinds.PROCESS_COUNT_TEST and bool(value.attrs.get("multi")) == guard.negated:
                return True
    return False


def _sharded_forward(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> str | None:
    """A forward (a call of the model itself) through an FSDP wrapper or an FSDP2 model: both
    all-gather parameter shards, a collective."""
    if not isinstance(call.func, (cst.Name, cst.Attribute)):
        return None
    sharding = ctx.sharding
    if not sharding.any:
        return None
    if sharding.fsdp1_wrapper(trace, step, call.func) is not None:
        return FSDP1_FORWARD
    if sharding.in_place_sharded(trace, step, call.func, FSDP2) is not None:
        return FSDP2_FORWARD
    return None


def _broadcasts_buffers(wrapper: kinds.Value) -> bool:
    """`DDP(model, broadcast_buffers=False)` makes no collective in forward."""
    if isinstance(wrapper.node, cst.Call):
        flag = syntax.keyword(wrapper.node, "broadcast_buffers")
        if isinstance(flag, cst.Name) and flag.value == "False":
            return False
    return True


def _matched(ctx: LintContext, trace: Trace, event: Event, found: list[Event]) -> bool:
    """Whether the ranks this event skips make the same collective on the other side of a rank
    condition (an `else` branch, or the opposite test elsewhere on the path), possibly through a
    callback: `optimizer.step(closure)` on rank 0, `closure()` on the others."""
    sides = {guard.zero for guard in event.guards}
    if len(sides) > 1:
        return True  # contradictory guards: we cannot tell who runs it
    side = sides.pop()
    for other in found:
        if other is event or other.what != event.what:
            continue
        if any(guard.zero != side for guard in other.guards):
            return True
    return _callback_on_other_side(ctx, trace, event, side)


def _callback_on_other_side(ctx: LintContext, trace: Trace, event: Event, side: bool) -> bool:
    """The function that makes the event is also handed, uncalled, to a call that runs on the
    other side of the rank condition (`optimizer.step(closure)`, `run(fn)`): the callee calls it
    there, out of our sight, so the other ranks may well join."""
    names = set()
    frame = event.step.frame
    while frame is not None:
        if frame.function is not None:
            names.add(frame.function.name.value)
        frame = frame.parent
    if not names:
        return False
    for step, call in trace.calls():
        if not any(isinstance(arg.value, cst.Name) and arg.value.value in names for arg in call.args):
            continue
        if any(guard.zero != side for guard in ctx.rank_guards(trace, step)):
            return True
    return False


# --- conditions on this rank's own numbers ---------------------------------------------------
# `if torch.isnan(loss): continue` before `loss.backward()` on a DDP model: the check reads this
# rank's loss, so one rank may skip what every rank must join.

VALUE_CHECKS = frozenset({"isnan", "isinf", "isfinite", "is_valid_number"})
_REDUCED_WORDS = ("reduce", "gather", "sync", "global", "all_")


def _joined_by_every_rank(ctx: LintContext, step: Step, call: cst.Call) -> str | None:
    """"backward" for a backward through DDP, the qualified name for a collective, else None."""
    if ctx.is_backward(call):
        return "backward" if ctx.ddp_backward(step, call) else None
    return ctx.collective_name(call)


@dataclass(frozen=True)
class ValueSkip:
    step: Step
    call: cst.Call
    what: str  # "backward" (through DDP) or the collective's qualified name
    test: cst.BaseExpression
    checked: str  # the name the test reads: `loss`


def skipped_by_value_checks(ctx: LintContext, trace: Trace) -> Iterable[ValueSkip]:
    """Backwards through a DDP model, and collectives, that run only where this rank's own value
    passed a check (`if torch.isnan(loss): continue`, `if torch.isfinite(loss): ... all_reduce`):
    a rank whose value fails skips a call the others make. A value reduced across ranks first
    (`loss_reduced`, or one handed to all_reduce) is the same everywhere and is not reported; a
    check that ends the process (`raise`) is no skip."""
    for step, call in trace.calls():
        what = _joined_by_every_rank(ctx, step, call) or _gradient_reducer(ctx, call)
        if what is None:
            continue
        for guard in step.guards:
            checked = _checked_value(guard.test)
            if checked is None or _reduced_across_ranks(ctx, checked) or _numeric_setting(ctx, guard.test, checked):
                continue
            statement = ctx.parent(guard.test)
            if guard.negated and isinstance(statement, cst.If) and _ends_the_process(statement.body.body):
                continue
            if isinstance(statement, cst.If) and _other_branch_calls(statement, guard.negated, what):
                continue  # `if isinf(p): all_reduce(MAX) else: all_reduce(SUM)`: every rank joins one
            yield ValueSkip(step, call, what, guard.test, checked)
            break


# Project helpers that all-reduce the gradients by hand (`reduce_gradients(model)` in pysot,
# `average_gradients(model)` in the torch tutorials), imported from another module.
_GRADIENT_REDUCER = re.compile(r"^(all_?)?reduce_?grad(ient)?s$|^average_?grad(ient)?s$|^sync_?grad(ient)?s$|^allreduce_?grad(ient)?s$")


def is_gradient_reducer_name(name: str) -> bool:
    return _GRADIENT_REDUCER.match(name.lower()) is not None


def _gradient_reducer(ctx: LintContext, call: cst.Call) -> str | None:
    name = dotted(call.func)
    if name is None or name in ctx.info.functions:
        return None  # a function of this module is inlined: its collectives are seen directly
    last = name.rsplit(".", 1)[-1]
    return last if is_gradient_reducer_name(last) else None


def _other_branch_calls(statement: cst.If, negated: bool, what: str) -> bool:
    """Whether the branch of `statement` the step is not in makes the same collective."""
    other = statement.body if negated else statement.orelse
    if other is None:
        return False
    short = what.rsplit(".", 1)[-1]
    return any(
        type(node) is cst.Call and (dotted(node.func) or "").rsplit(".", 1)[-1] == short for node in syntax.walk(other)
    )


def _numeric_setting(ctx: LintContext, test: cst.BaseExpression, name: str) -> bool:
    """Whether the checked name is a parameter of the enclosing function with a number for its
    default (`norm_type=2.0`): a setting every rank is given alike, not a value it computed."""
    func = ctx.enclosing(test, cst.FunctionDef)
    if func is None or "." in name:
        return False
    params = [*func.params.posonly_params, *func.params.params, *func.params.kwonly_params]
    for param in params:
        if param.name.value == name:
            default = param.default
            if isinstance(default, cst.UnaryOperation):
                default = default.expression
            return isinstance(default, (cst.Integer, cst.Float))
    return False


def _checked_value(test: cst.BaseExpression) -> str | None:
    """The name a finiteness check in `test` reads: `torch.isnan(loss)`, `math.isfinite(loss.item())`,
    `is_valid_number(loss.data.item())` -> `loss`."""
    for node in syntax.walk(test):
        if type(node) is not cst.Call or not node.args:
            continue
        if (dotted(node.func) or "").rsplit(".", 1)[-1] not in VALUE_CHECKS:
            continue
        value = node.args[0].value
        while True:
            if type(value) is cst.Call and type(value.func) is cst.Attribute:
                value = value.func.value  # `loss.item()`, `loss.detach().cpu()`
            elif type(value) is cst.Attribute and value.attr.value in ("data", "detach"):
                value = value.value
            else:
                break
        text = dotted(value)
        if text is not None:
            return text
    return None


def _reduced_across_ranks(ctx: LintContext, name: str) -> bool:
    """Whether `name` holds a value made equal on every rank: its name says so (`loss_reduced`,
    `global_loss`), it is assigned from a reducing helper (`reduce_tensor(loss)`), or handed to a
    collective (`dist.all_reduce(loss)`) anywhere in the file."""
    lowered = name.lower()
    if any(word in lowered for word in _REDUCED_WORDS):
        return True
    for node in ctx.nodes(cst.Assign):
        if not any(dotted(target) == name for target in syntax.assigned_targets(node)):
            continue
        for call in syntax.walk(node.value):
            if type(call) is cst.Call and any(word in (dotted(call.func) or "").lower() for word in _REDUCED_WORDS):
                return True
    for call in ctx.nodes(cst.Call):
        if ctx.collective_name(call) is not None and any(dotted(arg.value) == name for arg in call.args):
            return True
    return False


def _ends_the_process(body: Sequence[cst.CSTNode]) -> bool:
    """A block that ends in `raise`: the process stops and its launcher tears down the others;
    no rank waits forever. (`sys.exit()` ends no block for the trace, so it makes no guard.)"""
    if not body or not isinstance(body[-1], cst.SimpleStatementLine):
        return False
    return any(isinstance(small, cst.Raise) for small in body[-1].body)


# --- a loop left on some ranks only ----------------------------------------------------------
# `if rank == 0: ... if early_stopper.stop(val_loss): break` inside the epoch loop: rank 0 leaves
# while the others start the next epoch and wait in its all-reduce.


@dataclass(frozen=True)
class RankExit:
    step: Step  # the `break`
    guard: RankGuard  # the rank condition inside the loop that only some ranks pass
    call: cst.Call  # a call in the loop every rank must join
    what: str  # "backward" (through DDP) or the collective's qualified name


def rank_only_loop_exits(ctx: LintContext, trace: Trace) -> Iterable[RankExit]:
    """`break` (or `return`) statements that leave a loop on some ranks only (a rank condition inside the loop
    guards them) where the loop makes a call every rank must join. A loop that runs on some ranks
    only as a whole (its rank condition outside it) is not split by its `break`."""
    for step in trace.steps:
        if not isinstance(step.node, (cst.Break, cst.Return)) or not step.loops:
            continue
        loop = step.loops[-1]
        if isinstance(step.node, cst.Return):
            own = ctx.enclosing(step.node, (cst.FunctionDef, cst.Lambda))
            if not ctx.within(step.node, loop) or (own is not None and ctx.within(own, loop)):
                continue  # a `return` of a helper called (or defined) in the loop leaves the helper, not the loop
        inside = [guard for guard in ctx.rank_guards(trace, step) if ctx.within(guard.guard.test, loop)]
        if not inside or single_process_only(ctx, step):
            continue
        for other, call in trace.calls():
            what = _joined_by_every_rank(ctx, other, call) if other.in_loop(loop) else None
            if what is not None:
                yield RankExit(step, inside[-1], call, what)
                break
