"""`grad-sync`: after one backward, gradients are equal across ranks and equal to the gradients of a
single-process model run on the concatenated global batch (how PyTorch's own DDP tests compare).

Every rank computes that reference itself (the model is tiny), so no extra process is needed, and
says whether its gradients match it (`matches_reference`: element-wise tolerances need the tensors).
Under torchrun the gradients are DDP's after `backward()`; under horovodrun they are
`hvd.DistributedOptimizer`'s after `synchronize()` and clipping, compared with the clipped
single-process gradient (`distdoctor.probe.builtin.horovod_worker`, relative tolerance HOROVOD_RTOL).
Planted faults: `rank-init`, `no-allreduce`, `sum-grads` (the last one keeps ranks equal to each
other, only the reference catches it); Horovod: `clip-before-sync`.
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.builtin.protocol import ranks_phrase
from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "grad-sync"
FAULTS = ("rank-init", "no-allreduce", "sum-grads", "clip-before-sync")
RTOL, ATOL = 1e-4, 1e-6
# Horovod: max |grad - reference| / max |reference| (clipping rounds differently from one process).
HOROVOD_RTOL = 1e-4
CROSS_RANK_RTOL = 1e-6


def run(ctx) -> dict[str, Any]:
    import copy

    import torch

    from distdoctor.probe.builtin.rank import checksum, regression_batch, shard, tiny_mlp, wrap_ddp

    ctx.progress(ID, 0)
    model = tiny_mlp(ctx)
    reference = copy.deepcopy(model)
    ddp = wrap_ddp(model, ctx)
    inputs, targets = regression_batch(ctx, step=0)
    loss_fn = torch.nn.MSELoss()
    loss_fn(ddp(shard(inputs, ctx)), shard(targets, ctx)).backward()
    loss_fn(reference(inputs), targets).backward()
    grads = [p.grad for p in ddp.module.parameters()]
    ref_grads = [p.grad for p in reference.parameters()]
    diffs = [float((g - r).abs().max()) for g, r in zip(grads, ref_grads)]
    close = all(torch.allclose(g, r, rtol=RTOL, atol=ATOL) for g, r in zip(grads, ref_grads))
    ratio = float(sum(g.abs().sum() for g in grads) / max(float(sum(r.abs().sum() for r in ref_grads)), 1e-30))
    return {"checksum": checksum(grads), "max_abs_diff_vs_reference": max(diffs), "matches_reference": close,
            "grad_norm_ratio_vs_reference": round(ratio, 6)}


def checksums_agree(values: list[list[float]], rtol: float = CROSS_RANK_RTOL) -> bool:
    """True when every rank's checksum pair equals the first rank's within `rtol`."""
    first = values[0]
    return all(abs(a - b) <= rtol * max(abs(a), abs(b), 1e-12) for value in values[1:] for a, b in zip(first, value))


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    horovod = evidence.framework == "horovod"
    shown = {str(r): ev for r, ev in sorted(ranks.items())}
    if horovod:
        details = {"relative_tolerance": HOROVOD_RTOL, "cross_rank_rtol": CROSS_RANK_RTOL,
                   "reference": "one process, rank 0's start, global batch, clipping of the averaged gradient",
                   "when": "after synchronize(), step 0"}
    else:
        details = {"rtol": RTOL, "atol": ATOL, "cross_rank_rtol": CROSS_RANK_RTOL,
                   "reference": "one process, same initial model, concatenated global batch"}
    problems = []
    if not checksums_agree([ranks[r]["checksum"] for r in sorted(ranks)]):
        problems.append(f"gradients differ across ranks after {'synchronize()' if horovod else 'all-reduce'}")
    off = [r for r, ev in sorted(ranks.items()) if not ev["matches_reference"]]
    if off:
        ratio = ranks[off[0]]["grad_norm_ratio_vs_reference"]
        hint = f" (about {ratio:.3g}x the reference: summed, not averaged?)" if abs(ratio - world_size) < 0.05 * world_size and world_size > 1 else ""
        diff = ranks[off[0]]["max_abs_diff_vs_reference"]
        problems.append(f"{ranks_phrase(off)} differ from the single-process reference (max |diff| {diff:.2g}){hint}")
    if problems:
        return CheckResult(ID, "fail", "; ".join(problems), shown, details)
    worst = max(ev["max_abs_diff_vs_reference"] for ev in ranks.values())
    return CheckResult(ID, "pass", f"equal across {world_size} ranks and to the reference (max |diff| {worst:.2g})",
                       shown, details)


CHECK = Check(
    id=ID,
    title="gradients equal across ranks and to the single-process gradient of the global batch",
    probe="builtin",
    frameworks=("torch", "horovod"),
    needs=("checksum", "matches_reference", "max_abs_diff_vs_reference", "grad_norm_ratio_vs_reference"),
    verdict=verdict,
    faults=FAULTS,
    order=3,
    run=run,
)
