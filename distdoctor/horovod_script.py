"""`distdoctor probe train_hvd.py --framework horovod`: a Horovod script, unchanged, under horovodrun.

The same instrumentation and checks as for torchrun scripts (`distdoctor.script_probe`,
`probes/script/*`); what differs is the launcher (`horovodrun -np N --gloo`, through
`distdoctor.horovod_probe.launch_horovod`) and the Horovod hooks on the rank side
(`distdoctor.instrument.horovod_hooks`), whose records sharpen two verdicts:
- `grad-sync` fails when the script changed gradients (clipping) while Horovod was still
  all-reducing them, before `optimizer.synchronize()`;
- `param-sync`, when parameters differ at the first step, says whether `hvd.broadcast_parameters`
  was called at all.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from distdoctor.horovod_probe import launch_horovod, require_horovod
from distdoctor.instrument import protocol
from distdoctor.launch import LaunchError, LaunchSpec
from distdoctor.probe_report import CheckResult, Report

HOROVOD_RECORD = "hvd"  # instrument.horovod_hooks.HOROVOD, without importing torch here


def run_horovod_script_probe(
    script: str,
    script_args: Sequence[str],
    spec: LaunchSpec,
    *,
    steps: int,
    log_file: str | None = None,
    keep_run_dir: str | None = None,
) -> Report:
    """Probe a Horovod `script` on `spec.nproc` local ranks for `steps` optimizer steps.

    Raises `HorovodUnavailable` (exit 2 in the CLI) when Horovod is not installed and `LaunchError`
    for a multi-node request (horovodrun is driven on one node here).
    """
    from distdoctor.script_probe import CHECK_MODULES, _run_check, overhead
    from distdoctor.script_trace import RunTrace
    from distdoctor.script_watch import StallWatcher

    require_horovod()
    if spec.nnodes > 1:
        raise LaunchError("Horovod scripts are probed on one node (horovodrun -np N); drop --nnodes")
    script = os.path.abspath(script)
    run_dir = Path(keep_run_dir or os.environ.get(protocol.RUN_DIR_ENV) or tempfile.mkdtemp(prefix="distdoctor-hvd-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*run_dir.glob("rank*.jsonl"), *run_dir.glob("stacks*.txt")]:
        stale.unlink()
    env = {**spec.env, protocol.RUN_DIR_ENV: str(run_dir), protocol.STEPS_ENV: str(steps),
           protocol.FRAMEWORK_ENV: "horovod", "WORLD_SIZE": str(spec.nproc)}
    watcher = StallWatcher(run_dir, script, spec.timeout_s)
    started = time.monotonic()
    watcher.start()
    try:
        result = launch_horovod(spec.nproc, ["-m", protocol.RUN_MODULE, script, *script_args],
                                timeout_s=spec.timeout_s, env=env, echo=log_file is None)
    finally:
        stall = watcher.stop()
    duration = time.monotonic() - started
    if log_file:
        Path(log_file).write_text(result.output)
    try:
        trace = RunTrace.load(run_dir, script, spec.nproc, steps, stall=stall, timed_out=result.timed_out,
                              launch_failure=result.failure_message(), rank_errors=result.rank_errors)
        checks = tuple(_run_check(name, trace) for name in CHECK_MODULES)
        events = horovod_events(run_dir)
    finally:
        if not keep_run_dir and protocol.RUN_DIR_ENV not in os.environ:
            shutil.rmtree(run_dir, ignore_errors=True)
    checks = tuple(sharpen(check, events, trace.site) for check in checks)
    return Report(mode="script", backend="gloo", world_size=spec.nproc, duration_s=duration, checks=checks,
                  extra={"script": script, "steps": steps, "framework": "horovod", "launcher": "horovodrun",
                         "overhead": overhead(trace), "interrupted": result.interrupted})


def horovod_events(run_dir: Path) -> dict[int, list[dict[str, Any]]]:
    """The Horovod records of each rank (`instrument.horovod_hooks`), in order."""
    events: dict[int, list[dict[str, Any]]] = {}
    for path in sorted(run_dir.glob("rank*.jsonl")):
        records = protocol.read_records(path)[0]
        events[int(path.stem[4:])] = [r for r in records if r.get("e") == HOROVOD_RECORD]
    return events


def sharpen(check: CheckResult, events: dict[int, list[dict[str, Any]]], site: Callable[[str], str] = str) -> CheckResult:
    """A script check's verdict with what the Horovod records add to it (unchanged otherwise)."""
    if check.id == "grad-sync":
        edits = [(rank, e) for rank, evs in sorted(events.items()) for e in evs if e.get("what") == "unsynchronized_edit"]
        if edits:
            rank, first = edits[0]
            summary = (f"{first['op']} at {site(first['site'])} changed gradients Horovod was still all-reducing "
                       f"(step {first['step'] + 1}, before optimizer.synchronize()): call optimizer.synchronize(), "
                       "then clip, then optimizer.step() inside optimizer.skip_synchronize()")
            ranks = {str(r): {"unsynchronized_edits": sum(1 for rr, _ in edits if rr == r)} for r in sorted(events)}
            details = {**check.details, "unsynchronized_edits": [e for _, e in edits[:20]],
                       "checksum_verdict": {"status": check.status, "summary": check.summary}}
            return replace(check, status="fail", summary=summary, ranks={**check.ranks, **ranks}, details=details)
    if check.id == "param-sync" and check.status == "fail" and check.details.get("step") == 0:
        broadcast = {r for r, evs in events.items() if any(e.get("what") == "broadcast_parameters" for e in evs)}
        head = check.summary.split("; ", 1)[0]
        if not broadcast:
            cause = "hvd.broadcast_parameters(model.state_dict(), root_rank=0) was never called"
        else:
            cause = "changed on a rank after hvd.broadcast_parameters"
        return replace(check, summary=f"{head}; {cause}", details={**check.details, "broadcast_ranks": sorted(broadcast)})
    return check


def script_framework(path: str) -> str:
    """"horovod" when the script imports Horovod (`import horovod.torch as hvd`, `from horovod...`),
    else "torch": what `distdoctor probe SCRIPT` uses when `--framework` is not given."""
    import ast

    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError):
        return "torch"
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        if any(name == "horovod" or name.startswith("horovod.") for name in names):
            return "horovod"
    return "torch"
