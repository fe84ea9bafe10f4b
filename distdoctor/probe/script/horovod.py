"""`distdoctor probe train_hvd.py --framework horovod`: a Horovod script, unchanged, under horovodrun.

The same instrumentation and checks as for torchrun scripts (`distdoctor.probe.script.launcher`,
`probes/script/*`); what differs is the launcher (`horovodrun -np N --gloo`, through
`distdoctor.probe.builtin.horovod.launch_horovod`) and the Horovod hooks on the rank side
(`distdoctor.probe.script.horovod_hooks`), whose records sharpen two verdicts:
- `grad-sync` fails when the script changed gradients (clipping) while Horovod was still
  all-reducing them, before `optimizer.synchronize()`;
- `param-sync`, when parameters differ at the first step, says whether `hvd.broadcast_parameters`
  was called at all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from distdoctor.probe.builtin.horovod import launch_horovod, require_horovod
from distdoctor.probe.script import protocol
from distdoctor.probe.launch.torchrun import LaunchError, LaunchResult, LaunchSpec
from distdoctor.probe.report import CheckResult, Report
from distdoctor.probe.script.launcher import observe_script, overhead, run_checks
from distdoctor.probe.script.records import RunTrace

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
    require_horovod()
    if spec.nnodes > 1:
        raise LaunchError("Horovod scripts are probed on one node (horovodrun -np N); drop --nnodes")
    run = observe_script(script, script_args, spec, steps=steps, framework="horovod", start_ranks=_start_horovodrun,
                         judge=_judge, log_file=log_file, keep_run_dir=keep_run_dir)
    return Report(mode="script", backend="gloo", world_size=spec.nproc, duration_s=run.duration_s, checks=run.checks,
                  extra={"script": run.script, "steps": steps, "framework": "horovod", "launcher": "horovodrun",
                         "overhead": overhead(run.trace), "interrupted": run.launch.interrupted})


def _start_horovodrun(spec: LaunchSpec, target: Sequence[str], *, echo: bool) -> LaunchResult:
    # horovodrun does not set WORLD_SIZE, which the instrumentation's start record reads.
    env = {**spec.env, "WORLD_SIZE": str(spec.nproc)}
    return launch_horovod(spec.nproc, target, timeout_s=spec.timeout_s, env=env, echo=echo)


def _judge(trace: RunTrace, run_dir: Path) -> tuple[CheckResult, ...]:
    events = horovod_events(run_dir)
    return tuple(sharpen(check, events, trace.site) for check in run_checks(trace))


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
