"""epoch-shuffle: a shuffling DistributedSampler is not iterated twice with the same epoch.

Why it matters: DistributedSampler shuffles with `seed + epoch`; without `sampler.set_epoch(epoch)`
before each epoch, every epoch replays the same order on every rank, which hurts convergence and
silently differs from a single-process run.
Only passes that fed training count as epochs: a pass during which an optimizer step happened. A
peek (`next(iter(loader))` before the epoch loop) or an evaluation pass feeds none and is left out.
Planted fault: fixtures/probe/fault_no_set_epoch.py.
"""

from __future__ import annotations

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RunTrace

ID = "epoch-shuffle"


def verdict(trace: RunTrace) -> CheckResult:
    """Find a shuffling sampler's second pass over an epoch it already went through."""
    every = {r: [p for p in t.sampler_passes if p.get("cls") is not None] for r, t in trace.ranks.items()}
    if not any(every.values()):
        return CheckResult(ID, "skip", "no DistributedSampler was iterated")
    passes = {r: [p for p in recs if (p["sampler"], p.get("passes")) in trace.ranks[r].fed_passes]
              for r, recs in every.items()}
    left_out = sorted({f"{trace.site(p.get('site', '?'))}" + (f" ({p['source']})" if p.get("source") else "")
                       for r, recs in every.items() for p in recs
                       if (p["sampler"], p.get("passes")) not in trace.ranks[r].fed_passes})
    repeats: dict[int, dict] = {}
    shuffling_repasses = 0
    for rank, records in passes.items():
        seen: dict[tuple[int, object], dict] = {}
        for record in records:
            key = (record["sampler"], record.get("epoch"))
            if record.get("shuffle") and key in seen and rank not in repeats:
                repeats[rank] = {"sampler": record["sampler"], "epoch": record.get("epoch"),
                                 "pass": record.get("passes"), "step": record.get("step"),
                                 "created": trace.site(record.get("created", "?")),
                                 "iterated": trace.site(record.get("site", "?")),
                                 "loader": record.get("source", ""),
                                 "set_epoch_calls": record.get("set_epoch_calls", 0)}
            if record.get("shuffle") and any(k[0] == record["sampler"] for k in seen):
                shuffling_repasses += 1
            seen.setdefault(key, record)
    evidence = {str(r): {"passes": [(p["sampler"], p.get("epoch"), p.get("shuffle")) for p in recs]}
                for r, recs in passes.items()}
    ignored = ("; passes that fed no optimizer step (a peek or an evaluation loop) were not counted as "
               f"epochs: {', '.join(left_out[:3])}") if left_out else ""
    if repeats:
        rank = min(repeats)
        found = repeats[rank]
        never = "set_epoch was never called" if not found["set_epoch_calls"] else (
            f"set_epoch was called {found['set_epoch_calls']} times, always with the same epoch")
        summary = (f"the DistributedSampler created at {found['created']} was iterated again with epoch "
                   f"{found['epoch']} at {found['iterated']} (pass {found['pass']}, after step {found['step']}) on "
                   f"rank(s) {','.join(map(str, sorted(repeats)))}: {never}, every epoch repeats the same order")
        return CheckResult(ID, "fail", summary, ranks=evidence,
                           details={"step": found["step"], "ranks": sorted(repeats), **found,
                                    "not_training_passes": left_out})
    if not shuffling_repasses:
        return CheckResult(ID, "skip", "no shuffling DistributedSampler started a second training epoch within "
                           "the steps run: raise --steps to check reshuffling" + ignored, ranks=evidence,
                           details={"not_training_passes": left_out})
    return CheckResult(ID, "pass", "every shuffling DistributedSampler got a new epoch before each training pass"
                       + ignored, ranks=evidence, details={"not_training_passes": left_out})


CHECK = Check(
    id=ID,
    title="a shuffling DistributedSampler is not iterated twice with the same epoch",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.SAMPLER_ITER,),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_no_set_epoch.py',
    ),
    order=2,
)
