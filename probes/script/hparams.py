"""hparams: every rank trains with the same hyperparameters, at every step.

Why it matters: a learning rate, weight decay or clipping norm read from a per-host config, or a
schedule stepped on one rank only, gives each rank its own optimizer. Under DDP it shows up late, as
parameters drifting apart; under FSDP2 or ZeRO each rank updates its own shard with its own value and
nothing ever diverges: the model is silently trained with a mixture of settings.
Evidence: per optimizer and param group, lr, betas, momentum, weight decay, eps (and the other
numeric settings torch optimizers keep in `param_groups`) read at each `optimizer.step()`, the
max-norm of each `clip_grad_norm_` / `clip_grad_value_` call since the previous step, and the
GradScaler's scale when the step runs inside `scaler.step()`.
Planted faults: fixtures/probe/fault_fsdp2_rank_lr.py, fixtures/probe/fault_ddp_rank_lr.py,
fixtures/probe/fault_clip_one_rank.py.

`compare` is a pure function of the per-rank series (`series(trace)`), tested without launching.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RunTrace, describe_groups, group_ranks, odd_ranks, same_value

ID = "hparams"


@dataclass(frozen=True)
class StepSettings:
    """What one optimizer step of one rank ran with."""

    opt: int
    n: int
    site: str
    groups: tuple[Mapping[str, Any], ...]  # per param group: field -> value
    clips: tuple[tuple[str, Any, Any], ...] = ()  # (function, max, norm type) since the previous step
    clip_sites: tuple[str, ...] = ()
    scale: float | None = None
    optimizer: str = ""  # "AdamW at train.py:30"


@dataclass(frozen=True)
class Difference:
    step: int
    opt: int
    optimizer: str
    what: str  # "lr of param group 0", "clipping before the step", "GradScaler scale"
    field: str
    group: int | None
    values: dict[int, Any] = field(default_factory=dict)


def series(trace: RunTrace) -> dict[int, list[StepSettings]]:
    """Per rank, its optimizer steps in order, each with the settings in force (carried forward:
    a step record holds the param groups only when they changed)."""
    out: dict[int, list[StepSettings]] = {}
    for rank, t in trace.ranks.items():
        current: dict[int, tuple[Mapping[str, Any], ...]] = {}
        steps = []
        for s in t.steps:
            if s.hparams is not None:
                current[s.opt] = s.hparams
            record = t.optimizers.get(s.opt, {})
            label = f"{record.get('cls', 'optimizer')} at {trace.site(record.get('site', '?'))}"
            steps.append(StepSettings(
                opt=s.opt, n=s.n, site=s.site, groups=current.get(s.opt, ()),
                clips=tuple((c.get("fn", "?"), c.get("max"), c.get("norm_type")) for c in s.clips),
                clip_sites=tuple(trace.site(c.get("site", "?")) for c in s.clips), scale=s.scale, optimizer=label))
        out[rank] = steps
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, bool) or isinstance(b, bool) or a is None or b is None:
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return same_value(float(a), float(b))
    return a == b


def _first_difference(per_rank: Mapping[int, Sequence[StepSettings]]) -> tuple[Difference | None, int]:
    ranks = sorted(per_rank)
    opts = sorted({s.opt for steps in per_rank.values() for s in steps})
    compared = 0
    found: list[tuple[int, int, Difference]] = []
    for opt in opts:
        mine = {r: [s for s in per_rank[r] if s.opt == opt] for r in ranks}
        limit = min(len(v) for v in mine.values())
        compared = max(compared, limit)
        for i in range(limit):
            at = {r: mine[r][i] for r in ranks}
            head = at[ranks[0]]
            diff = _differ_at(at, head)
            if diff is not None:
                found.append((i, opt, diff))
                break
    if not found:
        return None, compared
    found.sort(key=lambda item: (item[0], item[1]))
    return found[0][2], compared


def _differ_at(at: Mapping[int, StepSettings], head: StepSettings) -> Difference | None:
    def diff(what: str, name: str, group: int | None, values: dict[int, Any]) -> Difference:
        return Difference(step=head.n, opt=head.opt, optimizer=head.optimizer, what=what, field=name, group=group,
                          values=values)

    counts = {r: len(s.groups) for r, s in at.items()}
    if len(set(counts.values())) > 1:
        return diff("number of param groups", "groups", None, counts)
    for g in range(len(head.groups)):
        names = sorted({k for s in at.values() for k in s.groups[g]})
        for name in names:
            values = {r: s.groups[g].get(name) for r, s in at.items()}
            if len(group_ranks(values, _equal)) > 1:
                return diff(f"{name} of param group {g}", name, g, values)
    clips = {r: s.clips for r, s in at.items()}
    if len(group_ranks(clips, _equal)) > 1:
        return diff("gradient clipping before the step", "clip", None,
                    {r: (s.clips, s.clip_sites) for r, s in at.items()})
    scales = {r: s.scale for r, s in at.items()}
    if any(v is not None for v in scales.values()) and len(group_ranks(scales, _equal)) > 1:
        return diff("GradScaler scale", "scale", None, scales)
    return None


def _show(d: Difference, value: Any) -> str:
    if d.field == "clip":
        clips, sites = value
        if not clips:
            return "no clipping call"
        return ", ".join(f"{fn}(max {m:g})" if isinstance(m, (int, float)) else f"{fn}({m})"
                         for fn, m, _ in clips) + f" at {', '.join(sorted(set(sites)))}"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def compare(per_rank: Mapping[int, Sequence[StepSettings]]) -> CheckResult:
    """Compare the settings of each optimizer step across ranks; name the first difference."""
    if len(per_rank) < 2:
        return CheckResult(ID, "skip", "one rank: nothing to compare")
    if not any(s.groups for steps in per_rank.values() for s in steps):
        return CheckResult(ID, "skip", "no optimizer step with readable hyperparameters was observed on every rank")
    difference, compared = _first_difference(per_rank)
    if difference is None and compared == 0:
        return CheckResult(ID, "skip", "no optimizer step was made by every rank: nothing to compare")
    if difference is None:
        sample = next(s for steps in per_rank.values() for s in steps if s.groups)
        order = ("lr", "betas", "momentum", "weight_decay", "eps")
        fields = sorted({k for g in sample.groups for k in g}, key=lambda k: (order.index(k) if k in order else 9, k))
        opts = len({s.opt for steps in per_rank.values() for s in steps})
        extra = []
        if any(s.clips for steps in per_rank.values() for s in steps):
            extra.append("clipping")
        if any(s.scale is not None for steps in per_rank.values() for s in steps):
            extra.append("GradScaler scale")
        what = ", ".join(fields[:5]) + (f" and {', '.join(extra)}" if extra else "")
        return CheckResult(ID, "pass", f"{what} of {opts} optimizer(s) equal on {len(per_rank)} ranks at each of "
                           f"{compared} steps", details={"compared_steps": compared, "fields": fields})
    groups = group_ranks(difference.values, lambda a, b: _equal(a[0], b[0]) if difference.field == "clip"
                         else _equal(a, b))
    odd = odd_ranks(groups)
    opt = "" if difference.opt == 0 else f" #{difference.opt}"
    shown = describe_groups(groups, lambda r: _show(difference, difference.values[r]))
    summary = (f"{difference.what} of optimizer{opt} ({difference.optimizer}) differs across ranks at step "
               f"{difference.step}: {shown}")
    return CheckResult(
        ID, "fail", summary,
        ranks={str(r): {"value": _show(difference, v)} for r, v in difference.values.items()},
        details={"step": difference.step, "ranks": odd, "optimizer": difference.opt, "group": difference.group,
                 "field": difference.field, "groups": groups, "compared_steps": compared})


def verdict(trace: RunTrace) -> CheckResult:
    """The hparams verdict on what the ranks recorded."""
    return compare(series(trace))


CHECK = Check(
    id=ID,
    title="every rank trains with the same hyperparameters at every step",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.OPTIMIZER, protocol.STEP),
    verdict=verdict,
    faults=(
        "fixtures/probe/fault_fsdp2_rank_lr.py",
        "fixtures/probe/fault_ddp_rank_lr.py",
        "fixtures/probe/fault_clip_one_rank.py",
    ),
    order=6,
)
