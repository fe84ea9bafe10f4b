"""Reading the ranks of live jobs: a few samples of every rank's stack, a moment apart, in parallel.

A rank whose stack and step did not move across the samples stands still; one that waits inside
backward gets one native read (the C++ frames say whether DDP's reducer is what it waits on); the
child processes of a rank that stands outside any collective (DataLoader workers) are read once,
since a worker that never returns is the usual reason such a rank waits.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from distdoctor.probe.stacks import analysis, flight, sampler
from distdoctor.probe.stacks.analysis import BACKWARD, IDLE, RankStacks, Verdict
from distdoctor.probe.stacks.discover import Job, read_proc


@dataclass(frozen=True)
class Options:
    samples: int = 3
    interval_s: float = 0.5
    timeout_s: float = 5.0  # per rank and read
    jobs: int = 16  # py-spy processes at once
    native: bool = True


@dataclass
class JobStacks:
    """One job as read: its ranks with their stacks, and the verdict on them."""

    key: str
    launcher: str
    ranks: list[RankStacks]
    world_size: int | None = None
    agents: list[int] = field(default_factory=list)
    hosts: list[str] = field(default_factory=list)

    @property
    def verdict(self) -> Verdict:
        return analysis.diagnose(self.ranks, self.world_size)


def read_jobs(jobs: Sequence[Job], binary: str, options: Options) -> list[JobStacks]:
    """Sample every rank of every job; failures are kept on the rank (`RankStacks.error`)."""
    out: list[JobStacks] = []
    ranks: dict[int, RankStacks] = {}
    children: dict[int, list[int]] = {}
    for job in jobs:
        job_ranks = []
        for rp in job.ranks:
            idn = rp.identity
            rank = RankStacks(rp.pid, idn.rank, idn.local_rank, idn.world_size, idn.host)
            dump = flight.read_dump(rp.flight_dump, since=rp.started_at) if rp.flight_dump else None
            rank.flight = dump.describe() if dump else None
            ranks[rp.pid] = rank
            children[rp.pid] = rp.children
            job_ranks.append(rank)
        out.append(JobStacks(job.key, job.launcher, job_ranks, job.world_size, list(job.agents),
                             sorted({r.host for r in job_ranks if r.host})))

    live = list(ranks)
    for sample in range(max(1, options.samples)):
        started = time.monotonic()
        reads = sampler.dump_many(binary, live, options.timeout_s, options.jobs)
        for pid, read in reads.items():
            _take(ranks[pid], read)
        live = [pid for pid in live if ranks[pid].error is None]
        if sample + 1 < options.samples and live:
            time.sleep(max(0.0, options.interval_s - (time.monotonic() - started)))

    for job in out:
        _spawn_ranks(job)

    if options.native:
        wanted = [pid for pid in live if _wants_native(ranks[pid])]
        for pid, read in sampler.dump_many(binary, wanted, max(options.timeout_s, 10.0), options.jobs, native=True).items():
            main = read.main_thread()
            if read.error is None and main is not None and analysis.signature(main.frames) == analysis.signature(ranks[pid].frames):
                ranks[pid].native = list(main.frames)

    idle_children = [c for pid in live for c in children.get(pid, ())
                     if not ranks[pid].moved and not ranks[pid].activity.in_collective and _is_python(c)]
    for child, read in sampler.dump_many(binary, idle_children, options.timeout_s, options.jobs).items():
        main = read.main_thread()
        if main is None:
            continue
        owner = next(pid for pid, kids in children.items() if child in kids)
        ranks[owner].children.append((child, list(main.frames)))
    return out


def _take(rank: RankStacks, read: sampler.Read) -> None:
    if read.error is not None and read.kind in (sampler.FAILED, sampler.TIMEOUT) and rank.samples:
        return  # one bad read of a rank already read: the samples it has still count
    if read.error is not None:
        rank.error, rank.error_kind = read.error, read.kind
        return
    main = read.main_thread()
    if main is None:
        rank.error, rank.error_kind = f"pid {rank.pid} has no Python thread to read", sampler.FAILED
        return
    rank.samples.append(list(main.frames))
    rank.active.append(main.active)
    rank.other_threads = {f"{t.name or 'thread'} {t.tid}": list(t.frames) for t in read.threads if t is not main and t.frames}


def _spawn_ranks(job: JobStacks) -> None:
    """torch.multiprocessing.spawn children: the rank is `_wrap`'s index `i` (their process index)."""
    if job.launcher != "mp.spawn":
        return
    for rank in job.ranks:
        for frames in reversed(rank.samples):
            wrap = next((f for f in frames if f.name == "_wrap" and "torch/multiprocessing/spawn" in f.file.replace("\\", "/")), None)
            index = dict(wrap.locals).get("i") if wrap else None
            if index is not None and index.strip().isdigit():
                rank.rank = rank.local_rank = int(index)
                break
    if job.world_size is None:
        job.world_size = len(job.ranks)
    for rank in job.ranks:
        rank.world_size = rank.world_size or job.world_size


def _wants_native(rank: RankStacks) -> bool:
    """Standing still in backward, or in a C call straight from the user's line: native frames say on what."""
    if rank.moved or not rank.samples:
        return False
    activity = rank.activity
    if activity.kind == BACKWARD:
        return True
    return activity.kind == IDLE and activity.inner is not None and activity.inner == activity.user


def _is_python(pid: int) -> bool:
    proc = read_proc(pid, with_env=False)
    return proc is not None and proc.is_python

