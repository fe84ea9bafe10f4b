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
from distdoctor.probe.script.records import RunTrace, describe_groups, first_divergence, fmt_checksum, list_names, odd_ranks

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
    if divergence is None:
        if compared == 0:
            return CheckResult(ID, "skip", "no optimizer step was observed on every rank")
        return CheckResult(ID, "pass", f"gradients equal on {len(trace.ranks)} ranks at each of {compared} steps",
                           details={"compared_steps": compared})
    odd = odd_ranks(divergence.groups)
    outside = [p for p, flag in divergence.in_ddp.items() if flag is False]
    has_ddp = any(t.ddp for t in trace.ranks.values())
    if outside:
        ddp_site = next((trace.site(d["site"]) for t in trace.ranks.values() for d in t.ddp), "?")
        cause = (f"; {list_names(outside)} not in the model DDP wrapped at {ddp_site}: "
                 "its gradient is never all-reduced (attached after the wrap?)")
    elif not has_ddp:
        cause = "; no DistributedDataParallel was built and the gradients were not all-reduced"
    else:
        cause = ""
    summary = (f"{divergence.params[0]} gradient differs across ranks {divergence.when}: rank(s) "
               f"{','.join(map(str, odd))} differ from rank {divergence.groups[0][0]}"
               + (f" ({len(divergence.params)} parameters differ)" if len(divergence.params) > 1 else "") + cause)
    return CheckResult(
        ID, "fail", summary,
        ranks={str(r): {"checksum": divergence.values[r]} for r in trace.rank_ids},
        details={"step": divergence.step, "optimizer": divergence.opt, "parameter": divergence.params[0],
                 "parameters": list(divergence.params), "ranks": odd, "groups": divergence.groups,
                 "values": describe_groups(divergence.groups, lambda r: fmt_checksum(divergence.values[r])),
                 "not_in_ddp": outside, "compared_steps": compared},
    )


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
    ),
    order=1,
)
