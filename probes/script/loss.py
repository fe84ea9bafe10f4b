"""loss: the per-rank loss curve (the scalar whose `backward()` ran) stays finite, and no rank's
loss runs away from the others'.

Why it matters: a NaN or inf on one rank is averaged into every rank's gradients by the all-reduce and
poisons the whole job one step later; naming the first rank and step points at the bad batch.
Planted fault: fixtures/probe/fault_nan_loss.py.
"""

from __future__ import annotations

import math
import statistics

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RunTrace

ID = "loss"
# A rank whose late losses exceed the other ranks' by this factor, and its own early losses, diverges.
DIVERGENCE_FACTOR = 10.0


def verdict(trace: RunTrace) -> CheckResult:
    """Report the first non-finite loss, or a rank whose loss diverges from the others'."""
    curves = {r: [(s.n, v) for s in t.primary_steps() for v in s.loss] for r, t in trace.ranks.items()}
    if not any(curves.values()):  # losses backed through another optimizer's steps only (a GAN's)
        curves = {r: [(s.n, v) for s in t.steps for v in s.loss] for r, t in trace.ranks.items()}
    if not any(curves.values()):
        backward = max((len(t.backward_sites) for t in trace.ranks.values()), default=0)
        steps = max((len(t.steps) for t in trace.ranks.values()), default=0)
        if backward and not steps:
            return CheckResult(ID, "skip", f"{backward} backward pass(es) ran but no optimizer step followed: "
                               "the loss is read at each step")
        if backward:
            return CheckResult(ID, "skip", f"{backward} backward pass(es) ran, none on a single-element tensor "
                               "(a loss): nothing to follow")
        return CheckResult(ID, "skip", "no backward() was observed")
    plot = {"loss_per_rank": {str(r): [v if math.isfinite(v) else None for _, v in c[:500]]
                              for r, c in curves.items()}}
    evidence = {str(r): {"first": c[0][1] if c else None, "last": c[-1][1] if c else None,
                         "curve": [round(v, 6) if math.isfinite(v) else str(v) for _, v in c[:200]]}
                for r, c in curves.items()}
    bad = [(n, r, v) for r, c in curves.items() for n, v in c if not math.isfinite(v)]
    if bad:
        step = min(n for n, _, _ in bad)
        ranks = sorted({r for n, r, _ in bad if n == step})
        value = next(v for n, r, v in bad if n == step)
        site = next((s.site for s in trace.ranks[ranks[0]].primary_steps() if s.n == step), "?")
        summary = (f"the loss is {value} on rank(s) {','.join(map(str, ranks))} at step {step} (step at "
                   f"{trace.site(site)})" + ("" if len(ranks) == len(curves) else
                                             ": its gradients reach every rank through the all-reduce"))
        return CheckResult(ID, "fail", summary, ranks=evidence, details={"step": step, "ranks": ranks, **plot})
    diverging = []
    for rank, curve in curves.items():
        others = [v for r, c in curves.items() if r != rank for _, v in c[-max(1, len(c) // 3):]]
        mine = [v for _, v in curve[-max(1, len(curve) // 3):]]
        early = [v for _, v in curve[: max(1, len(curve) // 3)]]
        if len(curve) >= 6 and others and mine:
            late, ref = statistics.fmean(mine), statistics.median(others)
            if late > DIVERGENCE_FACTOR * max(abs(ref), 1e-12) and late > statistics.fmean(early):
                diverging.append(rank)
    if diverging:
        return CheckResult(ID, "warn", f"the loss of rank(s) {','.join(map(str, diverging))} grows while the "
                           "other ranks' falls", ranks=evidence, details={"ranks": diverging, **plot})
    steps = max(len(c) for c in curves.values())
    return CheckResult(ID, "pass", f"finite on every rank over {steps} backward passes", ranks=evidence, details=plot)


CHECK = Check(
    id=ID,
    title="the per-rank loss stays finite and no rank's loss runs away from the others'",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.STEP,),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_nan_loss.py',
    ),
    order=5,
)
