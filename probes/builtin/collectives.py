"""`collectives`: all_reduce, broadcast, all_gather and reduce_scatter give exact results.

Integer-valued data, so every dtype must reproduce the expected values exactly; the evidence is the
count of wrong elements per operation, dtype and size, as nccl-tests reports it. Planted fault:
`corrupt-allreduce` (the last rank feeds one wrong element into all_reduce).
"""

from __future__ import annotations

from typing import Any

from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "collectives"
FAULTS = ("corrupt-allreduce",)
SIZES = (1, 1023, 65536)
# Small integers are exact in every floating dtype used by training, bfloat16 included (< 256).
DTYPES_BY_BACKEND = {"gloo": ("float32", "bfloat16", "int64"), "nccl": ("float32", "float16", "bfloat16", "int64")}


def run(ctx) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    world, rank = ctx.world_size, ctx.rank
    wrong: dict[str, int] = {}
    skipped: dict[str, str] = {}
    for dtype_name in DTYPES_BY_BACKEND.get(ctx.backend, DTYPES_BY_BACKEND["gloo"]):
        dtype = getattr(torch, dtype_name)
        for size in SIZES:
            ctx.progress(ID, None)
            base = torch.arange(size, device=ctx.device) % 7
            case = f"{dtype_name}/{size}"

            data = (base + rank).to(dtype)
            if ctx.planted("corrupt-allreduce") and ctx.last_rank:
                data[0] += 1
            dist.all_reduce(data)
            expected = (base * world + world * (world - 1) // 2).to(dtype)
            wrong[f"all_reduce/{case}"] = int((data != expected).sum())

            src = world - 1
            data = (base + rank).to(dtype)
            dist.broadcast(data, src=src)
            wrong[f"broadcast/{case}"] = int((data != (base + src).to(dtype)).sum())

            gathered = [torch.empty(size, dtype=dtype, device=ctx.device) for _ in range(world)]
            dist.all_gather(gathered, (base + 10 * rank).to(dtype))
            wrong[f"all_gather/{case}"] = sum(int((g != (base + 10 * r).to(dtype)).sum()) for r, g in enumerate(gathered))

            try:
                out = torch.empty(size, dtype=dtype, device=ctx.device)
                inputs = [(base + r + rank).to(dtype) for r in range(world)]
                dist.reduce_scatter(out, inputs)
                expected = (base * world + rank * world + world * (world - 1) // 2).to(dtype)
                wrong[f"reduce_scatter/{case}"] = int((out != expected).sum())
            except (RuntimeError, NotImplementedError, ValueError) as exc:
                skipped["reduce_scatter"] = f"{ctx.backend} cannot run it: {str(exc).splitlines()[0]}"
    return {"wrong_elements": wrong, "skipped": skipped}


def verdict(evidence: Evidence) -> CheckResult:
    ranks = evidence.ranks
    shown: dict[str, Any] = {}
    bad: list[str] = []
    cases = 0
    for rank, ev in sorted(ranks.items()):
        wrong = ev["wrong_elements"]
        cases = max(cases, len(wrong))
        failing = {case: n for case, n in wrong.items() if n}
        shown[str(rank)] = {"cases": len(wrong), "wrong_elements": sum(wrong.values()), "failing": failing,
                            "skipped": ev.get("skipped", {})}
        bad += [f"rank {rank} {case}: {n} wrong" for case, n in failing.items()]
    skipped = {op: why for ev in ranks.values() for op, why in ev.get("skipped", {}).items()}
    details = {"sizes": list(SIZES), "skipped": skipped}
    if bad:
        return CheckResult(ID, "fail", f"{len(bad)} inexact results: {'; '.join(bad[:3])}", shown, details)
    note = f" ({', '.join(f'{op} skipped' for op in skipped)})" if skipped else ""
    return CheckResult(ID, "pass", f"{cases} cases exact on every rank{note}", shown, details)


CHECK = Check(
    id=ID,
    title="all_reduce, broadcast, all_gather and reduce_scatter give exact results",
    probe="builtin",
    frameworks=('torch',),
    needs=('wrong_elements',),
    verdict=verdict,
    faults=FAULTS,
    order=1,
    run=run,
)
