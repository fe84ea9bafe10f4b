"""The launcher side of the built-in probe: one torchrun launch, then a verdict per check.

`run_builtin` starts `distdoctor.probe.builtin.worker` on every rank, reads back the evidence the ranks
gathered, and asks each check of the catalog (`distdoctor.probe.checks`) for its verdict. When a rank dies
or stalls, the checks it finished keep their verdicts, the check it was in reports the rank, its
last step and its traceback, and the checks never reached say so. No torch is imported here.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from distdoctor.probe.builtin.protocol import (
    CHECKS_ENV, FAULTS, FAULTS_ENV, GATHERED_FILE, OUT_DIR_ENV, WORKER_MODULE, progress_file, rank_file, ranks_phrase,
)
from distdoctor.probe.checks import Evidence, checks_of, select_checks, select_faults
from distdoctor.probe.launch.torchrun import STEPS_ENV, LaunchResult, LaunchSpec, describe_exitcode, launch
from distdoctor.probe.report import CheckResult, Report

# The pseudo-check that carries a launch that could not measure anything (exit status 2).
LAUNCH_CHECK_ID = "launch"
DEFAULT_STEPS = 10
# A traceback of a rank that was waiting on another one, not the cause of the failure.
_WAITING = re.compile(
    r"timed out|timeout|connection closed by peer|connection reset|broken pipe|DistBackendError|"
    r"DistNetworkError|watchdog|Socket Timeout",
    re.IGNORECASE,
)


def run_builtin(
    spec: LaunchSpec,
    *,
    checks: Sequence[str] | None = None,
    steps: int = DEFAULT_STEPS,
    faults: Sequence[str] = (),
    log_file: str | Path | None = None,
    echo: bool = False,
) -> Report:
    """Run the built-in checks (all by default) in one torchrun launch and return the report.

    Raises `CatalogError` for an unknown check id or fault.
    """
    ordered = tuple(check.id for check in select_checks("builtin", "torch", checks))
    select_faults(FAULTS, faults, "builtin", "torch")
    out_dir = Path(tempfile.mkdtemp(prefix="distdoctor-probe-"))
    try:
        env = {
            **spec.env,
            CHECKS_ENV: ",".join(ordered),
            FAULTS_ENV: ",".join(faults),
            STEPS_ENV: str(steps),
            OUT_DIR_ENV: str(out_dir),
            "DISTDOCTOR_BACKEND": spec.backend,
        }
        started = time.monotonic()
        result = launch(replace(spec, env=env), ["-m", WORKER_MODULE], echo=echo)
        if log_file is not None:
            Path(log_file).write_text(result.output)
        return build_report(spec, ordered, result, out_dir, time.monotonic() - started)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _evidence_by_check(out_dir: Path, world_size: int) -> dict[str, dict[int, dict]]:
    """check id -> rank -> evidence: all ranks when they gathered, else what local ranks wrote."""
    gathered = _read_json(out_dir / GATHERED_FILE)
    per_rank = {r: ev for r, ev in enumerate(gathered)} if isinstance(gathered, list) else {
        r: ev for r in range(world_size) if (ev := _read_json(rank_file(out_dir, r))) is not None
    }
    by_check: dict[str, dict[int, dict]] = {}
    for rank, evidence in per_rank.items():
        for check, data in (evidence or {}).items():
            by_check.setdefault(check, {})[rank] = data
    return by_check


def build_report(spec: LaunchSpec, checks: Sequence[str], result: LaunchResult, out_dir: Path, duration: float) -> Report:
    """Verdicts from the evidence the ranks left in `out_dir`, and a diagnosis of a failed launch."""
    world_size = spec.nproc * spec.nnodes
    evidence = _evidence_by_check(out_dir, world_size)
    progress = {r: p for r in range(world_size) if (p := _read_json(progress_file(out_dir, r))) is not None}
    finished = (evidence and len(progress) == spec.nproc and all(p.get("check") == "done" for p in progress.values()))
    # A rank that fails after "done" (a crash in interpreter teardown) changed no result.
    failure = None if result.ok or (finished and not result.timed_out and not result.interrupted) else diagnose(result, progress)
    # Launch facts travel in the details of the check that carries the failure, so the JSON keeps
    # exactly the keys of spec/probe.md.
    launch_facts = {"returncode": result.returncode, "timed_out": result.timed_out,
                    "interrupted": result.interrupted, "duration_s": round(result.duration_s, 3)}

    if failure is not None and not progress_past_start(progress):
        check = CheckResult(LAUNCH_CHECK_ID, "error", failure["summary"], failure["ranks"],
                            {"launch": launch_facts, "output_tail": result.output[-4000:]})
        return Report("builtin", spec.backend, world_size, duration, (check,))

    results: list[CheckResult] = []
    stopped_in = failure["check"] if failure and failure["check"] in checks else None
    carried = False
    for check in checks:
        ranks = evidence.get(check, {})
        if len(ranks) == world_size:
            results.append(_verdict(check, ranks, world_size))
        elif failure is not None and not carried and stopped_in in (None, check):
            results.append(CheckResult(check, "error", failure["summary"], failure["ranks"], {"launch": launch_facts}))
            carried = True  # only the first unfinished check carries the failure
        elif failure is not None:
            results.append(CheckResult(check, "skip", "not reached: the probe stopped earlier", {}, {}))
        else:
            results.append(CheckResult(check, "error", f"only {len(ranks)} of {world_size} ranks reported", {}, {}))
    if failure is not None and not carried:
        results.append(CheckResult(LAUNCH_CHECK_ID, "error", failure["summary"], failure["ranks"], {"launch": launch_facts}))
    return Report("builtin", spec.backend, world_size, duration, tuple(results))


def _verdict(check: str, ranks: dict[int, dict], world_size: int) -> CheckResult:
    (found,) = select_checks("builtin", "torch", [check])
    return found.judge(Evidence(ranks, world_size, "torch"))


def progress_past_start(progress: dict[int, dict]) -> bool:
    """True when some rank got past process-group initialisation into the checks."""
    return any(p.get("check") not in (None, "init") for p in progress.values())


def _where(progress: dict | None) -> str:
    if not progress:
        return "before its first check"
    step = progress.get("step")
    return f"in {progress['check']}" + (f" at step {step}" if step is not None else "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


def diagnose(result: LaunchResult, progress: dict[int, dict]) -> dict[str, Any]:
    """Name the rank that made the launch fail: the one that died, else the one that stalled.

    A rank whose traceback shows it timed out or lost its peer in a collective was waiting on
    another rank; a rank killed by a signal without a traceback while others waited stalled.
    """
    ranks: dict[str, Any] = {}
    for rank in sorted(set(result.rank_exitcodes) | set(result.rank_errors) | set(progress)):
        entry: dict[str, Any] = {"last": _where(progress.get(rank))}
        if rank in result.rank_exitcodes:
            entry["exit"] = describe_exitcode(result.rank_exitcodes[rank])
        if rank in result.rank_errors:
            entry["traceback"] = result.rank_errors[rank]
        ranks[str(rank)] = entry
    died = [r for r, tb in sorted(result.rank_errors.items()) if not _WAITING.search(tb)]
    waited = [r for r, tb in sorted(result.rank_errors.items()) if _WAITING.search(tb)]
    killed = [r for r, code in sorted(result.rank_exitcodes.items()) if code < 0 and r not in result.rank_errors]

    def check_of(rank: int) -> str | None:
        p = progress.get(rank)
        return p.get("check") if p else None

    if died:
        rank = died[0]
        summary = f"rank {rank} died {_where(progress.get(rank))}: {_last_line(result.rank_errors[rank])}"
        culprit = rank
    elif waited and killed:
        rank = killed[0]
        summary = (f"rank {rank} stalled {_where(progress.get(rank))}; {ranks_phrase(waited)} "
                   "timed out waiting for it in a collective")
        culprit = rank
    elif result.timed_out or result.interrupted:
        cause = "interrupted" if result.interrupted else f"no result within the {result.duration_s:.0f} s wall clock"
        behind = _ranks_behind(progress)
        if len(behind) == 1:
            summary = f"{cause}; rank {behind[0]} is behind the others, {_where(progress[behind[0]])}"
        elif behind:
            summary = f"{cause}; {ranks_phrase(behind)} stopped {_where(progress[behind[0]])}"
        else:
            summary = cause
        culprit = behind[0] if len(behind) == 1 else None
    else:
        summary = result.failure_message()
        culprit = waited[0] if waited else None
    where = culprit if culprit is not None else next(iter(_ranks_behind(progress)), None)
    return {"summary": summary, "ranks": ranks, "rank": culprit, "check": check_of(where) if where is not None else None}


def _ranks_behind(progress: dict[int, dict]) -> list[int]:
    """The ranks whose last recorded position (check, step) is the earliest of all."""
    ids = [check.id for check in checks_of("builtin", "torch")]
    order = {check: i for i, check in enumerate(("init", *ids, "gather", "done"))}

    def position(rank: int) -> tuple[int, int]:
        p = progress[rank]
        return order.get(p.get("check"), -1), p.get("step") or 0

    if not progress:
        return []
    earliest = min(position(r) for r in progress)
    return sorted(r for r in progress if position(r) == earliest)
