"""`distdoctor probe SCRIPT`: run the user's unchanged training script under torchrun, observed by
`distdoctor.probe.script`, and judge it check by check (`probes/script/*`).

How the pieces meet:
- torchrun starts `-m distdoctor.probe.script.run SCRIPT ARGS` on every rank (the launcher is
  `distdoctor.probe.launch.torchrun`); the run directory, the step budget and the framework travel in the
  environment (`instrument.protocol`).
- Each rank appends its observations to `<run dir>/rank<R>.jsonl`. Ranks are compared here, from
  those files, never with a collective: a desynchronised job is diagnosed, not made worse. Files
  rather than a TCP store because they survive a rank being killed and need no extra port; a
  multi-node run needs the run directory on a shared filesystem (`DISTDOCTOR_RUN_DIR`).
- While the job runs, `script_watch.StallWatcher` follows the files and ends a stalled job.

`observe_script` is that whole run for any launcher: `distdoctor.probe.script.horovod` calls it with
horovodrun and adds what the Horovod records say.
"""

from __future__ import annotations

import importlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distdoctor.probe.script import protocol
from distdoctor.probe.launch.torchrun import LaunchError, LaunchResult, LaunchSpec, launch
from distdoctor.probe.report import CheckResult, Report
from distdoctor.probe.script.records import RunTrace
from distdoctor.probe.script.watch import StallWatcher

# One module per check, in report order (each has ID and run(trace) -> CheckResult).
CHECK_MODULES = ("param_sync", "grad_sync", "epoch_shuffle", "data_shard", "desync", "loss", "hparams")
CHECK_IDS = ("param-sync", "grad-sync", "epoch-shuffle", "data-shard", "desync", "loss", "hparams")
FRAMEWORKS = ("torch", "horovod")


@dataclass(frozen=True)
class ScriptRun:
    """What one observed run of a script gave: the launch, the ranks' trace and the checks' verdicts."""

    script: str  # absolute path
    launch: LaunchResult
    trace: RunTrace
    checks: tuple[CheckResult, ...]
    duration_s: float


def run_script_probe(
    script: str,
    script_args: Sequence[str],
    spec: LaunchSpec,
    *,
    steps: int,
    framework: str = "torch",
    log_file: str | None = None,
    keep_run_dir: str | None = None,
) -> Report:
    """Probe `script` on `spec.nproc` ranks for `steps` optimizer steps and return the report.

    The script's output is echoed to stderr, prefixed by rank, or written to `log_file`. Raises
    `LaunchError` when the script cannot be started at all (missing file, unknown framework).
    """
    if framework not in FRAMEWORKS:
        raise LaunchError(f"unknown framework {framework!r}: choose one of {', '.join(FRAMEWORKS)}")
    if not os.path.isfile(script):
        raise LaunchError(f"no such script: {script}")
    if steps < 0:
        raise LaunchError(f"--steps must be 0 (run to the end) or more, got {steps}")
    if framework == "horovod":
        from distdoctor.probe.script.horovod import run_horovod_script_probe

        return run_horovod_script_probe(script, script_args, spec, steps=steps, log_file=log_file,
                                        keep_run_dir=keep_run_dir)
    run = observe_script(script, script_args, spec, steps=steps, framework=framework, start_ranks=launch,
                         log_file=log_file, keep_run_dir=keep_run_dir)
    backend = next((t.backend for t in run.trace.ranks.values() if t.backend), spec.backend)
    extra = {"script": run.script, "steps": steps, "overhead": overhead(run.trace),
             "interrupted": run.launch.interrupted}
    if all(c.status == "skip" for c in run.checks):
        extra["nothing_verified"] = nothing_verified(run.trace, run.checks)
    return Report(mode="script", backend=backend, world_size=spec.nproc * spec.nnodes, duration_s=run.duration_s,
                  checks=run.checks, extra=extra)


def nothing_verified(trace: RunTrace, checks: Sequence[CheckResult]) -> str:
    """Why every check was skipped, in one line: how the ranks ended, else the first skip's reason."""
    root = os.path.dirname(trace.script)
    ends = sorted({t.where(root) for t in trace.ranks.values()})
    if ends:
        return f"every check was skipped: {'; '.join(ends)}"
    return f"every check was skipped: {checks[0].summary}" if checks else "no check ran"


def observe_script(
    script: str,
    script_args: Sequence[str],
    spec: LaunchSpec,
    *,
    steps: int,
    framework: str,
    start_ranks: Callable[..., LaunchResult],
    judge: Callable[[RunTrace, Path], tuple[CheckResult, ...]] | None = None,
    log_file: str | None = None,
    keep_run_dir: str | None = None,
) -> ScriptRun:
    """Run `script` on every rank, observed by `distdoctor.probe.script`, and judge what the ranks recorded.

    `start_ranks(spec, target, echo=...)` is the launcher (`distdoctor.probe.launch.torchrun.launch` for torchrun);
    `spec.env` carries the run directory, the step budget and the framework to the ranks.
    `judge(trace, run_dir)` gives the verdicts (every check of CHECK_MODULES when None); it runs
    while the ranks' records are still there: the run directory is removed afterwards unless it is
    kept (`keep_run_dir`, or `DISTDOCTOR_RUN_DIR` set by the user).
    """
    script = os.path.abspath(script)
    run_dir = Path(keep_run_dir or os.environ.get(protocol.RUN_DIR_ENV) or tempfile.mkdtemp(prefix="distdoctor-probe-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.jsonl"), *run_dir.glob("stacks*.txt")]:
        stale.unlink()
    env = {**spec.env, protocol.RUN_DIR_ENV: str(run_dir), protocol.STEPS_ENV: str(steps),
           protocol.FRAMEWORK_ENV: framework}
    watcher = StallWatcher(run_dir, script, spec.timeout_s)
    started = time.monotonic()
    watcher.start()
    try:
        result = start_ranks(replace(spec, env=env), ["-m", protocol.RUN_MODULE, script, *script_args],
                             echo=log_file is None)
    finally:
        stall = watcher.stop()
    duration = time.monotonic() - started
    if log_file:
        Path(log_file).write_text(result.output)
    try:
        trace = RunTrace.load(run_dir, script, spec.nproc * spec.nnodes, steps, stall=stall,
                              timed_out=result.timed_out, launch_failure=result.failure_message(),
                              rank_errors=result.rank_errors)
        checks = judge(trace, run_dir) if judge is not None else run_checks(trace)
    finally:
        if not keep_run_dir and protocol.RUN_DIR_ENV not in os.environ:
            shutil.rmtree(run_dir, ignore_errors=True)
    return ScriptRun(script=script, launch=result, trace=trace, checks=checks, duration_s=duration)


def run_checks(trace: RunTrace) -> tuple[CheckResult, ...]:
    """Every script check's verdict on `trace`, in report order."""
    return tuple(unobserved(_run_check(name, trace), trace) for name in CHECK_MODULES)


def unobserved(check: CheckResult, trace: RunTrace) -> CheckResult:
    """`check` as an `error` of the probe's own when a hook it relies on failed on some rank (the
    hook was disabled there, the script went on): its verdict rests on part of the run only.
    A failure found at a step the ranks made before that stands; one after it may be the missing
    records themselves (a rank whose steps stopped being recorded looks like a rank that stopped)."""
    failures = [(rank, e) for rank, t in trace.ranks.items() for e in t.probe_errors
                if check.id in protocol.OBSERVATIONS.get(e.get("what", ""), ("", ()))[1]]
    if not failures:
        return check
    rank, first = min(failures, key=lambda item: (int(item[1].get("step") or 0), item[0]))
    found_at = check.details.get("step")
    if check.status == "fail" and isinstance(found_at, int) and found_at <= int(first.get("step") or 0):
        return check
    what = protocol.OBSERVATIONS.get(first.get("what", ""), (first.get("what", "?"), ()))[0]
    ranks = sorted({r for r, _ in failures})
    summary = (f"distdoctor could not observe {what} on rank(s) {','.join(map(str, ranks))} from step "
               f"{first.get('step', 0) + 1} ({first.get('type')}: {str(first.get('message', '')).splitlines()[0][:160]}"
               f" in the probe's {first.get('hook')}); the script itself was not affected. "
               f"Before that: {check.status}: {check.summary}")
    return CheckResult(check.id, "error", summary, ranks=check.ranks,
                       details={**check.details, "probe_error": {"rank": rank, **{k: first.get(k) for k in (
                           "what", "hook", "type", "message", "step", "traceback")}}, "verdict_before": check.status})


def _run_check(module_name: str, trace: RunTrace) -> CheckResult:
    module = importlib.import_module(f"distdoctor.probes.script.{module_name}")
    try:
        return module.run(trace)
    except Exception as exc:  # a bug in one check must not hide the others' verdicts
        return CheckResult(module.ID, "error", f"the check itself failed: {type(exc).__name__}: {exc}")


def overhead(trace: RunTrace) -> dict[str, Any]:
    """Time the probe's hooks took on each rank, per step and as a share of the training time."""
    per_rank = {}
    for rank, t in trace.ranks.items():
        end = t.end or {}
        steps = int(end.get("steps") or len(t.primary_steps()))
        hook_s, train_s = float(end.get("hook_s", 0.0)), float(end.get("train_s", 0.0))
        if steps:
            per_rank[str(rank)] = {"steps": steps, "hook_ms_per_step": round(1000 * hook_s / steps, 3),
                                   "share_of_train_time": round(hook_s / train_s, 4) if train_s else None}
    shares = [v["share_of_train_time"] for v in per_rank.values() if v["share_of_train_time"] is not None]
    return {"ranks": per_rank, "max_share_of_train_time": max(shares) if shares else None}
