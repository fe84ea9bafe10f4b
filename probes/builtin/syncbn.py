"""`syncbn`: SyncBatchNorm over per-rank shards matches BatchNorm over the concatenated batch.

Where nn.SyncBatchNorm cannot run (CPU builds: no `aten::batch_norm_stats` kernel), the check runs
the statistics math SyncBatchNorm does (per-rank count, sum and sum of squares, all-reduced) over the
same backend and reports `skip` with the reason when that matches, so the table never claims that
SyncBatchNorm itself ran. Planted fault: `no-syncbn` (plain BatchNorm per rank): `fail` either way.
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.builtin.protocol import ranks_phrase
from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "syncbn"
FAULTS = ("no-syncbn",)
RTOL, ATOL = 1e-4, 1e-5
CHANNELS, PER_RANK, LENGTH = 3, 4, 5


def run(ctx) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from distdoctor.probe.builtin.rank import seeded_generator, shard

    ctx.progress(ID, None)
    gen = seeded_generator(ctx.seed, 53)
    batch = (torch.randn(PER_RANK * ctx.world_size, CHANNELS, LENGTH, generator=gen) * 2 + 1).to(ctx.device)
    local = shard(batch, ctx)
    reference = torch.nn.BatchNorm1d(CHANNELS).to(ctx.device).train()
    want = shard(reference(batch), ctx)

    unsupported = ""
    if ctx.planted("no-syncbn"):
        layer, mode = torch.nn.BatchNorm1d(CHANNELS).to(ctx.device).train(), "batchnorm"
        got = layer(local)
    else:
        layer, mode = torch.nn.SyncBatchNorm(CHANNELS).to(ctx.device).train(), "syncbatchnorm"
        try:
            got = layer(local)
        except (ValueError, NotImplementedError, RuntimeError) as exc:
            unsupported = str(exc).splitlines()[0]
            mode = "statistics-math"
            layer = torch.nn.BatchNorm1d(CHANNELS).to(ctx.device).train()
            got = _allreduced_batchnorm(local, layer, dist)
    got, want = got.detach(), want.detach()
    return {
        "mode": mode,
        "unsupported": unsupported,
        "max_abs_diff": float((got - want).abs().max()),
        "matches": bool(torch.allclose(got, want, rtol=RTOL, atol=ATOL)),
        "running_mean_matches": bool(torch.allclose(layer.running_mean, reference.running_mean, rtol=RTOL, atol=ATOL)),
    }


def _allreduced_batchnorm(local, layer, dist):
    """BatchNorm with statistics all-reduced across ranks: what SyncBatchNorm computes."""
    import torch

    dims = [0, 2]
    count = torch.tensor([local.numel() / local.shape[1]], dtype=torch.float64, device=local.device)
    sums = torch.stack([local.double().sum(dims), (local.double() ** 2).sum(dims)])
    dist.all_reduce(count)
    dist.all_reduce(sums)
    mean = sums[0] / count
    var = sums[1] / count - mean**2
    with torch.no_grad():
        momentum = layer.momentum
        layer.running_mean.mul_(1 - momentum).add_(momentum * mean.float())
        layer.running_var.mul_(1 - momentum).add_(momentum * (var * count / (count - 1)).float())
    shape = (1, -1, 1)
    return ((local.double() - mean.view(shape)) / torch.sqrt(var.view(shape) + layer.eps)).float()


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    shown = {str(r): ev for r, ev in sorted(ranks.items())}
    details = {"rtol": RTOL, "atol": ATOL, "batch": f"{PER_RANK} x {CHANNELS} x {LENGTH} per rank"}
    off = [r for r, ev in sorted(ranks.items()) if not (ev["matches"] and ev["running_mean_matches"])]
    first = ranks[min(ranks)]
    if off:
        what = "plain BatchNorm (not synchronised)" if first["mode"] == "batchnorm" else first["mode"]
        return CheckResult(ID, "fail", f"{ranks_phrase(off)}: normalisation differs from BatchNorm on the "
                           f"global batch ({what})", shown, details)
    if first["mode"] == "statistics-math":
        return CheckResult(ID, "skip", f"nn.SyncBatchNorm cannot run here ({first['unsupported']}); its all-reduced "
                           "statistics matched BatchNorm on the global batch", shown, dict(details, reason=first["unsupported"]))
    return CheckResult(ID, "pass", f"SyncBatchNorm over {world_size} shards matches BatchNorm on the global batch",
                       shown, details)


CHECK = Check(
    id=ID,
    title="SyncBatchNorm over per-rank shards matches BatchNorm over the concatenated batch",
    probe="builtin",
    frameworks=('torch',),
    needs=('mode', 'matches', 'running_mean_matches'),
    verdict=verdict,
    faults=FAULTS,
    order=5,
    run=run,
)
