"""`distdoctor probe --framework horovod`: the built-in checks under Horovod's own launcher.

Runs `distdoctor.probe.builtin.horovod_worker` on every rank through `horovodrun`
(`distdoctor.probe.launch.horovodrun`) and asks the Horovod checks of the catalog
(`distdoctor.probe.checks`, the same `env`, `grad-sync` and `param-sync` as under torchrun, and
Horovod's own `convergence`) for their verdicts on what the ranks wrote.

Nothing here imports torch or horovod: the launcher process only reads JSON.
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distdoctor.probe.checks import Check, Evidence, select_checks, select_faults
from distdoctor.probe.launch.horovodrun import launch_horovod, require_horovod
from distdoctor.probe.launch.torchrun import LaunchResult
from distdoctor.probe.report import CheckResult, Report

WORKER_MODULE = "distdoctor.probe.builtin.horovod_worker"


def run_builtin_horovod(
    *,
    nproc: int = 2,
    steps: int = 20,
    timeout_s: float = 120.0,
    fault: str = "none",
    checks: Sequence[str] | None = None,
    echo: bool = False,
) -> Report:
    """Run the built-in Horovod checks on `nproc` local ranks (Gloo, CPU) and judge them.

    `fault` plants one of `distdoctor.probe.builtin.horovod_worker.FAULTS` (the tests use it to show that each
    check can fail). `checks` limits the report to those ids. Raises `CatalogError` for an unknown
    check or fault and `HorovodUnavailable` (a `LaunchError`, exit 2 in the CLI) when Horovod is not
    installed.
    """
    from distdoctor.probe.builtin.horovod_worker import FAULTS

    select_faults(FAULTS, [fault], "builtin", "horovod")
    selected = select_checks("builtin", "horovod", checks)
    require_horovod()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distdoctor-hvd-out-") as out:
        target = ["-m", WORKER_MODULE, "--out", out, "--steps", str(steps), "--fault", fault]
        result = launch_horovod(nproc, target, timeout_s=timeout_s, echo=echo)
        evidence = _read_evidence(Path(out), nproc)
    return Report(
        mode="builtin",
        backend="gloo",
        world_size=nproc,
        duration_s=time.monotonic() - started,
        checks=judge_builtin(evidence, nproc, result, selected),
        extra={"framework": "horovod", "launcher": "horovodrun", "fault": fault},
    )


def _read_evidence(out: Path, nproc: int) -> dict[int, dict[str, Any]]:
    evidence: dict[int, dict[str, Any]] = {}
    for rank in range(nproc):
        try:
            evidence[rank] = json.loads((out / f"rank{rank}.json").read_text())
        except (OSError, ValueError):
            continue
    return evidence


def judge_builtin(evidence: Mapping[int, Mapping[str, Any]], nproc: int, launch: LaunchResult,
                  checks: Sequence[Check] | None = None) -> tuple[CheckResult, ...]:
    """The verdict of each Horovod check (all by default) on what the ranks wrote (pure: no processes, no torch).

    Each rank's file holds one evidence object per check id; a rank that left none, or an error,
    makes every check report the launch failure.
    """
    checks = tuple(checks) if checks is not None else select_checks("builtin", "horovod")
    missing = [rank for rank in range(nproc) if rank not in evidence or "error" in evidence[rank]]
    if missing:
        return tuple(_launch_error(check.id, missing, evidence, launch) for check in checks)
    return tuple(check.judge(Evidence({rank: ev.get(check.id) or {} for rank, ev in sorted(evidence.items())},
                                      nproc, "horovod"))
                 for check in checks)


def _launch_error(check_id: str, missing: list[int], evidence, launch: LaunchResult) -> CheckResult:
    ranks: dict[str, Any] = {}
    for rank in missing:
        error = (evidence.get(rank) or {}).get("error") or launch.rank_errors.get(rank, "")
        ranks[str(rank)] = {
            "exitcode": launch.rank_exitcodes.get(rank),
            "traceback": error or "no traceback: the rank was stopped or did not start",
        }
    why = launch.failure_message() or "the ranks left no evidence"
    summary = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not finish: {why}"
    return CheckResult(check_id, "error", summary, ranks, {"output_tail": launch.output[-4000:]})
