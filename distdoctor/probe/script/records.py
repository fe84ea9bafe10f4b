"""What every rank of a probed script did, read back from its record file, and the comparisons the
script checks share (`probes/script/*`). No torch here: this runs in the launcher.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from distdoctor.probe.script import layouts, protocol

# Checksums of the same tensor on two ranks agree to the last bit when DDP works; the tolerance
# only forgives float64 summation order on different hardware, never a real divergence.
REL_TOL = 1e-7


@dataclass(frozen=True)
class Step:
    """One optimizer step as one rank recorded it (checksums are [L1, L2] pairs)."""

    opt: int
    n: int
    backward: int  # backward passes since the rank started, at this step
    collectives: int  # collectives on the default group since the rank started
    site: str
    loss: tuple[float, ...]
    inputs: tuple[tuple[float, float], ...]
    grad: tuple[tuple[float, float] | None, ...]
    param: tuple[tuple[float, float], ...]
    param0: tuple[tuple[float, float], ...] | None
    forwards: int = 0  # training forwards through a DDP wrapper since the rank started
    hparams: tuple[dict[str, Any], ...] | None = None  # per param group, when changed since the last step
    clips: tuple[dict[str, Any], ...] = ()  # clipping calls since the previous step
    scale: float | None = None  # the GradScaler's scale when the step ran inside scaler.step()
    grad_placements: dict[int, str] | None = None  # gradients laid out unlike their parameter

    @property
    def made(self) -> tuple[int, int, int]:
        """(backward passes, collectives, DDP training forwards) since the rank started."""
        return (self.backward, self.collectives, self.forwards)


@dataclass(frozen=True)
class StallReport:
    """The launcher's finding that the job stopped progressing, and where each rank waited."""

    after_s: float
    reason: str
    waiting: dict[int, str]  # rank -> "file:line in func" of the user's code
    stacks: dict[int, list[str]]  # rank -> innermost-first frames of the main thread


@dataclass
class RankTrace:
    """Everything one rank recorded, grouped by kind."""

    rank: int
    pid: int | None = None
    main_thread: int | None = None
    host: str | None = None
    backend: str | None = None
    budget: int | None = None  # the --steps this rank's node was given (0: to the end)
    steps: list[Step] = field(default_factory=list)
    optimizers: dict[int, dict[str, Any]] = field(default_factory=dict)
    ddp: list[dict[str, Any]] = field(default_factory=list)
    models: list[dict[str, Any]] = field(default_factory=list)
    backward_sites: dict[int, str] = field(default_factory=dict)
    collectives: dict[int, tuple[str, str]] = field(default_factory=dict)  # n -> (op, site)
    sampler_passes: list[dict[str, Any]] = field(default_factory=list)
    open_backward: int | None = None  # a backward pass entered and not left
    open_collective: int | None = None
    end: dict[str, Any] | None = None  # the stop, exit or error record
    horovod: list[dict[str, Any]] = field(default_factory=list)  # the Horovod hooks' records, in order
    probe_errors: list[dict[str, Any]] = field(default_factory=list)  # the probe's own hooks that failed
    tensor_parallel: list[list[int]] = field(default_factory=list)  # ranks of each parallelize_module mesh
    fed_passes: set[tuple[int, int]] = field(default_factory=set)  # (sampler, pass) that fed optimizer steps
    open_ddp: str | None = None  # the site of a DDP construction entered and not finished

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("e")
        if kind == protocol.START:
            self.pid, self.main_thread, self.host = record.get("pid"), record.get("main_thread"), record.get("host")
            self.budget = record.get("steps")
        elif kind == "pg":
            self.backend = record.get("backend")
        elif kind == protocol.STEP:
            self.steps.append(_step(record))
        elif kind == protocol.OPTIMIZER:
            self.optimizers[int(record["opt"])] = record
        elif kind == protocol.DDP_BEGIN:
            self.open_ddp = record.get("site", "?")
        elif kind == protocol.DDP:
            self.ddp.append(record)
            self.open_ddp = None
        elif kind == "model":
            self.models.append(record)
        elif kind == protocol.BACKWARD:
            self.backward_sites[int(record["n"])] = record.get("site", "?")
            self.open_backward = int(record["n"])
        elif kind == protocol.BACKWARD_END:
            self.open_backward = None
        elif kind == protocol.COLLECTIVE:
            self.collectives[int(record["n"])] = (record.get("op", "?"), record.get("site", "?"))
            self.open_collective = int(record["n"])
        elif kind == protocol.COLLECTIVE_END:
            self.open_collective = None
        elif kind == protocol.SAMPLER_ITER:
            self.sampler_passes.append(record)
        elif kind == protocol.SAMPLER_FED:
            self.fed_passes.add((int(record.get("sampler", -1)), int(record.get("passes", -1))))
        elif kind == protocol.PROBE_ERROR:
            self.probe_errors.append(record)
        elif kind == protocol.TENSOR_PARALLEL:
            self.tensor_parallel.append([int(r) for r in record.get("ranks", [])])
        elif kind in (protocol.STOP, protocol.EXIT, protocol.ERROR):
            self.end = record
        elif kind == protocol.HOROVOD:
            self.horovod.append(record)

    def primary_steps(self) -> list[Step]:
        return [s for s in self.steps if s.opt == 0]

    @property
    def progress(self) -> tuple[int, int, int]:
        """(optimizer steps, backward passes, collectives): what ranks in step must agree on."""
        return (len(self.primary_steps()), max(self.backward_sites, default=0), max(self.collectives, default=0))

    def where(self, root: str | None = None) -> str:
        """What the rank was last doing, from its own records."""
        steps = len(self.primary_steps())
        if self.end is not None:
            kind = self.end.get("e")
            if kind == protocol.STOP:
                return f"stopped by the probe after step {steps}"
            if kind == protocol.ERROR:
                inside = " inside DDP's construction (its parameter broadcast)" if self.open_ddp else ""
                return (f"raised {self.end.get('type')}{inside} at {short_site(self.end.get('site', '?'), root)} "
                        f"after step {steps}")
            code = self.end.get("code")
            code = 0 if code is None else code  # sys.exit() and sys.exit(None) exit with 0
            return f"the script ended (exit status {code}) after step {steps}"
        if self.open_ddp is not None:
            return f"inside DDP's construction (its parameter broadcast) at {short_site(self.open_ddp, root)} after step {steps}"
        if self.open_collective is not None:
            op, site = self.collectives[self.open_collective]
            return f"inside {op} #{self.open_collective} at {short_site(site, root)} after step {steps}"
        if self.open_backward is not None:
            site = self.backward_sites[self.open_backward]
            return f"inside backward pass #{self.open_backward} at {short_site(site, root)} after step {steps}"
        return f"running after step {steps}"


def _pairs(values: Sequence[float] | None) -> tuple[tuple[float, float], ...] | None:
    if values is None:
        return None
    return tuple(tuple(v) if v is not None else None for v in values)  # type: ignore[misc]


def _step(record: dict[str, Any]) -> Step:
    return Step(
        opt=int(record.get("opt", 0)),
        n=int(record["n"]),
        backward=int(record.get("bwd", 0)),
        collectives=int(record.get("coll", 0)),
        site=record.get("site", "?"),
        loss=tuple(record.get("loss", ())),
        inputs=_pairs(record.get("fwd", ())) or (),
        grad=_pairs(record.get("grad", ())) or (),
        param=_pairs(record.get("param", ())) or (),
        param0=_pairs(record.get("param0")),
        forwards=int(record.get("dfwd", 0)),
        hparams=tuple(record["hp"]) if isinstance(record.get("hp"), list) else None,
        clips=tuple(record.get("clip") or ()),
        scale=record.get("scale"),
        grad_placements={int(k): v for k, v in record["gpl"].items()} if isinstance(record.get("gpl"), dict) else None,
    )


@dataclass
class RunTrace:
    """All ranks of one probed run, plus what the launcher saw (the framework: "torch" or "horovod")."""

    script: str
    world_size: int
    steps_requested: int
    ranks: dict[int, RankTrace]
    framework: str = "torch"
    stall: StallReport | None = None
    timed_out: bool = False
    launch_failure: str = ""
    rank_errors: dict[int, str] = field(default_factory=dict)

    @classmethod
    def load(cls, run_dir: str | Path, script: str, world_size: int, steps_requested: int, **launcher: Any) -> RunTrace:
        ranks: dict[int, RankTrace] = {}
        for path in sorted(Path(run_dir).glob("rank*.jsonl")):
            rank = int(path.stem[4:])
            trace = RankTrace(rank)
            for record in protocol.read_records(path)[0]:
                trace.add(record)
            ranks[rank] = trace
        return cls(script=script, world_size=world_size, steps_requested=steps_requested, ranks=ranks, **launcher)

    @property
    def rank_ids(self) -> list[int]:
        return sorted(self.ranks)

    def aligned_steps(self) -> int:
        """How many primary optimizer steps every rank made in lockstep (same backward passes,
        collectives and DDP training forwards in each): beyond this, step n on one rank is not step
        n on another."""
        lists = [t.primary_steps() for t in self.ranks.values()]
        if not lists:
            return 0
        common = min(len(steps) for steps in lists)
        for i in range(common):
            if len({steps[i].made for steps in lists}) > 1:
                return i
        return common

    def parted_in_open_step(self) -> bool:
        """Whether a rank that never finished step `common + 1` had already made more backward
        passes or collectives in it than a rank that finished that step made in all of it (an extra
        collective under `if rank == 0` that blocks its rank before the step)."""
        lists = {r: t.primary_steps() for r, t in self.ranks.items()}
        if not lists:
            return False
        common = min(len(steps) for steps in lists.values())
        if self.aligned_steps() < common:
            return False
        done = [steps[common].made for steps in lists.values() if len(steps) > common]
        partial = [self.ranks[r].progress[1:] for r, steps in lists.items() if len(steps) == common]
        return any(p[0] > d[0] or p[1] > d[1] for p in partial for d in done)

    def made_by_step(self, rank: int, index: int) -> tuple[int, int, int]:
        """A rank's cumulative (backward, collectives, DDP forwards) at the end of step index+1, or
        so far when it never finished that step (the forwards of an unfinished step are not known)."""
        steps = self.ranks[rank].primary_steps()
        if index < len(steps):
            return steps[index].made
        progress = self.ranks[rank].progress
        return (progress[1], progress[2], steps[-1].forwards if steps else 0)

    def site(self, site: str) -> str:
        """A call site as the report shows it: relative to the script's folder."""
        return short_site(site, os.path.dirname(self.script))

    def horovod_records(self, what: str) -> list[tuple[int, dict[str, Any]]]:
        """(rank, record) of every Horovod record of kind `what`, rank by rank, in order."""
        return [(rank, r) for rank in self.rank_ids for r in self.ranks[rank].horovod if r.get("what") == what]

    def param_names(self, opt: int) -> list[str]:
        for rank in self.rank_ids:
            names = self.ranks[rank].optimizers.get(opt, {}).get("names")
            if names:
                return list(names)
        return []


# --- comparing values across ranks -------------------------------------------------------------


def same_value(a: Any, b: Any) -> bool:
    """Checksums equal within REL_TOL; NaN equals NaN (a NaN everywhere is in sync, if not healthy)."""
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b), 1e-30)


def group_ranks(values: dict[int, Any], equal: Callable[[Any, Any], bool] = same_value) -> list[list[int]]:
    """Ranks grouped by equal value, largest group first (ties: the group holding the lowest rank)."""
    groups: list[list[int]] = []
    for rank in sorted(values):
        for group in groups:
            if equal(values[group[0]], values[rank]):
                group.append(rank)
                break
        else:
            groups.append([rank])
    return sorted(groups, key=lambda g: (-len(g), g[0]))


def odd_ranks(groups: list[list[int]]) -> list[int]:
    """The ranks outside the majority (with two ranks that disagree: the higher one, vs rank 0)."""
    return sorted(r for group in groups[1:] for r in group)


def describe_groups(groups: list[list[int]], show: Callable[[int], str]) -> str:
    """'rank 0: 1.5 | rank 1: 2.5' style, one entry per group."""
    parts = []
    for group in groups:
        label = "rank " + ",".join(map(str, group)) if len(group) < 4 else f"ranks {group[0]}..{group[-1]}"
        parts.append(f"{label}: {show(group[0])}")
    return " | ".join(parts)


def short_site(site: str, root: str | None = None) -> str:
    """`train.py:45` for a site in the script's folder, the path relative to the cwd otherwise."""
    path, sep, line = site.rpartition(":")
    if not sep:
        return site
    base = root or os.getcwd()
    try:
        rel = os.path.relpath(path, base)
    except ValueError:
        rel = path
    if rel.startswith(".."):
        rel = path
    return f"{rel}:{line}"


def first(iterable: Iterable[Any], default: Any = None) -> Any:
    return next(iter(iterable), default)


# --- checksums that should be equal on every rank ----------------------------------------------


@dataclass(frozen=True)
class Divergence:
    """The first place where one kind of checksum (gradients or parameters) differed across ranks."""

    opt: int
    step: int  # the optimizer's step number (1-based)
    key: str  # "param0" (before the first update), "param" (after the update), "grad" (at the step)
    params: tuple[str, ...]  # names of every parameter that differed there
    groups: list[list[int]]  # ranks grouped by the first differing parameter's checksum
    values: dict[int, Any]  # rank -> that checksum ([L1, L2] or None: no gradient)
    in_ddp: dict[str, bool | None]  # parameter -> was it in the DDP-wrapped model (None: no DDP)
    layout: str = "a replica"  # how the first differing parameter is laid out (layouts.describe)

    @property
    def when(self) -> str:
        opt = "" if self.opt == 0 else f" of optimizer #{self.opt}"
        if self.key == "param0":
            return f"at the first step{opt}, before any update"
        if self.key == "param":
            return f"after step {self.step}{opt}"
        return f"at step {self.step}{opt}"


@dataclass(frozen=True)
class Coverage:
    """Which parameters the ranks' checksums could be compared for (every optimizer)."""

    compared: tuple[str, ...]  # parameters held equal by two or more ranks
    one_copy: tuple[str, ...]  # sharded with one copy per rank: nothing to compare
    layouts: dict[str, str]  # one_copy parameter -> its layout ("S0 on a mesh of 2")

    def note(self) -> str:
        """'; 8 sharded parameters (S0 on a mesh of 2) have one copy each and were not compared'."""
        if not self.one_copy:
            return ""
        kinds = sorted(set(self.layouts.values()))
        return (f"; {len(self.one_copy)} sharded parameter(s) ({', '.join(kinds[:3])}) have one copy each and were "
                "not compared")


def optimizer_records(trace: RunTrace, opt: int) -> dict[int, dict[str, Any]]:
    return {r: trace.ranks[r].optimizers[opt] for r in trace.rank_ids if opt in trace.ranks[r].optimizers}


def coverage(trace: RunTrace) -> Coverage:
    """The parameters of every optimizer, split into compared and one-copy (see `layouts`)."""
    compared: list[str] = []
    one_copy: list[str] = []
    kinds: dict[str, str] = {}
    for opt in sorted({o for t in trace.ranks.values() for o in t.optimizers}):
        records = optimizer_records(trace, opt)
        names = trace.param_names(opt)
        for j, name in enumerate(names):
            if layouts.comparison_groups(records, j):
                compared.append(name)
            else:
                one_copy.append(name)
                kinds[name] = layouts.describe(records, j)
    return Coverage(tuple(compared), tuple(one_copy), kinds)


def first_divergence(trace: RunTrace, keys: tuple[str, ...]) -> tuple[Divergence | None, int]:
    """The earliest step where any parameter's `keys` checksum differs between ranks that must hold
    equal values of it (`layouts.comparison_groups`), and how many steps were compared. Only steps
    the ranks made in lockstep are compared (see `aligned_steps`)."""
    ranks = trace.rank_ids
    common = set.intersection(*(set(trace.ranks[r].optimizers) for r in ranks)) if ranks else set()
    aligned = trace.aligned_steps()
    compared = 0
    for opt in sorted(common):
        per_rank = {r: [s for s in trace.ranks[r].steps if s.opt == opt] for r in ranks}
        limit = min(len(steps) for steps in per_rank.values())
        if opt == 0:
            limit = min(limit, aligned)
        compared = max(compared, limit)
        names = trace.param_names(opt)
        records = optimizer_records(trace, opt)
        cache: dict[Any, list[list[int]]] = {}

        def groups_of(j: int, moved: dict[int, str | None] | None) -> list[list[int]]:
            key = (j, tuple(sorted(moved.items())) if moved else None)
            if key not in cache:
                cache[key] = layouts.comparison_groups(records, j, moved)
            return cache[key]

        for i in range(limit):
            for key in keys:
                values = {r: getattr(per_rank[r][i], key) for r in ranks}
                if any(v is None for v in values.values()):
                    continue
                count = min(len(v) for v in values.values())
                bad: list[int] = []
                first_seen: dict[int, Any] | None = None
                for j in range(count):
                    moved = None
                    if key == "grad":
                        moved = {r: (per_rank[r][i].grad_placements or {}).get(j) for r in ranks}
                        moved = moved if any(moved.values()) else None
                    for members in groups_of(j, moved):
                        picked = {r: values[r][j] for r in members}
                        if any(layouts.unreadable(v) for v in picked.values()):
                            continue
                        if len(group_ranks(picked)) > 1:
                            bad.append(j)
                            first_seen = first_seen or picked
                            break
                if not bad and all(len(v) == count for v in values.values()):
                    continue
                if not bad:
                    bad = list(range(count, max(len(v) for v in values.values())))
                    first_seen = {r: (values[r][bad[0]] if bad[0] < len(values[r]) else None) for r in ranks}
                j = bad[0]
                assert first_seen is not None
                in_ddp_flags = trace.ranks[ranks[0]].optimizers[opt].get("ddp")
                label = [names[k] if k < len(names) else f"param #{k}" for k in bad]
                return Divergence(
                    opt=opt, step=per_rank[ranks[0]][i].n, key=key, params=tuple(label),
                    groups=group_ranks(first_seen), values=first_seen,
                    in_ddp={name: (None if in_ddp_flags is None else bool(in_ddp_flags[k]))
                            for name, k in zip(label, bad) if in_ddp_flags is None or k < len(in_ddp_flags)},
                    layout=layouts.describe(records, j),
                ), compared
    return None, compared


def list_names(names: Sequence[str], limit: int = 4) -> str:
    """'a, b, c and 5 more'."""
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def fmt_checksum(value: Any) -> str:
    if value is None:
        return "no gradient"
    if isinstance(value, (list, tuple)):
        return "/".join(f"{v:.6g}" for v in value)
    return f"{value:.6g}"
