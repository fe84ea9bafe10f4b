"""`distdoctor probe`: parse the options, pick the probe, print the report, set the exit status.

Importing this module must not import torch (the CLI starts fast; only ranks need torch).
Exit status: 0 no check fails, 1 a check fails, 2 usage or launch error, 130 interrupted.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

import click

from distdoctor.probe.checks import CatalogError, select_checks, select_faults
from distdoctor.probe.launch.torchrun import LaunchError, LaunchSpec
from distdoctor.probe.report import Report

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130
DEFAULT_NPROC = 2
DEFAULT_SCRIPT_STEPS = 20


class ProbeUnavailable(Exception):
    """A probe mode whose code or dependency is not installed (exit status 2)."""


def count_visible_gpus(*, allow_torch: bool) -> int:
    """GPUs this process may use, without initialising CUDA here.

    `nvidia-smi -L` (restricted by CUDA_VISIBLE_DEVICES) when it exists; otherwise, only when the
    answer matters (`allow_torch`), `torch.cuda.device_count()`, which reads NVML and does not
    create a CUDA context.
    """
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30).stdout
        except (OSError, subprocess.SubprocessError):
            listing = ""
        count = sum(1 for line in listing.splitlines() if line.startswith("GPU "))
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None:
            ids = [d for d in visible.split(",") if d.strip()]
            ids = ids[: ids.index("-1")] if "-1" in ids else ids
            count = min(count, len(ids))
        return count
    if allow_torch:
        try:
            import torch
        except ImportError:
            return 0
        return torch.cuda.device_count()
    return 0


def resolve_spec(
    *,
    gpus: int | None,
    nproc: int | None,
    backend: str | None,
    nnodes: int,
    node_rank: int,
    rdzv_endpoint: str | None,
    timeout: float,
) -> LaunchSpec:
    """The LaunchSpec the options ask for; raises click.UsageError (exit 2) when they cannot work."""
    if gpus is not None and nproc is not None:
        raise click.UsageError("give --gpus N (NCCL, one GPU per rank) or --nproc N (CPU ranks), not both")
    if gpus is not None or backend == "nccl":
        wanted = gpus if gpus is not None else (nproc or 1)
        seen = count_visible_gpus(allow_torch=True)
        if seen < wanted:
            instead = f"--gpus {seen}" if seen else "no GPU option"
            raise click.UsageError(
                f"{wanted} GPU(s) asked for but {seen} visible: run with {instead}, or with "
                f"--nproc {wanted} --backend gloo for {wanted} CPU ranks"
            )
        return LaunchSpec(wanted, backend or "nccl", nnodes, node_rank, rdzv_endpoint, timeout)
    if nproc is None and backend is None:
        seen = count_visible_gpus(allow_torch=False)
        if seen:
            return LaunchSpec(seen, "nccl", nnodes, node_rank, rdzv_endpoint, timeout)
    return LaunchSpec(nproc or DEFAULT_NPROC, backend or "gloo", nnodes, node_rank, rdzv_endpoint, timeout)


def _optional_module(name: str, what: str):
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (name, name.rpartition(".")[0]):
            raise
        raise ProbeUnavailable(f"{what} is not available in this distdoctor installation ({name} is missing)") from None


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        # Checked without importing torch: otherwise torchrun itself fails to start.
        raise ProbeUnavailable(
            "torch is not installed in this environment: the probe launches real trainings. "
            "Install torch for your platform, then `pip install 'distdoctor[probe]'`"
        )


def dispatch(
    script: str | None,
    script_args: Sequence[str],
    spec: LaunchSpec,
    *,
    framework: str,
    steps: int | None,
    checks: Sequence[str] | None,
    faults: Sequence[str],
    log_file: str | None,
    echo: bool,
) -> Report:
    """Run the probe the options select: a user's script, the Horovod built-in, or the torch built-in.

    What the user asked for is refused first (Horovod, a probe module, several nodes where one is
    the limit), torch's absence last: the most specific reason wins.
    """
    if framework == "horovod":
        from distdoctor.probe.launch.horovodrun import require_horovod

        require_horovod()  # HorovodUnavailable names scripts/install-horovod.sh (exit 2)
    if script is not None:
        module = _optional_module("distdoctor.probe.script.launcher", "the script probe")
        _require_torch()
        return module.run_script_probe(script, list(script_args), spec, steps=steps or DEFAULT_SCRIPT_STEPS,
                                       framework=framework, checks=checks, log_file=log_file)
    if framework == "horovod":
        module = _optional_module("distdoctor.probe.builtin.horovod", "the Horovod built-in probe")
        if spec.nnodes > 1:
            raise ProbeUnavailable("the Horovod built-in probe runs on one node (horovodrun -np N)")
        _require_torch()
        return module.run_builtin_horovod(nproc=spec.nproc, steps=steps or DEFAULT_SCRIPT_STEPS,
                                          timeout_s=spec.timeout_s, fault=faults[0] if faults else "none",
                                          checks=checks, echo=echo)
    module = _optional_module("distdoctor.probe.builtin.launcher", "the built-in probe")
    _require_torch()
    return module.run_builtin(spec, checks=checks, steps=steps or module.DEFAULT_STEPS, faults=faults,
                              log_file=log_file, echo=echo)


def validate_selection(script: str | None, framework: str, checks: Sequence[str] | None,
                       faults: Sequence[str]) -> None:
    """Refuse unknown check ids and faults for the probe the options select (`CatalogError`)."""
    probe = "script" if script is not None else "builtin"
    select_checks(probe, framework, checks)
    if faults and script is not None:
        raise CatalogError("--inject plants faults in the built-in probe only; a script's faults are its own")
    if len(faults) > 1 and framework == "horovod":
        raise CatalogError("the Horovod built-in probe plants one fault at a time")
    if faults:
        if framework == "horovod":
            from distdoctor.probe.builtin.horovod_worker import FAULTS
        else:
            from distdoctor.probe.builtin.protocol import FAULTS
        select_faults(FAULTS, faults, probe, framework)


def exit_status(report: Report) -> int:
    """0 when no check fails, 1 when one does, 2 when the launch itself failed or every check was
    skipped (nothing verified), 130 when interrupted. A node other than node 0 judges nothing: 0 when
    its ranks ran and their records reached node 0."""
    if "relayed_to" in report.extra:
        if report.extra.get("interrupted"):
            return EXIT_INTERRUPTED
        return EXIT_OK if report.extra.get("launch_ok") and not report.extra.get("relay_error") else EXIT_FAILED
    if report.extra.get("interrupted") or any(c.details.get("launch", {}).get("interrupted") for c in report.checks):
        return EXIT_INTERRUPTED
    if any(check.id == "launch" and check.failed for check in report.checks):
        return EXIT_USAGE
    if report.checks and not report.verified:
        return EXIT_USAGE  # nothing verified: not a pass (the report says why)
    return EXIT_OK if report.ok else EXIT_FAILED


def _split_ids(value: str | None) -> list[str] | None:
    return [part.strip() for part in value.split(",") if part.strip()] if value else None


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("script", required=False)
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED)
@click.option("--gpus", type=click.IntRange(min=1), help="N ranks, one GPU each, NCCL.")
@click.option("--nproc", type=click.IntRange(min=1), help=f"N ranks on this node (default {DEFAULT_NPROC}, gloo on CPU).")
@click.option("--backend", type=click.Choice(["gloo", "nccl"]), help="Override the process-group backend.")
@click.option("--steps", type=click.IntRange(min=1), help="Training steps (built-in: 10; script: 20).")
@click.option("--timeout", type=click.FloatRange(min=1.0), default=120.0, show_default=True,
              help="Wall-clock limit for the whole probe, in seconds; collectives time out sooner.")
@click.option("--framework", type=click.Choice(["torch", "horovod"]),
              help="torch (torchrun) or horovod (horovodrun). Default: horovod for a script that imports it, else torch.")
@click.option("--nnodes", type=click.IntRange(min=1), default=1, show_default=True)
@click.option("--node-rank", type=click.IntRange(min=0), default=0, show_default=True)
@click.option("--rdzv-endpoint", metavar="HOST:PORT", help="Rendezvous endpoint, the same on every node.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--report", "report_dir", type=click.Path(file_okay=False), help="Also write report.json and PNG plots here.")
@click.option("--checks", help="Comma-separated check ids to run (default: all).")
@click.option("--log-file", type=click.Path(dir_okay=False), help="Write the ranks' combined output here.")
@click.option("--verbose", "-v", is_flag=True, help="Stream the ranks' output to stderr.")
@click.option("--inject", hidden=True, help="Plant faults (comma-separated), to test the checks.")
def probe(script, script_args, gpus, nproc, backend, steps, timeout, framework, nnodes, node_rank, rdzv_endpoint,
          output_format, report_dir, checks, log_file, verbose, inject) -> None:
    """Run short real distributed trainings and say, check by check, whether they stay correct.

    Without SCRIPT: the built-in probe (synthetic data and models). With SCRIPT: your training
    script under torchrun, stopped after --steps optimizer steps; its arguments follow `--`.
    """
    if framework is None:
        from distdoctor.probe.script.framework import script_framework

        framework = script_framework(script) if script is not None else "torch"
    wanted_checks = _split_ids(checks)
    faults = _split_ids(inject) or ()
    try:
        validate_selection(script, framework, wanted_checks, faults)
    except CatalogError as exc:
        raise click.UsageError(str(exc)) from None
    if nnodes == 1 and rdzv_endpoint is None:
        from distdoctor.probe.launch.slurm import slurm_nodes

        try:
            slurm = slurm_nodes(os.environ)
        except ValueError as exc:
            raise click.UsageError(f"{exc}: give --nnodes, --node-rank and --rdzv-endpoint") from None
        if slurm is not None:  # `srun distdoctor probe ...`: one task per node
            nnodes, node_rank, rdzv_endpoint = slurm.nnodes, slurm.node_rank, slurm.rdzv_endpoint
    spec = resolve_spec(gpus=gpus, nproc=nproc, backend=backend, nnodes=nnodes, node_rank=node_rank,
                        rdzv_endpoint=rdzv_endpoint, timeout=timeout)
    try:
        report = dispatch(script, script_args, spec, framework=framework, steps=steps, checks=wanted_checks,
                          faults=faults, log_file=log_file, echo=verbose)
    except (LaunchError, ProbeUnavailable, CatalogError) as exc:
        click.echo(f"distdoctor probe: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    except KeyboardInterrupt:  # outside the launch's own wait, which stops the ranks itself
        click.echo("distdoctor probe: interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except OSError as exc:  # e.g. an unwritable --log-file: a message, not a traceback
        click.echo(f"distdoctor probe: {exc}", err=True)
        sys.exit(EXIT_USAGE)
    if report_dir is not None:
        from distdoctor.probe.plots import write_report

        try:
            write_report(report, report_dir)
        except OSError as exc:
            click.echo(f"distdoctor probe: cannot write the report to {report_dir}: {exc}", err=True)
            sys.exit(EXIT_USAGE)
    if output_format == "json":
        click.echo(report.to_json())
    else:
        from distdoctor.probe.render import render_text

        click.echo(render_text(report), nl=False)
    status = exit_status(report)
    if status == EXIT_INTERRUPTED:
        click.echo("distdoctor probe: interrupted; every rank was stopped", err=True)
    sys.exit(status)
