"""`param-sync`: parameter checksums are equal across ranks at step 0 and after every optimizer step.

Reports the first step where ranks parted. Planted faults: `rank-init` (parted at step 0),
`no-allreduce` (parted after step 1).
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.builtin.protocol import ranks_phrase
from distdoctor.probe.report import CheckResult
from distdoctor.probes.grad_sync import checksums_agree

ID = "param-sync"
FAULTS = ("rank-init", "no-allreduce")


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


def verdict(ranks: dict[int, dict[str, Any]], world_size: int) -> CheckResult:
    order = sorted(ranks)
    steps = len(ranks[order[0]]["checksums"])
    shown = {str(r): {"step0": ranks[r]["checksums"][0], "last": ranks[r]["checksums"][-1]} for r in order}
    for step in range(steps):
        values = [ranks[r]["checksums"][step] for r in order]
        if not checksums_agree(values):
            differing = [r for r, v in zip(order, values) if v != values[0]]
            when = "at step 0 (initial parameters)" if step == 0 else f"after step {step}"
            return CheckResult(ID, "fail", f"parameters differ across ranks {when}: {ranks_phrase(differing)} "
                               f"{'differs' if len(differing) == 1 else 'differ'} from rank {order[0]}", shown, {"first_divergent_step": step, "steps": steps - 1})
    return CheckResult(ID, "pass", f"equal on {world_size} ranks at step 0 and after each of {steps - 1} steps",
                       shown, {"first_divergent_step": None, "steps": steps - 1})
