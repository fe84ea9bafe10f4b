"""param-sync: the parameters each optimizer updates are equal on every rank, at the first step
(before any update) and after every step.

Why it matters: DDP keeps replicas equal only by broadcasting rank 0's parameters once, when it wraps
the model, and then averaging gradients. Parameters created or changed on each rank after the wrap
(a layer attached later, a per-rank re-initialisation, `init_sync=False`) are never made equal
again, and every rank trains a different model while the loss looks fine.
Under Horovod, `hvd.broadcast_parameters` takes DDP's place: a divergence at the first step says
whether the Horovod hooks saw it called.
Planted faults: fixtures/probe/fault_init_after_wrap.py, fixtures/probe/fault_layer_after_wrap.py,
fixtures/probe/fault_no_ddp.py, fixtures/probe/hvd_no_broadcast.py.
"""

from __future__ import annotations

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import (
    RunTrace,
    coverage,
    describe_groups,
    first_divergence,
    fmt_checksum,
    list_names,
    odd_ranks,
)

ID = "param-sync"


def verdict(trace: RunTrace) -> CheckResult:
    """Compare parameter checksums across ranks, step by step, and name the first divergence."""
    if len(trace.ranks) < 2:
        return CheckResult(ID, "skip", "one rank: nothing to compare")
    divergence, compared = first_divergence(trace, ("param0", "param"))
    covered = coverage(trace)
    shown = {"compared_parameters": len(covered.compared), "not_compared": list(covered.one_copy[:50]),
             "layouts": dict(list(covered.layouts.items())[:50])}
    if divergence is None:
        if compared == 0:
            return CheckResult(ID, "skip", "no optimizer step was observed on every rank")
        if not covered.compared:
            return CheckResult(ID, "skip", f"every parameter is sharded with one copy per rank "
                               f"({', '.join(sorted(set(covered.layouts.values()))[:3])}): no two ranks hold "
                               "values that must be equal", details={"compared_steps": compared, **shown})
        where = "their replicas" if covered.one_copy or any(
            t.optimizers.get(0, {}).get("spec") for t in trace.ranks.values()) else f"{len(trace.ranks)} ranks"
        return CheckResult(ID, "pass", f"{len(covered.compared)} parameters equal on {where} at the first step "
                           f"and after each of {compared} steps" + covered.note(),
                           details={"compared_steps": compared, **shown})
    odd = odd_ranks(divergence.groups)
    name = divergence.params[0]
    cause = ""
    details: dict = {}
    outside = [p for p, flag in divergence.in_ddp.items() if flag is False]
    if divergence.key == "param0" and trace.framework == "horovod":
        broadcast = sorted({r for r, _ in trace.horovod_records("broadcast_parameters")})
        cause = ("; hvd.broadcast_parameters(model.state_dict(), root_rank=0) was never called" if not broadcast
                 else "; changed on a rank after hvd.broadcast_parameters")
        details["broadcast_ranks"] = broadcast
    elif outside:
        ddp_site = next((trace.site(d["site"]) for t in trace.ranks.values() for d in t.ddp), "?")
        cause = f"; {list_names(outside)} not in the model DDP wrapped at {ddp_site} (attached after the wrap?)"
    elif divergence.key == "param0":
        no_sync = [d for t in trace.ranks.values() for d in t.ddp if d.get("init_sync") is False]
        cause = ("; DDP was built with init_sync=False" if no_sync
                 else "; initialised per rank and never broadcast (or changed on a rank after the DDP wrap)")
    if divergence.layout != "a replica":  # a DTensor: fully_shard / parallelize_module broadcast nothing
        cause = (f"; {divergence.layout}: these ranks hold the same replica, initialised differently (seed every "
                 "rank alike or load the same weights before the wrap) or changed on a rank after the wrap"
                 if divergence.key == "param0" else f"; {divergence.layout}: these ranks hold the same replica")
    summary = (f"{name} differs across ranks {divergence.when}: rank(s) {','.join(map(str, odd))} differ from "
               f"rank {divergence.groups[0][0]}" + (f" ({len(divergence.params)} parameters differ)"
                                                    if len(divergence.params) > 1 else "") + cause)
    return CheckResult(
        ID, "fail", summary,
        ranks={str(r): {"checksum": divergence.values.get(r)} for r in trace.rank_ids},
        details={"step": 0 if divergence.key == "param0" else divergence.step, "when": divergence.when,
                 "optimizer": divergence.opt, "parameter": name, "parameters": list(divergence.params),
                 "ranks": odd, "groups": divergence.groups,
                 "values": describe_groups(divergence.groups, lambda r: fmt_checksum(divergence.values[r])),
                 "compared_steps": compared, **details},
    )


CHECK = Check(
    id=ID,
    title="the parameters each optimizer updates are equal on every rank, at the first step and after every step",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.OPTIMIZER, protocol.STEP, protocol.DDP, protocol.HOROVOD),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_init_after_wrap.py',
        'fixtures/probe/fault_layer_after_wrap.py',
        'fixtures/probe/fault_no_ddp.py',
        'fixtures/probe/hvd_no_broadcast.py',
        'fixtures/probe/fault_clip_one_rank.py',
        'fixtures/probe/fault_ddp_rank_lr.py',
        'fixtures/probe/fault_load_after_wrap.py',
    ),
    order=0,
)
