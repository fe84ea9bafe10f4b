"""`distdoctor probe --framework horovod`: Horovod's own launcher, the same check ids as for DDP.

Ranks are started by `horovodrun -np N --gloo` (Gloo controller, CPU), bounded by a wall-clock limit;
on timeout or Ctrl-C every process horovodrun started is stopped (horovodrun starts each rank in a
session of its own: `distdoctor.probe.launch.torchrun.run_process_tree`, the runner torchrun launches use too).

The built-in probe runs `distdoctor.probe.builtin.horovod_worker` on every rank and judges what the ranks wrote:
- `env`: Horovod, torch and the controller each rank runs with;
- `grad-sync`: after one backward through `hvd.DistributedOptimizer` and `synchronize()`, gradients
  are equal across ranks and equal to the single-process gradient of the global batch;
- `param-sync`: parameter checksums (and the optimizer's momentum buffers) equal across ranks after
  `broadcast_parameters` / `broadcast_optimizer_state` and after every step;
- `convergence`: every rank's loss curve follows the single-process reference trained on the global
  batch at Horovod's documented learning rate, `lr * hvd.size()`, and the loss falls.

Nothing here imports torch or horovod: the launcher process only reads JSON.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from distdoctor.probe.launch.torchrun import (
    LaunchError,
    LaunchResult,
    last_traceback,
    run_process_tree,
)
from distdoctor.probe.report import CheckResult, Report

INSTALL_HINT = "run scripts/install-horovod.sh (it builds Horovod 0.28.1 with PyTorch and Gloo for the installed torch)"
BUILTIN_CHECKS = ("env", "grad-sync", "param-sync", "convergence")
# A healthy run differs from the single-process reference by float rounding only (about 1e-7 here).
GRAD_RTOL = 1e-4
LOSS_RTOL = 1e-3
# The loss must fall at least this much over the run (last / first of the reference-following curve).
LOSS_FALL = 0.8


class HorovodUnavailable(LaunchError):
    """Horovod (with PyTorch support) or horovodrun is missing: the message says how to install it."""


def horovod_missing_reason() -> str | None:
    """Why Horovod cannot be used here, or None when `horovod.torch` and `horovodrun` are available.

    Only files are looked at: importing `horovod.torch` loads torch and Horovod's extension, which
    the launcher process must not do.
    """
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "Horovod is not installed"
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if not list((package_dir / "torch").glob("mpi_lib_v2*.so")):
        return f"Horovod at {package_dir} was built without PyTorch support (no horovod/torch/mpi_lib_v2*.so)"
    if horovodrun_path() is None:
        return "horovodrun is not on PATH"
    return None


def require_horovod() -> None:
    """Raise `HorovodUnavailable` with the reason and the install command when Horovod is missing."""
    reason = horovod_missing_reason()
    if reason is not None:
        raise HorovodUnavailable(f"{reason}: {INSTALL_HINT}")


def horovodrun_path() -> str | None:
    """horovodrun next to this interpreter (a virtual environment's bin/) or else on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("horovodrun")


# --- launch ---------------------------------------------------------------------------------------


def horovodrun_command(nproc: int, target: Sequence[str], *, timeout_s: float = 120.0) -> list[str]:
    """`horovodrun -np N --gloo ... python TARGET`: the command a user could also run by hand.

    `target` is `["script.py", *args]` or `["-m", "pkg.mod", *args]`, run by this interpreter.
    """
    if nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {nproc}")
    if not target:
        raise LaunchError("nothing to launch: the target is empty")
    runner = horovodrun_path()
    if runner is None:
        raise HorovodUnavailable(f"horovodrun is not on PATH: {INSTALL_HINT}")
    start_timeout = max(10, int(timeout_s * 0.5))
    return [
        runner,
        "-np", str(nproc),
        "-H", f"localhost:{nproc}",
        "--gloo",
        "--start-timeout", str(start_timeout),
        "--gloo-timeout-seconds", str(start_timeout),
        sys.executable,
        *target,
    ]  # fmt: skip


def launch_horovod(
    nproc: int,
    target: Sequence[str],
    *,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    echo: bool = False,
) -> LaunchResult:
    """Run `target` on `nproc` local ranks through horovodrun and wait, at most `timeout_s`.

    A collective that stalls is shut down by Horovod itself after about half the wall clock
    (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS), so the stalled rank's error reaches the report.
    """
    require_horovod()
    logs = Path(tempfile.mkdtemp(prefix="distdoctor-horovod-"))
    cmd = horovodrun_command(nproc, target, timeout_s=timeout_s)
    cmd[1:1] = ["--output-filename", str(logs)]
    full_env = dict(os.environ)
    # Ranks import distdoctor from wherever this process imported it, installed or not.
    package_root = str(Path(__file__).resolve().parent.parent)
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    stall_s = max(5, int(timeout_s * 0.4))
    full_env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(2, stall_s // 2)))
    full_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(stall_s))
    full_env.update(env or {})
    try:
        run = run_process_tree(cmd, full_env, timeout_s, echo=echo)
        rank_exitcodes = _exitcodes(run.output, run.returncode, run.timed_out or run.interrupted)
        return LaunchResult.of(run, rank_exitcodes, _rank_errors(logs), "horovodrun")
    finally:
        shutil.rmtree(logs, ignore_errors=True)


_EXIT_LINE = re.compile(r"^Process (?P<rank>\d+) exit with status code (?P<code>-?\d+)\.", re.MULTILINE)


def _exitcodes(output: str, returncode: int, stopped: bool) -> dict[int, int]:
    codes = {int(m["rank"]): int(m["code"]) for m in _EXIT_LINE.finditer(output)}
    if returncode == 0 and not stopped:
        ranks = {int(r) for r in re.findall(r"^\[(\d+)\]<std", output, re.MULTILINE)}
        codes.update({rank: 0 for rank in ranks})
    return codes


def _rank_errors(logs: Path) -> dict[int, str]:
    """The last traceback in each rank's stderr (horovodrun --output-filename: rank.N/stderr)."""
    errors: dict[int, str] = {}
    for rank_dir in logs.glob("rank.*"):
        try:
            rank = int(rank_dir.name.split(".", 1)[1])
        except ValueError:
            continue
        text = last_traceback(rank_dir / "stderr")
        if text:
            errors[rank] = text
    return errors


# --- built-in probe -------------------------------------------------------------------------------


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
    check can fail). `checks` limits the report to those ids. Raises `HorovodUnavailable` (a
    `LaunchError`, exit 2 in the CLI) when Horovod is not installed.
    """
    from distdoctor.probe.builtin.horovod_worker import FAULTS

    if fault not in FAULTS:
        raise LaunchError(f"unknown Horovod fault {fault!r}; known: {', '.join(sorted(FAULTS))}")
    wanted = tuple(checks) if checks else BUILTIN_CHECKS
    unknown = [c for c in wanted if c not in BUILTIN_CHECKS]
    if unknown:
        raise LaunchError(f"no Horovod check {', '.join(unknown)}; Horovod runs {', '.join(BUILTIN_CHECKS)}")
    require_horovod()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="distdoctor-hvd-out-") as out:
        target = ["-m", "distdoctor.probe.builtin.horovod_worker", "--out", out, "--steps", str(steps), "--fault", fault]
        result = launch_horovod(nproc, target, timeout_s=timeout_s, echo=echo)
        evidence = _read_evidence(Path(out), nproc)
    results = judge_builtin(evidence, nproc, result)
    return Report(
        mode="builtin",
        backend="gloo",
        world_size=nproc,
        duration_s=time.monotonic() - started,
        checks=tuple(r for r in results if r.id in wanted),
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


def judge_builtin(evidence: Mapping[int, Mapping[str, Any]], nproc: int, launch: LaunchResult) -> list[CheckResult]:
    """The verdict of every built-in check from what the ranks wrote (pure: no processes, no torch)."""
    missing = [rank for rank in range(nproc) if rank not in evidence or "error" in evidence[rank]]
    if missing:
        return [_launch_error(check_id, missing, evidence, launch) for check_id in BUILTIN_CHECKS]
    return [
        _env(evidence),
        _grad_sync(evidence),
        _param_sync(evidence),
        _convergence(evidence),
    ]


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
    return CheckResult(
        id=check_id,
        status="error",
        summary=summary,
        ranks=ranks,
        details={"output_tail": launch.output[-4000:]},
    )


def _env(evidence) -> CheckResult:
    ranks = {
        str(rank): {"horovod": ev.get("horovod"), "torch": ev.get("torch"), "controller": "gloo", "size": ev.get("size")}
        for rank, ev in sorted(evidence.items())
    }
    sizes = {ev.get("size") for ev in evidence.values()}
    if len(sizes) != 1 or sizes != {len(evidence)}:
        return CheckResult("env", "fail", f"ranks disagree on hvd.size(): {sorted(map(str, sizes))}", ranks)
    first = evidence[min(evidence)]
    summary = f"Horovod {first.get('horovod')} on torch {first.get('torch')}, {len(evidence)} ranks, Gloo controller"
    return CheckResult("env", "pass", summary, ranks)


def _grad_sync(evidence) -> CheckResult:
    ranks = {
        str(rank): {
            "grad_sum": ev["grad-sync"]["grad_checksum"]["sum"],
            "grad_norm": ev["grad-sync"]["grad_norm"],
            "relative_diff_vs_reference": ev["grad-sync"]["relative_diff_vs_reference"],
        }
        for rank, ev in sorted(evidence.items())
    }
    digests = {ev["grad-sync"]["grad_checksum"]["sha1"] for ev in evidence.values()}
    worst = max(ev["grad-sync"]["relative_diff_vs_reference"] for ev in evidence.values())
    details = {"relative_tolerance": GRAD_RTOL, "worst_relative_diff": worst, "when": "after synchronize(), step 0"}
    if len(digests) > 1:
        sums = ", ".join(f"rank {r}: {ev['grad-sync']['grad_checksum']['sum']:.6g}" for r, ev in sorted(evidence.items()))
        return CheckResult("grad-sync", "fail", f"gradients differ across ranks after synchronize() ({sums})", ranks, details)
    if worst > GRAD_RTOL:
        return CheckResult(
            "grad-sync",
            "fail",
            f"averaged gradient differs from the single-process gradient of the global batch by {worst:.2g} "
            f"(relative, tolerance {GRAD_RTOL:g})",
            ranks,
            details,
        )
    return CheckResult(
        "grad-sync",
        "pass",
        f"gradients equal on {len(evidence)} ranks and match the single-process gradient (rel. diff {worst:.1g})",
        ranks,
        details,
    )


def _param_sync(evidence) -> CheckResult:
    ordered = sorted(evidence.items())
    sums = {str(rank): [c["sum"] for c in ev["param-sync"]["param_checksums"]] for rank, ev in ordered}
    ranks = {
        str(rank): {
            "param_sum_start": sums[str(rank)][0],
            "param_sum_end": sums[str(rank)][-1],
            "optimizer_state_sum": ev["param-sync"]["optimizer_state_checksum"]["sum"],
        }
        for rank, ev in ordered
    }
    series = [[c["sha1"] for c in ev["param-sync"]["param_checksums"]] for _, ev in ordered]
    steps = min(len(s) for s in series)
    first_diff = next((i for i in range(steps) if len({s[i] for s in series}) > 1), None)
    states = {ev["param-sync"]["optimizer_state_checksum"]["sha1"] for _, ev in ordered}
    details = {"checkpoints": steps, "first_differing": first_diff, "param_sums_per_rank": sums}
    if first_diff is not None:
        when = "at the start (after the broadcasts)" if first_diff == 0 else f"after step {first_diff}"
        values = ", ".join(f"rank {r}: {sums[str(r)][first_diff]:.6g}" for r, _ in ordered)
        hint = ": was hvd.broadcast_parameters called?" if first_diff == 0 else ""
        return CheckResult("param-sync", "fail", f"parameters differ across ranks {when} ({values}){hint}", ranks, details)
    if len(states) > 1:
        return CheckResult(
            "param-sync",
            "fail",
            "optimizer state (momentum buffers) differs across ranks at the start: was hvd.broadcast_optimizer_state called?",
            ranks,
            details,
        )
    return CheckResult(
        "param-sync",
        "pass",
        f"parameters and optimizer state equal on {len(ordered)} ranks at the start and after each of {steps - 1} steps",
        ranks,
        details,
    )


def _convergence(evidence) -> CheckResult:
    ranks: dict[str, Any] = {}
    loss_per_rank: dict[str, list[float]] = {}
    worst, worst_rank, worst_step = 0.0, None, None
    reference: list[float] = []
    for rank, ev in sorted(evidence.items()):
        conv = ev["convergence"]
        losses, reference = conv["losses"], conv["reference_losses"]
        scale = max(abs(reference[0]), 1e-12)
        devs = [abs(a - b) / scale for a, b in zip(losses, reference)]
        step = max(range(len(devs)), key=devs.__getitem__) if devs else 0
        ranks[str(rank)] = {"lr": ev["lr"], "max_relative_deviation": devs[step] if devs else 0.0,
                            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None}
        loss_per_rank[str(rank)] = losses
        if devs and devs[step] > worst:
            worst, worst_rank, worst_step = devs[step], rank, step
    first = next(iter(evidence.values()))
    details = {
        "loss_per_rank": loss_per_rank,  # the names distdoctor.probe.plots draws
        "reference_loss": reference,
        "reference": "single process, global batch, lr * hvd.size(), clipping of the averaged gradient",
        "scaled_lr": first["scaled_lr"],
        "relative_tolerance": LOSS_RTOL,
    }
    lrs = {ev["lr"] for ev in evidence.values()}
    if worst > LOSS_RTOL:
        lr_note = ""
        if lrs != {first["scaled_lr"]}:
            lr_note = f"; lr {sorted(lrs)[0]:g} is not the scaled lr {first['scaled_lr']:g} (lr x hvd.size())"
        return CheckResult(
            "convergence",
            "fail",
            f"rank {worst_rank}'s loss leaves the single-process reference at step {worst_step} "
            f"(relative deviation {worst:.2g} > {LOSS_RTOL:g}){lr_note}",
            ranks,
            details,
        )
    if reference and reference[-1] > LOSS_FALL * reference[0]:
        return CheckResult("convergence", "fail", "the loss does not fall over the run", ranks, details)
    return CheckResult(
        "convergence",
        "pass",
        f"loss follows the single-process reference within {worst:.1g} (relative) and falls "
        f"{reference[0]:.3g} -> {reference[-1]:.3g}",
        ranks,
        details,
    )
