"""Calls every rank must join (collectives, forwards through DDP or FSDP models) and the rank
conditions they run under: shared by DD301 (collectives, sharded forwards) and DD307 (DDP forwards)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import libcst as cst

from distdoctor.lint.analysis import evaluate, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, RankGuard
from distdoctor.lint.analysis.sharding import FSDP2
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


def single_process_only(ctx: LintContext, step: Step) -> bool:
    """Whether `step` runs only in a single-process run: under `if args.local_rank == -1 and ...:`
    or `if world_size == 1:` (or in the `else` of `if distributed:`). There is no other rank to
    wait for there, and no DDP wrapper."""
    for guard in step.guards:
        terms: list[cst.BaseExpression] = [guard.test]
        joiner = cst.Or if guard.negated else cst.And  # not (a or b) holds when both are false
        while any(isinstance(t, cst.BooleanOperation) and isinstance(t.operator, joiner) for t in terms):
            split: list[cst.BaseExpression] = []
            for t in terms:
                if isinstance(t, cst.BooleanOperation) and isinstance(t.operator, joiner):
                    split.extend((t.left, t.right))
                else:
                    split.append(t)
            terms = split
        for term in terms:
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
