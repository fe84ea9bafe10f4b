"""`bandwidth`: all_reduce time, algorithm and bus bandwidth per message size (nccl-tests definitions).

algbw = bytes / time; busbw = algbw * 2(n-1)/n, the figure comparable with a link's peak. The time
of a size is the slowest rank's (a collective ends when its last rank does). Reported; it warns only
on an absurd figure. Planted fault: `slow-link` (the last rank sleeps 0.2 s before each timed
all_reduce of the largest size).

On several nodes the figure of the whole world is the slowest link's, so when a node has several
ranks the intra-node and inter-node links are also measured apart, at the largest size only (a few
extra all_reduces): within each node among its own ranks (every node at once, as training does),
and across nodes among the first rank of each node. With one rank per node the world figure is
the inter-node one, and it is labelled so.
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
    return {"sizes": rows, **_scopes(ctx, sizes[-1])}


def _node_of_every_rank(ctx) -> list[str]:
    """Each rank's node (torchrun's GROUP_RANK, else its host name), gathered to every rank."""
    import os
    import socket

    import torch.distributed as dist

    mine = os.environ.get("GROUP_RANK") or socket.gethostname()
    nodes: list[str | None] = [None] * ctx.world_size
    dist.all_gather_object(nodes, mine)
    return [str(n) for n in nodes]


def _timed(ctx, data, group) -> float:
    import torch.distributed as dist

    from distdoctor.probe.builtin.rank import synchronize

    dist.all_reduce(data, group=group)  # warm-up: the subgroup's connections
    synchronize(ctx)
    dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(ITERATIONS):
        dist.all_reduce(data, group=group)
    synchronize(ctx)
    return (time.perf_counter() - start) / ITERATIONS * 1e6


def _scopes(ctx, nbytes: int) -> dict[str, Any]:
    """This rank's node count and, when there are both, its intra- and inter-node timings."""
    import torch
    import torch.distributed as dist

    nodes = _node_of_every_rank(ctx)
    members: dict[str, list[int]] = {}
    for rank, node in enumerate(nodes):
        members.setdefault(node, []).append(rank)
    out: dict[str, Any] = {"nodes": len(members), "ranks_per_node": max(len(m) for m in members.values())}
    if len(members) < 2 or out["ranks_per_node"] < 2:
        return out
    # Every rank creates every group, in the same order (new_group is collective over the world).
    intra = {node: dist.new_group(ranks) for node, ranks in members.items()}
    leaders = [ranks[0] for ranks in members.values()]
    inter = dist.new_group(leaders)
    data = torch.ones(nbytes // 4, dtype=torch.float32, device=ctx.device)
    mine = nodes[ctx.rank]
    scopes: dict[str, Any] = {}
    ctx.progress(ID, None)
    if len(members[mine]) > 1:
        scopes["intra"] = {"bytes": nbytes, "group_size": len(members[mine]), "node": mine,
                           "time_us": _timed(ctx, data, intra[mine])}
    dist.barrier()  # the inter-node figure is measured alone on the links
    if ctx.rank in leaders:
        scopes["inter"] = {"bytes": nbytes, "group_size": len(leaders), "time_us": _timed(ctx, data, inter)}
    dist.barrier()
    out["scopes"] = scopes
    return out


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
    scopes = scope_table(ranks)
    first = ranks[min(ranks)]
    if scopes:
        details["scopes"] = scopes
        intra, inter = scopes.get("intra"), scopes.get("inter")
        if intra:
            line += (f"; intra-node {intra['busbw_GBps']:.3g} GB/s ({intra['group_size']} ranks, slowest of "
                     f"{intra['nodes']} nodes)")
        if inter:
            line += f"; inter-node {inter['busbw_GBps']:.3g} GB/s ({inter['group_size']} nodes, one rank each)"
    elif first.get("nodes", 1) > 1:
        line += f" (inter-node: {first['nodes']} nodes, one rank each)"
    if world_size < 2:
        return CheckResult(ID, "skip", "one rank: no link to measure", shown, details)
    if largest["busbw_GBps"] < ABSURD_BUSBW_GBPS:
        return CheckResult(ID, "warn", f"{line}: absurdly low (< {ABSURD_BUSBW_GBPS} GB/s)", shown, details)
    return CheckResult(ID, "pass", f"{line} (link peak not known here)", shown, details)


def scope_table(ranks) -> dict[str, dict[str, Any]]:
    """{"intra": ..., "inter": ...}: the slowest member's time per scope, as bus bandwidth.

    Intra-node: every node's own group, and the slowest node is reported (with every node's figure).
    """
    out: dict[str, dict[str, Any]] = {}
    intra: dict[str, list[dict]] = {}
    inter: list[dict] = []
    for ev in ranks.values():
        scopes = ev.get("scopes") or {}
        if "intra" in scopes:
            intra.setdefault(str(scopes["intra"]["node"]), []).append(scopes["intra"])
        if "inter" in scopes:
            inter.append(scopes["inter"])

    def row(timings: list[dict]) -> dict[str, Any]:
        slowest = max(t["time_us"] for t in timings)
        size, nbytes = timings[0]["group_size"], timings[0]["bytes"]
        algbw = nbytes / (slowest * 1e-6) / 1e9
        return {"bytes": nbytes, "group_size": size, "time_us": round(slowest, 1),
                "algbw_GBps": round(algbw, 4), "busbw_GBps": round(algbw * bus_factor(size), 4)}

    if intra:
        per_node = {node: row(timings) for node, timings in sorted(intra.items())}
        worst = min(per_node.values(), key=lambda r: r["busbw_GBps"])
        out["intra"] = {**worst, "nodes": len(per_node), "per_node": per_node}
    if inter:
        out["inter"] = row(inter)
    return out


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
