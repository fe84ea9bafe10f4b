"""desync: every rank makes the same backward passes, optimizer steps and collectives, and none
stops while the others wait.

Why it matters: collectives are matched by order, not by name. A rank that skips a backward pass
(a rank-dependent `continue`, an early `break`, an extra `all_reduce` under `if rank == 0`) pairs
its next all-reduce with another rank's previous one: the job hangs until the collective timeout,
or worse, carries on with gradients from different steps.
Planted fault: fixtures/probe/fault_skip_backward.py.
"""

from __future__ import annotations

from distdoctor.probe.script import protocol
from distdoctor.probe.checks import Check
from distdoctor.probe.report import CheckResult
from distdoctor.probe.script.records import RankTrace, RunTrace, group_ranks, odd_ranks

ID = "desync"
# Errors that a rank raises because a peer left or hung, not on its own account.
_PEER_ERRORS = ("connection closed", "connection reset", "broken pipe", "timed out", "timeout", "gloo", "nccl",
                "socket", "peer")


def _between(trace: RankTrace, lo: int, hi: int, kind: str) -> list[str]:
    if kind == "bwd":
        return [trace.backward_sites.get(n, "?") for n in range(lo + 1, hi + 1)]
    return [f"{trace.collectives.get(n, ('?', '?'))[0]}@{trace.collectives.get(n, ('?', '?'))[1]}"
            for n in range(lo + 1, hi + 1)]


def _delta(trace: RunTrace, rank: int, index: int) -> tuple[int, int, int]:
    """What a rank made during step index+1 (backward passes, collectives, DDP training forwards)."""
    now = trace.made_by_step(rank, index)
    before = trace.made_by_step(rank, index - 1) if index else (0, 0, 0)
    return (now[0] - before[0], now[1] - before[1], now[2] - before[2])


def _parted_at_step(trace: RunTrace, index: int) -> CheckResult:
    step = index + 1
    made: dict[int, tuple[int, int, int]] = {}
    sites: dict[int, tuple[list[str], list[str]]] = {}
    unfinished = {r for r, t in trace.ranks.items() if len(t.primary_steps()) <= index}
    for rank, t in trace.ranks.items():
        made[rank] = _delta(trace, rank, index)
        b0, c0, _ = trace.made_by_step(rank, index - 1) if index else (0, 0, 0)
        b1, c1, _ = trace.made_by_step(rank, index)
        sites[rank] = (_between(t, b0, b1, "bwd"), _between(t, c0, c1, "coll"))
    # The DDP forwards of a step a rank never finished are unknown: compare them only between ranks
    # that finished it.
    key = {r: (m if r not in unfinished else m[:2]) for r, m in made.items()}
    groups = group_ranks(key, lambda a, b: a == b if len(a) == len(b) else a[:2] == b[:2])
    if len(groups) > 1 and len(groups[0]) == len(groups[1]) and index:
        # A tie (two ranks): the ranks that did at this step what they did at the previous one are
        # the norm; the odd one skipped a backward pass, or made an extra forward or collective.
        before = {r: _delta(trace, r, index - 1) for r in trace.ranks}

        def deviates(rank: int) -> bool:
            n = 2 if rank in unfinished else 3
            return made[rank][:n] != before[rank][:n]

        groups.sort(key=lambda g: (-len(g), deviates(g[0]), g[0]))
    odd = odd_ranks(groups)

    def show(rank: int) -> str:
        backward, colls, forwards = made[rank]
        bsites = sorted({trace.site(s) for s in sites[rank][0]})
        csites = sorted({c.split("@")[0] + " at " + trace.site(c.split("@", 1)[1]) for c in sites[rank][1]})
        text = f"{backward} backward pass(es)" + (f" ({', '.join(bsites)})" if bsites else "")
        if colls or any(made[r][1] for r in made):
            text += f", {colls} collective(s)" + (f" ({', '.join(csites)})" if csites else "")
        if rank in unfinished:
            text += f" and never reached the step ({trace.ranks[rank].where(trace.script.rpartition('/')[0] or None)})"
        elif len({made[r][2] for r in made if r not in unfinished}) > 1:
            text += f", {forwards} DDP forward(s) that prepared a gradient all-reduce (none does under no_sync())"
        if trace.stall and rank not in unfinished and trace.stall.waiting.get(rank):
            # where it went on to wait: FSDP's all-gather, DDP's all-reduce, the next collective
            text += f", then waited at {trace.stall.waiting[rank]}"
        return text

    parts = "; ".join(f"rank {','.join(map(str, g))} made {show(g[0])}" for g in groups)
    finished = [g[0] for g in groups if g[0] not in unfinished] or [groups[0][0]]
    steps = trace.ranks[finished[0]].primary_steps()
    step_site = trace.site(steps[index].site) if index < len(steps) else "?"
    summary = f"ranks parted before optimizer step {step} ({step_site}): {parts}"
    return CheckResult(ID, "fail", summary, ranks=_evidence(trace),
                       details={"step": step, "ranks": odd, "groups": groups,
                                "made": {str(r): {"backward": m[0], "collectives": m[1], "ddp_forwards": m[2]}
                                         for r, m in made.items()}})


def _evidence(trace: RunTrace) -> dict[str, dict]:
    root = trace.script.rpartition("/")[0] or None
    out = {}
    for rank, t in trace.ranks.items():
        steps, backward, colls = t.progress
        entry = {"steps": steps, "backward": backward, "collectives": colls, "last": t.where(root)}
        if trace.stall and rank in trace.stall.waiting:
            entry["waiting"] = trace.stall.waiting[rank]
            entry["stack"] = trace.stall.stacks.get(rank, [])[:12]
        if t.end and t.end.get("e") == protocol.ERROR:
            entry["error"] = t.end.get("traceback", "")[-3000:]
        elif rank in trace.rank_errors:
            entry["error"] = trace.rank_errors[rank][-3000:]
        out[str(rank)] = entry
    return out


def _ddp_built_on_some_ranks(trace: RunTrace, built: dict[int, int]) -> CheckResult:
    """DDP's constructor is a collective (it broadcasts rank 0's parameters): a rank that builds
    more DDP wrappers than another waits there for a peer that never comes."""
    most = max(built.values())
    builders = sorted(r for r, n in built.items() if n == most)
    others = sorted(r for r, n in built.items() if n != most)
    t = trace.ranks[builders[0]]
    site = t.open_ddp or (t.ddp[most - 1].get("site", "?") if len(t.ddp) >= most else "?")
    root = trace.script.rpartition("/")[0] or None
    rest = "; ".join(f"rank {r}: {trace.ranks[r].where(root)}" for r in trace.rank_ids)
    summary = (f"rank(s) {','.join(map(str, builders))} built a DistributedDataParallel at {trace.site(site)} that "
               f"rank(s) {','.join(map(str, others))} never built ({most} vs {min(built.values())} DDP wrapper(s)): "
               f"DDP's construction is a collective, so the builder waits for its peers; a connection error "
               f"raised there afterwards is the consequence, not the cause. {rest}")
    return CheckResult(ID, "fail", summary, ranks=_evidence(trace),
                       details={"ranks": builders, "ddp_built": {str(r): n for r, n in built.items()},
                                "step": min(len(trace.ranks[r].primary_steps()) for r in builders) + 1})


def _is_peer_error(t: RankTrace) -> bool:
    text = f"{t.end.get('type', '')} {t.end.get('message', '')}".lower() if t.end else ""
    return any(word in text for word in _PEER_ERRORS)


def verdict(trace: RunTrace) -> CheckResult:
    """Compare what each rank did between optimizer steps, and how each rank ended.

    On several nodes each node's launcher passes its own `--steps`: ranks given different budgets
    stop at different steps while the others wait. That is the probe's usage, not the script's
    fault, and the finding says so first (from the budgets in the ranks' start records).
    """
    result = _verdict(trace)
    budgets = {r: t.budget for r, t in trace.ranks.items() if t.budget is not None}
    if len(set(budgets.values())) < 2:
        return result
    groups: dict[int, list[int]] = {}
    for rank in sorted(budgets):
        groups.setdefault(budgets[rank], []).append(rank)
    told = "; ".join(f"{'to the end' if b == 0 else b} for rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))}"
                     for b, r in groups.items())
    summary = (f"the ranks were given different --steps ({told}): each node passes its own flags, start every "
               f"node with the same --steps; what followed: {result.summary}")
    return CheckResult(ID, "fail", summary, ranks=result.ranks,
                       details={**result.details, "steps_budget": {str(r): b for r, b in budgets.items()}})


def _verdict(trace: RunTrace) -> CheckResult:
    if not trace.ranks:
        return CheckResult(ID, "error", "no rank started the script" +
                           (f": {trace.launch_failure}" if trace.launch_failure else ""))
    missing = [r for r in range(trace.world_size) if r not in trace.ranks]
    common = min(len(t.primary_steps()) for t in trace.ranks.values())
    aligned = trace.aligned_steps()
    if aligned < common or trace.parted_in_open_step():
        return _parted_at_step(trace, aligned)
    root = trace.script.rpartition("/")[0] or None
    progress = {r: t.progress for r, t in trace.ranks.items()}
    ended = {r: (t.end or {}).get("e") for r, t in trace.ranks.items()}
    errors = {r: t for r, t in trace.ranks.items() if ended[r] == protocol.ERROR}
    if trace.stall is not None:
        groups = group_ranks(progress, lambda a, b: a == b)
        finished = sorted(r for r, e in ended.items() if e in (protocol.STOP, protocol.EXIT, protocol.ERROR))
        blocked = sorted(r for r in trace.ranks if r not in finished)
        odd = finished if finished and blocked else odd_ranks(groups) or blocked
        where = "; ".join(f"rank {r}: {trace.stall.waiting.get(r) or trace.ranks[r].where(root)}"
                          f" [{progress[r][0]} steps, {progress[r][1]} backward]" for r in trace.rank_ids)
        summary = (f"the job stalled after step {min(p[0] for p in progress.values())} ({trace.stall.reason}, "
                   f"quiet for {trace.stall.after_s:g} s): {where}")
        return CheckResult(ID, "fail", summary, ranks=_evidence(trace),
                           details={"step": min(p[0] for p in progress.values()) + 1, "ranks": odd,
                                    "stalled": True, "reason": trace.stall.reason})
    built = {r: len(t.ddp) + (1 if t.open_ddp else 0) for r, t in trace.ranks.items()}
    fewer = [t for r, t in trace.ranks.items() if built[r] < max(built.values())]
    own_error = any(t.end and t.end.get("e") == protocol.ERROR and not _is_peer_error(t) for t in fewer)
    if len(set(built.values())) > 1 and not missing and not own_error:
        return _ddp_built_on_some_ranks(trace, built)
    if missing:
        return CheckResult(ID, "error", f"rank(s) {','.join(map(str, missing))} never started the script"
                           + (f": {trace.launch_failure}" if trace.launch_failure else ""), ranks=_evidence(trace))
    if errors:
        own = {r: t for r, t in errors.items() if not _is_peer_error(t)} or errors
        first = min(own)
        t = own[first]
        where = f"raised {t.end.get('type')}: {str(t.end.get('message', '')).splitlines()[0][:200] if t.end.get('message') else ''} at {trace.site(t.end.get('site', '?'))} after step {progress[first][0]}"
        if len(own) == len(trace.ranks) and len({progress[r] for r in own}) == 1:
            return CheckResult(ID, "error", f"the script failed on every rank: {where}", ranks=_evidence(trace),
                               details={"step": progress[first][0] + 1, "ranks": sorted(own)})
        others = "; ".join(f"rank {r}: {trace.ranks[r].where(root)}" for r in trace.rank_ids if r not in own)
        return CheckResult(ID, "fail", f"rank(s) {','.join(map(str, sorted(own)))} {where}; {others}",
                           ranks=_evidence(trace), details={"step": progress[first][0] + 1, "ranks": sorted(own)})
    if len(set(progress.values())) > 1:
        groups = group_ranks(progress, lambda a, b: a == b)
        odd = odd_ranks(groups)
        parts = "; ".join(f"rank {r}: {trace.ranks[r].where(root)} [{progress[r][0]} steps, {progress[r][1]} "
                          f"backward, {progress[r][2]} collectives]" for r in trace.rank_ids)
        return CheckResult(ID, "fail", f"ranks ended at different points: {parts}", ranks=_evidence(trace),
                           details={"step": min(p[0] for p in progress.values()) + 1, "ranks": odd})
    if trace.timed_out:
        return CheckResult(ID, "fail", "the job ran past --timeout", ranks=_evidence(trace))
    steps, backward, colls = next(iter(progress.values()))
    if steps == 0:
        return CheckResult(ID, "skip", "the script made no optimizer step", ranks=_evidence(trace))
    return CheckResult(ID, "pass", f"{len(trace.ranks)} ranks made the same {steps} steps, {backward} backward passes "
                       f"and {colls} collectives", ranks=_evidence(trace))


CHECK = Check(
    id=ID,
    title="every rank makes the same backward passes, optimizer steps and collectives, and none stops while others wait",
    probe="script",
    frameworks=("torch", "horovod"),
    needs=(protocol.STEP, protocol.BACKWARD, protocol.BACKWARD_END, protocol.COLLECTIVE, protocol.COLLECTIVE_END, protocol.STOP, protocol.EXIT, protocol.ERROR),
    verdict=verdict,
    faults=(
        'fixtures/probe/fault_skip_backward.py',
        'fixtures/probe/fault_extra_allreduce.py',
        'fixtures/probe/fault_rank_stops_early.py',
        'fixtures/probe/fault_skip_iteration.py',
        'fixtures/probe/fault_ddp_on_one_rank.py',
        'fixtures/probe/fault_error_behind_wrapper.py',
        'fixtures/probe/fault_fsdp2_extra_collective.py',
        'fixtures/probe/fault_no_sync_one_rank.py',
    ),
    order=4,
)
