"""data-shard: ranks are not fed identical batches.

Why it matters: data parallelism only helps when each rank sees its own shard. A loader without a
DistributedSampler (or with the same seed everywhere) feeds every rank the same batch: N ranks do
the work of one while the script believes it trains on N times more data.
Evidence: a hash of the tensors reaching the top-level model's forward, in training mode. Ranks of
one tensor-parallel group (`parallelize_module`) are meant to see the same batch: they are not
compared with each other.
Planted fault: fixtures/probe/fault_same_batches.py.
"""

from __future__ import annotations

from itertools import combinations

from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RunTrace, group_ranks

ID = "data-shard"


def verdict(trace: RunTrace) -> CheckResult:
    """Count, per pair of ranks, the training forwards whose inputs were identical."""
    if len(trace.ranks) < 2:
        return CheckResult(ID, "skip", "one rank: nothing to compare")
    aligned = trace.aligned_steps()
    per_rank = {}
    for rank, t in trace.ranks.items():
        per_rank[rank] = [(s.n, h) for s in t.primary_steps()[:aligned] for h in s.inputs]
    compared = min(len(v) for v in per_rank.values())
    if compared == 0:
        return CheckResult(ID, "skip", "no training forward with tensor inputs was observed on every rank")
    ranks = trace.rank_ids
    together = {tuple(sorted(g)) for t in trace.ranks.values() for g in t.tensor_parallel}
    expected_same = {pair for pair in combinations(ranks, 2) if any(set(pair) <= set(g) for g in together)}
    if len(expected_same) == len(list(combinations(ranks, 2))):
        return CheckResult(ID, "skip", "every rank is in one tensor-parallel group with the others "
                           f"({'; '.join(','.join(map(str, g)) for g in sorted(together))}): they are meant to "
                           "see the same batch, there is no data-parallel dimension to compare")
    same = {pair: 0 for pair in combinations(ranks, 2) if pair not in expected_same}
    first_same: dict[tuple[int, int], int] = {}
    for i in range(compared):
        for group in group_ranks({r: per_rank[r][i][1] for r in ranks}):
            for pair in combinations(group, 2):
                if pair not in same:
                    continue
                same[pair] += 1
                first_same.setdefault(pair, per_rank[pair[0]][i][0])
    evidence = {str(r): {"forwards": len(per_rank[r])} for r in ranks}
    duplicated = {pair: n for pair, n in same.items() if n * 2 > compared}
    if duplicated:
        pairs = sorted(duplicated)
        involved = sorted({r for pair in pairs for r in pair})
        step = min(first_same[p] for p in pairs)
        worst = max(duplicated.values())
        summary = (f"rank(s) {','.join(map(str, involved))} were fed identical batches in {worst} of {compared} "
                   f"training forwards, from step {step}: the data is not sharded across ranks "
                   "(no DistributedSampler, or the same seed on every rank?)")
        return CheckResult(ID, "fail", summary, ranks=evidence,
                           details={"step": step, "ranks": involved, "identical": {f"{a}-{b}": n for (a, b), n in
                                                                                   duplicated.items()},
                                    "compared_forwards": compared})
    worst = max(same.values(), default=0)
    text = (f"ranks fed different batches in {compared - worst} of {compared} compared training forwards"
            + (f" ({worst} identical on a pair of ranks, too few to mean unsharded data)" if worst else ""))
    if expected_same:
        text += f"; {len(expected_same)} pair(s) of ranks in one tensor-parallel group were not compared"
    return CheckResult(ID, "pass", text, ranks=evidence, details={"compared_forwards": compared, "identical": worst})


CHECK = Check(
    id=ID,
    title="ranks are not fed identical batches",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.STEP,),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_same_batches.py',
        'fixtures/probe/fault_same_data_kwargs.py',
        'fixtures/probe/fault_unsharded_iterable.py',
    ),
    order=3,
)
