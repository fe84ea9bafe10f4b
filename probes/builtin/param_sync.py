"""`param-sync`: parameter checksums are equal across ranks at step 0 and after every optimizer step.

Reports the first step where ranks parted. Under horovodrun, step 0 is after
`hvd.broadcast_parameters` / `hvd.broadcast_optimizer_state`, and the optimizer's momentum buffers
(`optimizer_state`) must be equal too. Planted faults: `rank-init` (parted at step 0),
`no-allreduce` (parted after step 1); Horovod: `no-broadcast`.
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.builtin.protocol import ranks_phrase
from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult
from distdoctor.probes.builtin.grad_sync import checksums_agree

ID = "param-sync"
FAULTS = ("rank-init", "no-allreduce", "no-broadcast")


def run(ctx) -> dict[str, Any]:
    import torch

    from distdoctor.probe.builtin.rank import checksum, regression_batch, shard, tiny_mlp, wrap_ddp

    ddp = wrap_ddp(tiny_mlp(ctx), ctx)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    sums = [checksum(ddp.parameters())]
    for step in range(1, ctx.steps + 1):
        ctx.progress(ID, step)
        inputs, targets = regression_batch(ctx, step)
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(ddp(shard(inputs, ctx)), shard(targets, ctx)).backward()
        optimizer.step()
        sums.append(checksum(ddp.parameters()))
    return {"checksums": sums}


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    horovod = evidence.framework == "horovod"
    order = sorted(ranks)
    steps = len(ranks[order[0]]["checksums"])
    shown = {str(r): {"step0": ranks[r]["checksums"][0], "last": ranks[r]["checksums"][-1]} for r in order}
    for step in range(steps):
        values = [ranks[r]["checksums"][step] for r in order]
        if not checksums_agree(values):
            differing = [r for r, v in zip(order, values) if v != values[0]]
            when = "at step 0 (initial parameters)" if step == 0 else f"after step {step}"
            hint = ": was hvd.broadcast_parameters called?" if horovod and step == 0 else ""
            return CheckResult(ID, "fail", f"parameters differ across ranks {when}: {ranks_phrase(differing)} "
                               f"{'differs' if len(differing) == 1 else 'differ'} from rank {order[0]}{hint}", shown,
                               {"first_divergent_step": step, "steps": steps - 1})
    states = [ranks[r].get("optimizer_state") for r in order]
    if "optimizer_state" in ranks[order[0]] and not _states_agree(states):
        differing = [r for r, v in zip(order, states) if not _states_agree([states[0], v])]
        return CheckResult(ID, "fail", f"optimizer state (momentum buffers) differs across ranks at the start: "
                           f"{ranks_phrase(differing)} against rank {order[0]}"
                           + (": was hvd.broadcast_optimizer_state called?" if horovod else ""), shown,
                           {"first_divergent_step": None, "steps": steps - 1, "optimizer_state_differs": True})
    subject = "parameters and optimizer state equal" if "optimizer_state" in ranks[order[0]] else "equal"
    return CheckResult(ID, "pass", f"{subject} on {world_size} ranks at step 0 and after each of {steps - 1} steps", shown, {"first_divergent_step": None, "steps": steps - 1})


def _states_agree(states: list) -> bool:
    """Checksums of the optimizer state; None (no state at all) equals only None."""
    if any(s is None for s in states):
        return all(s is None for s in states)
    return checksums_agree(states)


CHECK = Check(
    id=ID,
    title="parameter checksums equal across ranks at step 0 and after every optimizer step",
    probe="builtin",
    frameworks=("torch", "horovod"),
    needs=("checksums",),
    verdict=verdict,
    faults=FAULTS,
    order=4,
    run=run,
)
