"""`convergence` under Horovod: every rank's loss curve follows the single-process reference trained on
the global batch at Horovod's documented learning rate, `lr * hvd.size()`, and the loss falls.

Unlike the DDP check, each rank records the loss of its own model on the whole global batch (no
collective needed), so every rank's curve is compared with the reference, relative to the
reference's first loss. The rank side is `distdoctor.probe.builtin.horovod_worker`.
Planted fault: `unscaled-lr` (the learning rate is not multiplied by `hvd.size()`).
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "convergence"
FAULTS = ("unscaled-lr",)
# A healthy run differs from the single-process reference by float rounding only (about 1e-7 here).
LOSS_RTOL = 1e-3
# The loss must fall at least this much over the run (last / first of the reference curve).
LOSS_FALL = 0.8


def verdict(evidence: Evidence) -> CheckResult:
    ranks: dict[str, Any] = {}
    loss_per_rank: dict[str, list[float]] = {}
    worst, worst_rank, worst_step = 0.0, None, None
    reference: list[float] = []
    for rank, ev in sorted(evidence.ranks.items()):
        losses, reference = ev["losses"], ev["reference_losses"]
        scale = max(abs(reference[0]), 1e-12)
        devs = [abs(a - b) / scale for a, b in zip(losses, reference)]
        step = max(range(len(devs)), key=devs.__getitem__) if devs else 0
        ranks[str(rank)] = {"lr": ev["lr"], "max_relative_deviation": devs[step] if devs else 0.0,
                            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
        loss_per_rank[str(rank)] = losses
        if devs and devs[step] > worst:
            worst, worst_rank, worst_step = devs[step], rank, step
    first = evidence.ranks[min(evidence.ranks)]
    details = {
        "loss_per_rank": loss_per_rank,  # the names distdoctor.probe.plots draws
        "reference_loss": reference,
        "reference": "single process, global batch, lr * hvd.size(), clipping of the averaged gradient",
        "scaled_lr": first["scaled_lr"],
        "relative_tolerance": LOSS_RTOL,
    }
    lrs = {ev["lr"] for ev in evidence.ranks.values()}
    if worst > LOSS_RTOL:
        lr_note = ""
        if lrs != {first["scaled_lr"]}:
            lr_note = f"; lr {sorted(lrs)[0]:g} is not the scaled lr {first['scaled_lr']:g} (lr x hvd.size())"
        return CheckResult(ID, "fail", f"rank {worst_rank}'s loss leaves the single-process reference at step "
                           f"{worst_step} (relative deviation {worst:.2g} > {LOSS_RTOL:g}){lr_note}", ranks, details)
    if reference and reference[-1] > LOSS_FALL * reference[0]:
        return CheckResult(ID, "fail", "the loss does not fall over the run", ranks, details)
    return CheckResult(ID, "pass", f"loss follows the single-process reference within {worst:.1g} (relative) and "
                       f"falls {reference[0]:.3g} -> {reference[-1]:.3g}", ranks, details)


CHECK = Check(
    id=ID,
    title="every rank's loss follows the single-process reference at lr * hvd.size(), and falls",
    probe="builtin",
    frameworks=("horovod",),
    needs=("losses", "reference_losses", "lr", "scaled_lr"),
    verdict=verdict,
    faults=FAULTS,
    order=7,
)
