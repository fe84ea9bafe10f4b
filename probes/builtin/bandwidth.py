"""`bandwidth`: all_reduce time, algorithm and bus bandwidth per message size (nccl-tests definitions).

algbw = bytes / time; busbw = algbw * 2(n-1)/n, the figure comparable with a link's peak. The time
of a size is the slowest rank's (a collective ends when its last rank does). Reported; it warns only
on an absurd figure. Planted fault: `slow-link` (the last rank sleeps 0.2 s before each timed
all_reduce of the largest size).
"""

from __future__ import annotations

import time
from typing import Any

from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "bandwidth"
FAULTS = ("slow-link",)
SIZES_BYTES = {"cpu": (4 << 10, 64 << 10, 1 << 20, 4 << 20), "cuda": (64 << 10, 1 << 20, 16 << 20, 64 << 20)}
ITERATIONS = 5
# Below this the link is not slow, it is broken (or the timing is): warn.
ABSURD_BUSBW_GBPS = 0.05


def run(ctx) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from distdoctor.probe.builtin.rank import synchronize

    rows = []
    sizes = SIZES_BYTES.get(ctx.device.type, SIZES_BYTES["cpu"])
    for nbytes in sizes:
        ctx.progress(ID, None)
        data = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
        dist.all_reduce(data)  # warm-up: connections, buffers
        synchronize(ctx)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(ITERATIONS):
            if ctx.planted("slow-link") and ctx.last_rank and nbytes == sizes[-1]:
                time.sleep(0.2)
            dist.all_reduce(data)
        synchronize(ctx)
        rows.append({"bytes": nbytes, "time_us": (time.perf_counter() - start) / ITERATIONS * 1e6})
    return {"sizes": rows}


def bus_factor(world_size: int) -> float:
    """nccl-tests' all_reduce bus bandwidth factor, 2(n-1)/n."""
    return 2 * (world_size - 1) / world_size


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    table = []
    for i, row in enumerate(ranks[min(ranks)]["sizes"]):
        slowest = max(ev["sizes"][i]["time_us"] for ev in ranks.values())
        algbw = row["bytes"] / (slowest * 1e-6) / 1e9
        table.append({"bytes": row["bytes"], "time_us": round(slowest, 1), "algbw_GBps": round(algbw, 4),
                      "busbw_GBps": round(algbw * bus_factor(world_size), 4)})
    shown = {str(r): {"time_us": [round(s["time_us"], 1) for s in ev["sizes"]]} for r, ev in sorted(ranks.items())}
    details = {"sizes": table, "definition": "algbw = bytes/time; busbw = algbw*2(n-1)/n (nccl-tests)",
               "link_peak_GBps": None, "iterations": ITERATIONS}
    largest = table[-1]
    line = f"busbw {largest['busbw_GBps']:.3g} GB/s at {largest['bytes'] >> 10} KiB"
    if world_size < 2:
        return CheckResult(ID, "skip", "one rank: no link to measure", shown, details)
    if largest["busbw_GBps"] < ABSURD_BUSBW_GBPS:
        return CheckResult(ID, "warn", f"{line}: absurdly low (< {ABSURD_BUSBW_GBPS} GB/s)", shown, details)
    return CheckResult(ID, "pass", f"{line} (link peak not known here)", shown, details)


CHECK = Check(
    id=ID,
    title="all_reduce time, algorithm and bus bandwidth per message size",
    probe="builtin",
    frameworks=('torch',),
    needs=('sizes',),
    verdict=verdict,
    faults=FAULTS,
    order=2,
    run=run,
)
