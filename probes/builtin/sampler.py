"""`sampler`: DistributedSampler shards are disjoint and cover the dataset; `set_epoch` changes order.

Disjoint up to the padding DistributedSampler adds to make shards equal. Planted fault:
`no-set-epoch` (the same order every epoch).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from distdoctor.probe.builtin.protocol import ranks_phrase
from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "sampler"
FAULTS = ("no-set-epoch",)


def dataset_size(world_size: int) -> int:
    return 10 * world_size + 3  # not a multiple of the world size: padding is exercised


def run(ctx) -> dict[str, Any]:
    from torch.utils.data import DistributedSampler

    ctx.progress(ID, None)
    sampler = DistributedSampler(range(dataset_size(ctx.world_size)), num_replicas=ctx.world_size, rank=ctx.rank,
                                 shuffle=True, seed=ctx.seed)
    epochs = []
    for epoch in range(2):
        if not ctx.planted("no-set-epoch"):
            sampler.set_epoch(epoch)
        epochs.append(list(sampler))
    return {"epochs": epochs}


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    size = dataset_size(world_size)
    padding = -size % world_size
    problems = []
    for epoch in range(2):
        counts = Counter(i for ev in ranks.values() for i in ev["epochs"][epoch])
        missing = size - len(set(counts) & set(range(size)))
        repeated = sum(n - 1 for n in counts.values())
        if missing:
            problems.append(f"epoch {epoch}: {missing} samples on no rank")
        if repeated > padding:
            problems.append(f"epoch {epoch}: {repeated} samples on several ranks (padding allows {padding})")
    same = [r for r, ev in sorted(ranks.items()) if ev["epochs"][0] == ev["epochs"][1]]
    if same:
        problems.append(f"{ranks_phrase(same)} see the same order in epochs 0 and 1 (set_epoch not called?)")
    shown = {str(r): {"epoch0_head": ev["epochs"][0][:6], "epoch1_head": ev["epochs"][1][:6], "shard": len(ev["epochs"][0])}
             for r, ev in sorted(ranks.items())}
    details = {"dataset_size": size, "padding": padding}
    if problems:
        return CheckResult(ID, "fail", "; ".join(problems), shown, details)
    return CheckResult(ID, "pass", f"{world_size} shards of {size} samples disjoint and covering; order changes per epoch",
                       shown, details)


CHECK = Check(
    id=ID,
    title="DistributedSampler shards are disjoint and cover the dataset; set_epoch changes the order",
    probe="builtin",
    frameworks=('torch',),
    needs=('epochs',),
    verdict=verdict,
    faults=FAULTS,
    order=6,
    run=run,
)
