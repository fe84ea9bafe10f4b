"""epoch-shuffle: a shuffling DistributedSampler is not iterated twice with the same epoch.

Why it matters: DistributedSampler shuffles with `seed + epoch`; without `sampler.set_epoch(epoch)`
before each epoch, every epoch replays the same order on every rank, which hurts convergence and
silently differs from a single-process run.
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
    passes = {r: [p for p in t.sampler_passes if p.get("cls") is not None] for r, t in trace.ranks.items()}
    if not any(passes.values()):
        return CheckResult(ID, "skip", "no DistributedSampler was iterated")
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
                                 "set_epoch_calls": record.get("set_epoch_calls", 0)}
            if record.get("shuffle") and any(k[0] == record["sampler"] for k in seen):
                shuffling_repasses += 1
            seen.setdefault(key, record)
    evidence = {str(r): {"passes": [(p["sampler"], p.get("epoch"), p.get("shuffle")) for p in recs]}
                for r, recs in passes.items()}
    if repeats:
        rank = min(repeats)
        found = repeats[rank]
        never = "set_epoch was never called" if not found["set_epoch_calls"] else (
            f"set_epoch was called {found['set_epoch_calls']} times, always with the same epoch")
        summary = (f"the DistributedSampler created at {found['created']} was iterated again with epoch "
                   f"{found['epoch']} at {found['iterated']} (pass {found['pass']}, after step {found['step']}) on "
                   f"rank(s) {','.join(map(str, sorted(repeats)))}: {never}, every epoch repeats the same order")
        return CheckResult(ID, "fail", summary, ranks=evidence,
                           details={"step": found["step"], "ranks": sorted(repeats), **found})
    if not shuffling_repasses:
        return CheckResult(ID, "skip", "no shuffling DistributedSampler started a second epoch within the steps "
                           "run: raise --steps to check reshuffling", ranks=evidence)
    return CheckResult(ID, "pass", "every shuffling DistributedSampler got a new epoch before each pass", ranks=evidence)


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
