"""The stacks verdict as text or JSON, and the job-wide verdict merged from per-node JSON files."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from distdoctor import __version__
from distdoctor.probe.stacks import analysis
from distdoctor.probe.stacks.analysis import Frame, Group, RankStacks, site_text, source_line
from distdoctor.probe.stacks.live import JobStacks

SCHEMA = "distdoctor-stacks/1"


class MergeError(Exception):
    """A --merge input that cannot be read (exit status 2 in the CLI)."""


# --- text ----------------------------------------------------------------------------------------


def _who(rank: RankStacks) -> str:
    parts = [f"{rank.label:<8}", f"pid {rank.pid}"]
    if rank.rank is not None and rank.local_rank is not None:
        parts.append(f"local rank {rank.local_rank}")
    if rank.world_size is not None:
        parts.append(f"world size {rank.world_size}")
    if rank.host:
        parts.append(f"host {rank.host}")
    if rank.step is not None:
        parts.append(f"step {rank.step}")
    return "  ".join(parts)


def _stack_lines(frames: Sequence[Frame], verbose: bool) -> list[str]:
    """The user's frames with their source, and the library frame where the rank is, innermost first."""
    shown = [f for f in frames if not f.native]
    if not verbose:
        user = analysis.user_frames(shown)
        inner = shown[:1] if shown and (not user or shown[0] != user[0]) else []
        shown = inner + user[:4]
    lines = []
    for frame in shown:
        text = site_text(frame)
        source = source_line(frame) if not analysis.is_library(frame.file) or verbose else ""
        lines.append(f"{text}: {source}" if source else text)
    native = [f for f in frames if f.native and ("c10d::" in f.func or "gloo::" in f.func or "nccl" in f.func.lower())]
    if native:
        lines.insert(0, f"native: {native[0].func[:120]}")
    return lines


def _group_text(group: Group, verbose: bool) -> list[str]:
    out = [f"- {group.describe()}"]
    for rank in group.ranks:
        out.append(f"    {_who(rank)}")
        if rank.flight:
            out.append(f"      flight recorder: {rank.flight}")
        for thread, activity in rank.threads_in_collectives().items():
            where = site_text(activity.user or activity.inner)
            out.append(f"      thread {thread} waits in {activity.describe()}, from {where}")
        for pid, frames in rank.children:
            user = analysis.user_frame(frames) or (frames[0] if frames else None)
            where = site_text(user) if user else "no Python stack"
            source = source_line(user) if user else ""
            kind = "DataLoader worker" if any(f.name == "_worker_loop" for f in frames) else "child process"
            out.append(f"      {kind} pid {pid}: {where}" + (f": {source}" if source else ""))
    if group.moved and not group.in_hung_job:
        return out
    for line in _stack_lines(group.ranks[0].frames, verbose):
        out.append(f"      {line}")
    return out


def format_text(jobs: Sequence[JobStacks], duration_s: float, options_text: str, verbose: bool = False) -> str:
    blocks = []
    for job in jobs:
        verdict = job.verdict
        read = [r for r in job.ranks if r.error is None and r.samples]
        size = f" of world size {job.world_size}" if job.world_size else ""
        hosts = f" on {', '.join(job.hosts)}" if job.hosts else ""
        head = f"{job.launcher} job {job.key.split(':', 1)[-1]}: {len(read)} rank{'s' if len(read) != 1 else ''} read{size}{hosts}"
        lines = [head, ("HUNG: " if verdict.hung else "OK: ") + (verdict.headline or verdict.summary)]
        for group in verdict.groups:
            lines.extend(_group_text(group, verbose))
        for rank in verdict.unread:
            lines.append(f"- {rank.label} (pid {rank.pid}) not read: {rank.error}")
        blocks.append("\n".join(lines))
    paused = [r for job in jobs for r in job.ranks if r.native is not None]
    if paused:
        names = analysis.ranks_text([r.rank if r.rank is not None else r.pid for r in paused], paused[0].rank is None)
        stopped = f"the job was not stopped; {names} paused for one native read (--no-native: never)"
    else:
        stopped = "the job was not stopped"
    footer = f"read in {duration_s:.1f} s ({options_text}); {stopped}"
    return "\n\n".join(blocks + [footer])


# --- JSON ----------------------------------------------------------------------------------------


def _frames_json(frames: Sequence[Frame]) -> list[dict[str, Any]]:
    out = []
    for frame in frames:
        item = frame.to_json()
        steps = [(n, v) for n, v in frame.locals if n in analysis.STEP_NAMES]
        if steps:
            item["locals"] = dict(steps)
        out.append(item)
    return out


def _frames_from(data: Any) -> list[Frame]:
    frames = []
    for item in data:
        frame = Frame.from_json(item)
        local = item.get("locals") or {}
        frames.append(Frame(frame.func, frame.file, frame.line, tuple((str(k), str(v)) for k, v in local.items()), frame.native))
    return frames


def _activity_json(activity: analysis.Activity) -> dict[str, Any]:
    return {"kind": activity.kind, "op": activity.op, "via": activity.via, "describe": activity.describe(),
            "user": site_text(activity.user) if activity.user else None,
            "source": source_line(activity.user) or None,
            "inner": site_text(activity.inner) if activity.inner else None}


def rank_json(rank: RankStacks) -> dict[str, Any]:
    out: dict[str, Any] = {"pid": rank.pid, "rank": rank.rank, "local_rank": rank.local_rank,
                           "world_size": rank.world_size, "host": rank.host, "error": rank.error,
                           "error_kind": rank.error_kind, "flight_recorder": rank.flight}
    if rank.samples:
        guard = analysis.guard_of(rank.frames)
        out.update({
            "step": rank.step, "progressing": rank.moved, "activity": _activity_json(rank.activity),
            "guard": guard[1].describe() if guard else None,
            "active": rank.active, "samples": [_frames_json(s) for s in rank.samples],
            "threads": {name: _frames_json(frames) for name, frames in rank.other_threads.items()},
            "native": _frames_json(rank.native) if rank.native is not None else None,
            "children": [{"pid": pid, "frames": _frames_json(frames)} for pid, frames in rank.children],
        })
    return out


def rank_from_json(data: dict[str, Any]) -> RankStacks:
    rank = RankStacks(int(data["pid"]), _opt_int(data.get("rank")), _opt_int(data.get("local_rank")),
                      _opt_int(data.get("world_size")), str(data.get("host") or ""))
    rank.samples = [_frames_from(s) for s in data.get("samples") or []]
    rank.active = [None if a is None else bool(a) for a in data.get("active") or []]
    rank.native = _frames_from(data["native"]) if data.get("native") is not None else None
    rank.other_threads = {str(name): _frames_from(frames) for name, frames in (data.get("threads") or {}).items()}
    rank.children = [(int(c["pid"]), _frames_from(c.get("frames") or [])) for c in data.get("children") or []]
    rank.error, rank.error_kind = data.get("error"), data.get("error_kind")
    rank.flight = data.get("flight_recorder")
    return rank


def _opt_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _group_json(group: Group) -> dict[str, Any]:
    return {"ranks": [r.rank if r.rank is not None else r.pid for r in group.ranks],
            "pids": [r.pid for r in group.ranks], "summary": group.describe(), "progressing": group.moved,
            "activity": _activity_json(group.activity),
            "guard": group.guard_text()}


def job_json(job: JobStacks) -> dict[str, Any]:
    verdict = job.verdict
    return {"key": job.key, "launcher": job.launcher, "world_size": job.world_size, "hosts": job.hosts,
            "agents": job.agents, "hung": verdict.hung, "summary": verdict.summary,
            "groups": [_group_json(g) for g in verdict.groups],
            "ranks": [rank_json(r) for r in job.ranks]}


def format_json(jobs: Sequence[JobStacks], duration_s: float, sampler_info: dict[str, Any], errors: Sequence[str] = ()) -> str:
    return json.dumps({
        "tool": "distdoctor", "command": "stacks", "schema": SCHEMA, "version": __version__,
        "duration_s": round(duration_s, 2), "sampler": sampler_info,
        "hung": any(j.verdict.hung for j in jobs), "errors": list(errors),
        "jobs": [job_json(j) for j in jobs],
    }, indent=2)


# --- merge ---------------------------------------------------------------------------------------


def load_merge(paths: Sequence[str]) -> list[JobStacks]:
    """Per-node `--format json` outputs -> one JobStacks per job, with the ranks of every node."""
    jobs: dict[str, JobStacks] = {}
    seen: dict[tuple[str, int], str] = {}
    for path in paths:
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise MergeError(f"cannot read {path}: {exc.strerror or exc}") from None
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise MergeError(f"{path} is not JSON ({exc}); give the output of `distdoctor stacks --format json`") from None
        if not isinstance(data, dict) or data.get("command") != "stacks" or not isinstance(data.get("jobs"), list):
            raise MergeError(f"{path} is not the output of `distdoctor stacks --format json`")
        try:
            for raw in data["jobs"]:
                job = jobs.setdefault(raw["key"], JobStacks(raw["key"], raw["launcher"], [], raw.get("world_size")))
                if raw.get("world_size") and not job.world_size:
                    job.world_size = raw["world_size"]
                for raw_rank in raw["ranks"]:
                    rank = rank_from_json(raw_rank)
                    where = (rank.host, rank.pid)
                    if where in seen:
                        raise MergeError(f"pid {rank.pid} on host {rank.host or '?'} is in both {seen[where]} and {path}: "
                                         "give each node's file once")
                    seen[where] = path
                    job.ranks.append(rank)
                    if rank.host and rank.host not in job.hosts:
                        job.hosts.append(rank.host)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise MergeError(f"{path}: unexpected content ({type(exc).__name__}: {exc}); "
                             "give the output of `distdoctor stacks --format json`") from None
    for job in jobs.values():
        job.ranks.sort(key=lambda r: (r.rank if r.rank is not None else 1 << 30, r.host, r.pid))
    if not jobs:
        raise MergeError("the merged files hold no job")
    return list(jobs.values())
