"""grad-sync: gradients are equal on every rank when `optimizer.step()` runs.

Why it matters: equal gradients on every rank are what data parallelism means. A gradient that is
not all-reduced (a layer attached after the DDP wrap, a model never wrapped, a hand-written all-reduce
that misses a parameter) lets each rank step on its own data only.
Under Horovod, the checksums are taken after `optimizer.synchronize()`, so they can agree and still
be wrong: clipping (or any in-place edit) of gradients Horovod is still all-reducing, before
`synchronize()`, is recorded by the Horovod hooks where it happens and fails the check, whatever
the checksums say.
Planted faults: fixtures/probe/fault_layer_after_wrap.py, fixtures/probe/fault_no_ddp.py,
fixtures/probe/hvd_clip_before_sync.py.
"""

from __future__ import annotations

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
import math

from distdoctor.probe.script.records import (
    RunTrace,
    coverage,
    describe_groups,
    first_divergence,
    fmt_checksum,
    list_names,
    odd_ranks,
)

ID = "grad-sync"


def verdict(trace: RunTrace) -> CheckResult:
    """Compare gradient checksums across ranks at each step and name the first divergence; under
    Horovod, first name a gradient edit made before `synchronize()`."""
    by_checksums = _checksums(trace)
    edits = trace.horovod_records("unsynchronized_edit") if trace.framework == "horovod" else []
    if not edits:
        return by_checksums
    rank, first = edits[0]
    summary = (f"{first['op']} at {trace.site(first['site'])} changed gradients Horovod was still all-reducing "
               f"(step {first['step'] + 1}, before optimizer.synchronize()): call optimizer.synchronize(), "
               "then clip, then optimizer.step() inside optimizer.skip_synchronize()")
    ranks = {str(r): {"unsynchronized_edits": sum(1 for rr, _ in edits if rr == r)} for r in trace.rank_ids}
    details = {**by_checksums.details, "unsynchronized_edits": [e for _, e in edits[:20]],
               "checksum_verdict": {"status": by_checksums.status, "summary": by_checksums.summary}}
    return CheckResult(ID, "fail", summary, {**by_checksums.ranks, **ranks}, details)


def _checksums(trace: RunTrace) -> CheckResult:
    if len(trace.ranks) < 2:
        return CheckResult(ID, "skip", "one rank: nothing to compare")
    divergence, compared = first_divergence(trace, ("grad",))
    covered = coverage(trace)
    shown = {"compared_parameters": len(covered.compared), "not_compared": list(covered.one_copy[:50])}
    if divergence is None:
        if compared == 0:
            return CheckResult(ID, "skip", "no optimizer step was observed on every rank")
        bad = non_finite_shard(trace, set(covered.one_copy))
        if bad is not None:
            return bad
        if not covered.compared:
            return CheckResult(ID, "pass", f"every parameter is sharded with one copy per rank, so no gradient "
                               f"could be compared across ranks; each rank's gradient shards were finite at each "
                               f"of {compared} steps", details={"compared_steps": compared, **shown})
        sharded = covered.one_copy or any(t.optimizers.get(0, {}).get("spec") for t in trace.ranks.values())
        where = "across their replicas" if sharded else f"on {len(trace.ranks)} ranks"
        return CheckResult(ID, "pass", f"gradients of {len(covered.compared)} parameters equal {where} "
                           f"at each of {compared} steps" + covered.note()
                           + ("; the sharded ones were finite on every rank" if covered.one_copy else ""),
                           details={"compared_steps": compared, **shown})
    odd = odd_ranks(divergence.groups)
    outside = [p for p, flag in divergence.in_ddp.items() if flag is False]
    has_ddp = any(t.ddp for t in trace.ranks.values())
    if outside:
        ddp_site = next((trace.site(d["site"]) for t in trace.ranks.values() for d in t.ddp), "?")
        cause = (f"; {list_names(outside)} not in the model DDP wrapped at {ddp_site}: "
                 "its gradient is never all-reduced (attached after the wrap?)")
    elif divergence.layout != "a replica":  # FSDP2 / tensor parallel reduce gradients themselves
        cause = f"; {divergence.layout}: these ranks hold the same replica"
    elif not has_ddp:
        cause = "; no DistributedDataParallel was built and the gradients were not all-reduced"
    else:
        cause = ""
    summary = (f"{divergence.params[0]} gradient differs across ranks {divergence.when}: rank(s) "
               f"{','.join(map(str, odd))} differ from rank {divergence.groups[0][0]}"
               + (f" ({len(divergence.params)} parameters differ)" if len(divergence.params) > 1 else "") + cause)
    return CheckResult(
        ID, "fail", summary,
        ranks={str(r): {"checksum": divergence.values.get(r)} for r in trace.rank_ids},
        details={"step": divergence.step, "optimizer": divergence.opt, "parameter": divergence.params[0],
                 "parameters": list(divergence.params), "ranks": odd, "groups": divergence.groups,
                 "values": describe_groups(divergence.groups, lambda r: fmt_checksum(divergence.values[r])),
                 "not_in_ddp": outside, "compared_steps": compared},
    )


def non_finite_shard(trace: RunTrace, one_copy: set[str]) -> CheckResult | None:
    """A NaN/inf gradient shard of a parameter no other rank holds (the only evidence there is)."""
    for opt in sorted({o for t in trace.ranks.values() for o in t.optimizers}):
        names = trace.param_names(opt)
        watched = [j for j, name in enumerate(names) if name in one_copy]
        if not watched:
            continue
        for rank in trace.rank_ids:
            for step in (s for s in trace.ranks[rank].steps if s.opt == opt):
                for j in watched:
                    value = step.grad[j] if j < len(step.grad) else None
                    if value is not None and not all(math.isfinite(v) for v in value):
                        return CheckResult(
                            ID, "fail", f"the gradient shard of {names[j]} held by rank {rank} is not finite at step "
                            f"{step.n} ({fmt_checksum(value)}), step at {trace.site(step.site)}",
                            ranks={str(rank): {"checksum": value}},
                            details={"step": step.n, "ranks": [rank], "parameter": names[j], "optimizer": opt})
    return None


CHECK = Check(
    id=ID,
    title="gradients are equal on every rank when optimizer.step() runs",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.OPTIMIZER, protocol.STEP, protocol.DDP, protocol.HOROVOD),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_layer_after_wrap.py',
        'fixtures/probe/fault_no_ddp.py',
        'fixtures/probe/hvd_clip_before_sync.py',
        'fixtures/probe/fault_clip_one_rank.py',
    ),
    order=1,
)
