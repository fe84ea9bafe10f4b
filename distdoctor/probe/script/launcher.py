"""`distdoctor probe SCRIPT`: run the user's unchanged training script under torchrun or horovodrun,
observed by `distdoctor.probe.script`, and judge it check by check (the script checks of
`distdoctor.probe.checks`, `probes/script/*`).

How the pieces meet:
- the launcher (`distdoctor.probe.launch.torchrun`, or `launch.horovodrun` for a Horovod script)
  starts `-m distdoctor.probe.script.run SCRIPT ARGS` on every rank; the run directory, the step
  budget and the framework travel in the environment (`protocol`);
- each rank appends its observations to `<run dir>/rank<R>.jsonl` (the Horovod hooks add theirs).
  Ranks are compared here, from those files, never with a collective: a desynchronised job is
  diagnosed, not made worse. Files survive a rank being killed. On several nodes each node's
  files travel to node 0 as they grow (`distdoctor.probe.launch.relay`, beside the rendezvous, no
  shared filesystem needed), and node 0 judges the whole job;
- while the job runs, `watch.StallWatcher` follows the files and ends a stalled job;
- the records become one `RunTrace`, which carries the framework, and every selected check gives
  its verdict on it: a check that reads Horovod's records does so itself.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from distdoctor.probe.checks import FRAMEWORKS, Check, select_checks
from distdoctor.probe.launch import horovodrun
from distdoctor.probe.launch.relay import RelayOutcome, finish_relay, start_relay
from distdoctor.probe.launch.torchrun import STEPS_ENV, LaunchError, LaunchResult, LaunchSpec, launch
from distdoctor.probe.report import CheckResult, Report
from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RunTrace
from distdoctor.probe.script.watch import StallWatcher


@dataclass(frozen=True)
class ScriptRun:
    """What one observed run of a script gave: the launch, the ranks' trace and the checks' verdicts."""

    script: str  # absolute path
    launch: LaunchResult
    trace: RunTrace
    checks: tuple[CheckResult, ...]
    duration_s: float
    relay: RelayOutcome | None = None  # several nodes: what travelled to node 0


def run_script_probe(
    script: str,
    script_args: Sequence[str],
    spec: LaunchSpec,
    *,
    steps: int,
    framework: str = "torch",
    checks: Sequence[str] | None = None,
    log_file: str | None = None,
    keep_run_dir: str | None = None,
) -> Report:
    """Probe `script` on `spec.nproc` ranks for `steps` optimizer steps and return the report.

    `checks` limits the verdicts to those ids (all by default). The script's output is echoed to
    stderr, prefixed by rank, or written to `log_file`. Raises `CatalogError` for an unknown check
    id, `LaunchError` when the script cannot be started at all (missing file, unknown framework,
    Horovod missing or asked for several nodes).
    """
    if framework not in FRAMEWORKS:
        raise LaunchError(f"unknown framework {framework!r}: choose one of {', '.join(FRAMEWORKS)}")
    selected = select_checks("script", framework, checks)
    if not os.path.isfile(script):
        raise LaunchError(f"no such script: {script}")
    if steps < 0:
        raise LaunchError(f"--steps must be 0 (run to the end) or more, got {steps}")
    if framework == "horovod":
        horovodrun.require_horovod()
        if spec.nnodes > 1:
            raise LaunchError("Horovod scripts are probed on one node (horovodrun -np N); drop --nnodes")
    run = observe_script(script, script_args, spec, steps=steps, framework=framework, checks=selected,
                         log_file=log_file, keep_run_dir=keep_run_dir)
    extra: dict[str, Any] = {"script": run.script, "steps": steps}
    if framework == "horovod":
        backend = "gloo"
        extra.update(framework="horovod", launcher="horovodrun")
    else:
        backend = next((t.backend for t in run.trace.ranks.values() if t.backend), spec.backend)
    extra.update(overhead=overhead(run.trace), interrupted=run.launch.interrupted)
    if run.relay is not None and spec.node_rank != 0:
        # This node only carried its ranks' records: node 0 judges and prints the report.
        extra.update(node_rank=spec.node_rank, relayed_to=run.relay.address, relay_error=run.relay.error,
                     launch_ok=run.launch.ok, launch_failure=run.launch.failure_message())
        return Report(mode="script", backend=backend, world_size=spec.nproc * spec.nnodes,
                      duration_s=run.duration_s, checks=(), extra=extra)
    if run.relay is not None and run.relay.missing_nodes:
        extra["nodes_lost"] = [
            f"node {node}" + (f" ({run.relay.hosts[node]})" if run.relay.hosts.get(node) else "")
            + " did not finish reporting to node 0: its ranks' records end where it stopped"
            for node in run.relay.missing_nodes
        ]
    hosts = {rank: t.host for rank, t in run.trace.ranks.items() if t.host}
    checks = run.checks
    if len(set(hosts.values())) > 1:
        extra["hosts"] = ranks_per_host(hosts)
        checks = tuple(replace(check, summary=name_hosts(check.summary, hosts)) for check in checks)
    if all(c.status == "skip" for c in checks):
        extra["nothing_verified"] = nothing_verified(run.trace, checks)
    return Report(mode="script", backend=backend, world_size=spec.nproc * spec.nnodes, duration_s=run.duration_s,
                  checks=checks, extra=extra)


def _start_ranks(framework: str, spec: LaunchSpec, target: Sequence[str], *, echo: bool) -> LaunchResult:
    if framework == "horovod":
        # horovodrun does not set WORLD_SIZE, which the instrumentation's start record reads.
        env = {**spec.env, "WORLD_SIZE": str(spec.nproc)}
        return horovodrun.launch_horovod(spec.nproc, target, timeout_s=spec.timeout_s, env=env, echo=echo)
    return launch(spec, target, echo=echo)


def ranks_per_host(hosts: dict[int, str]) -> dict[str, list[int]]:
    """{host: [ranks]} in rank order."""
    grouped: dict[str, list[int]] = {}
    for rank in sorted(hosts):
        grouped.setdefault(hosts[rank], []).append(rank)
    return grouped


_RANKS_IN_TEXT = re.compile(r"\b(rank\(s\)|ranks|rank) (\d+(?:(?:, ?|,| and )\d+)*)")


def name_hosts(text: str, hosts: dict[int, str]) -> str:
    """'rank 3 differs from rank 0' -> 'rank 3 (node-b) differs from rank 0 (node-a)': on several
    hosts, every rank a finding names is named with its host."""

    def annotate(match: re.Match) -> str:
        ranks = [int(r) for r in re.findall(r"\d+", match.group(2))]
        names = sorted({hosts[r] for r in ranks if r in hosts})
        return f"{match.group(0)} ({', '.join(names)})" if names else match.group(0)

    return _RANKS_IN_TEXT.sub(annotate, text)


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
    checks: Sequence[Check] | None = None,
    log_file: str | None = None,
    keep_run_dir: str | None = None,
) -> ScriptRun:
    """Run `script` on every rank, observed by `distdoctor.probe.script`, and judge what the ranks recorded.

    `spec.env` carries the run directory, the step budget and the framework to the ranks. The
    verdicts (every script check of the framework when `checks` is None) are given while the ranks'
    records are still there: the run directory is removed afterwards unless it is kept
    (`keep_run_dir`, or `DISTDOCTOR_RUN_DIR` set by the user).
    """
    script = os.path.abspath(script)
    run_dir = Path(keep_run_dir or os.environ.get(protocol.RUN_DIR_ENV) or tempfile.mkdtemp(prefix="distdoctor-probe-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.jsonl"), *run_dir.glob("stacks*.txt")]:
        stale.unlink()
    env = {**spec.env, protocol.RUN_DIR_ENV: str(run_dir), STEPS_ENV: str(steps), protocol.FRAMEWORK_ENV: framework}
    watcher = StallWatcher(run_dir, script, spec.timeout_s)
    started = time.monotonic()
    try:
        relay = start_relay(run_dir, spec.nnodes, spec.node_rank, spec.rdzv_endpoint)
    except OSError as exc:
        raise LaunchError(str(exc)) from None
    watcher.start()
    try:
        result = _start_ranks(framework, replace(spec, env=env), ["-m", protocol.RUN_MODULE, script, *script_args],
                              echo=log_file is None)
    finally:
        stall = watcher.stop()
        relayed = finish_relay(relay, spec.nnodes, spec.node_rank) if relay is not None else None
    duration = time.monotonic() - started
    if log_file:
        Path(log_file).write_text(result.output)
    failure = result.failure_message()
    if relayed is not None and relayed.missing_nodes:
        lost = ", ".join(f"node {node}" + (f" ({relayed.hosts[node]})" if relayed.hosts.get(node) else "")
                         for node in relayed.missing_nodes)
        failure = "; ".join(filter(None, [failure, f"{lost} did not finish reporting to node 0: its records end where it stopped"]))
    try:
        trace = RunTrace.load(run_dir, script, spec.nproc * spec.nnodes, steps, framework=framework, stall=stall,
                              timed_out=result.timed_out, launch_failure=failure, rank_errors=result.rank_errors)
        # Node 0 judges the whole job; the other nodes only carried their ranks' records there.
        judged = relayed is None or spec.node_rank == 0
        selected = tuple(checks) if checks is not None else select_checks("script", framework)
        verdicts = tuple(unobserved(check.judge(trace), trace) for check in selected) if judged else ()
    finally:
        if not keep_run_dir and protocol.RUN_DIR_ENV not in os.environ:
            shutil.rmtree(run_dir, ignore_errors=True)
    return ScriptRun(script=script, launch=result, trace=trace, checks=verdicts, duration_s=duration, relay=relayed)


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
