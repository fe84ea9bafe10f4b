"""`convergence`: a learnable synthetic task trained K steps under DDP follows the single-process
reference loss curve (same global batch, same seed) within a stated tolerance, and the loss falls.

Full-batch training on one fixed global batch, so the loss falls from the first steps on and a
short `--steps` still judges it.

The DDP loss of a step is the mean of the ranks' local losses (equal shards, so it equals the loss
on the global batch). Planted faults: `sum-grads` (an effective learning rate n times too large),
`no-allreduce`, `rank-init`; `rank-dies` and `rank-stalls` also strike here, at step 2.
"""

from __future__ import annotations

import math
from typing import Any

from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "convergence"
FAULTS = ("sum-grads", "no-allreduce", "rank-init")
RTOL, ATOL = 1e-3, 1e-5
# The loss must end below this fraction of where it started.
MUST_FALL_TO = 0.8
LR, MOMENTUM = 0.3, 0.5
PER_RANK = 16


def run(ctx) -> dict[str, Any]:
    import copy

    import torch

    from distdoctor.probe.builtin.rank import regression_batch, shard, tiny_mlp, wrap_ddp

    model = tiny_mlp(ctx)
    reference = copy.deepcopy(model)
    ddp = wrap_ddp(model, ctx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=LR, momentum=MOMENTUM)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=MOMENTUM)
    losses, ref_losses = [], []
    inputs, targets = regression_batch(ctx, step=0, per_rank=PER_RANK)
    for step in range(1, ctx.steps + 1):
        ctx.progress(ID, step)
        ctx.maybe_die_or_stall(ID, step)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(shard(inputs, ctx)), shard(targets, ctx))
        loss.backward()
        optimizer.step()
        ref_optimizer.zero_grad()
        ref_loss = torch.nn.functional.mse_loss(reference(inputs), targets)
        ref_loss.backward()
        ref_optimizer.step()
        losses.append(float(loss.detach()))
        ref_losses.append(float(ref_loss.detach()))
    return {"loss": losses, "reference_loss": ref_losses}


def verdict(evidence: Evidence) -> CheckResult:
    ranks = evidence.ranks
    order = sorted(ranks)
    reference = ranks[order[0]]["reference_loss"]
    mean_loss = [sum(ranks[r]["loss"][i] for r in order) / len(order) for i in range(len(reference))]
    shown = {str(r): {"first": ranks[r]["loss"][0], "last": ranks[r]["loss"][-1]} for r in order}
    details = {"steps": len(reference), "rtol": RTOL, "atol": ATOL, "must_fall_to": MUST_FALL_TO,
               "optimizer": f"SGD lr={LR} momentum={MOMENTUM}", "mean_loss": mean_loss, "reference_loss": reference,
               "loss_per_rank": {str(r): ranks[r]["loss"] for r in order}}
    if not all(math.isfinite(v) for v in mean_loss):
        return CheckResult(ID, "fail", "the loss is not finite", shown, details)
    for step, (got, want) in enumerate(zip(mean_loss, reference), start=1):
        if abs(got - want) > ATOL + RTOL * abs(want):
            return CheckResult(ID, "fail", f"the DDP loss leaves the single-process reference at step {step}: "
                               f"{got:.6g} vs {want:.6g}", shown, dict(details, first_divergent_step=step))
    if len(mean_loss) > 1 and not mean_loss[-1] < MUST_FALL_TO * mean_loss[0]:
        return CheckResult(ID, "fail", f"the loss does not fall: {mean_loss[0]:.4g} -> {mean_loss[-1]:.4g}", shown, details)
    return CheckResult(ID, "pass", f"follows the reference for {len(reference)} steps "
                       f"(loss {mean_loss[0]:.3g} -> {mean_loss[-1]:.3g}, rtol {RTOL})", shown, details)


CHECK = Check(
    id=ID,
    title="DDP training follows the single-process reference loss curve and the loss falls",
    probe="builtin",
    frameworks=('torch',),
    needs=('loss', 'reference_loss'),
    verdict=verdict,
    faults=FAULTS,
    order=7,
    run=run,
)
