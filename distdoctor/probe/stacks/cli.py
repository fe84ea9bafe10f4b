"""`distdoctor stacks`: where a live, hung training job parted, read without stopping it."""

from __future__ import annotations

import os
import sys
import time

import click

EXIT_CLEAN, EXIT_HUNG, EXIT_ERROR = 0, 1, 2


class StacksError(click.ClickException):
    """Printed as `distdoctor: error: message`, exit status 2."""

    exit_code = EXIT_ERROR

    def show(self, file=None) -> None:  # noqa: D102 - click API
        click.echo(f"distdoctor: error: {self.message}", err=True)


@click.command("stacks")
@click.argument("pids", nargs=-1, type=str)
@click.option("--format", "output_format", type=click.Choice(("text", "json")), default="text", show_default=True)
@click.option("--merge", "merge", is_flag=True, help="Read the PIDS arguments as per-node JSON files and give the job-wide verdict.")
@click.option("--samples", type=click.IntRange(2, 20), default=3, show_default=True, help="Reads of each rank (at least 2): a rank whose stack and step never move stands still.")
@click.option("--interval", type=click.FloatRange(0.0, 10.0), default=0.5, show_default=True, help="Seconds between reads.")
@click.option("--timeout", "timeout_s", type=click.FloatRange(0.5, 120.0), default=5.0, show_default=True, help="Seconds one rank may take to be read.")
@click.option("--jobs", "parallel", type=click.IntRange(1, 256), default=16, show_default=True, help="Ranks read at once.")
@click.option("--no-native", is_flag=True, help="Never read native frames (they need a short pause of a rank that waits in backward).")
@click.option("--py-spy", "py_spy", type=str, default=None, help="The py-spy binary to use (default: on PATH).")
@click.option("-v", "--verbose", is_flag=True, help="Show every frame, not only the user's.")
def stacks(pids, output_format, merge, samples, interval, timeout_s, parallel, no_native, py_spy, verbose):
    """Say where a live, hung job's ranks wait, without stopping it.

    \b
    PIDS: ranks, torchrun agents or launchers of jobs on this machine; none: every training job
    found here (torchrun, horovodrun, mpirun, Slurm tasks, torch.multiprocessing.spawn).
    Multi-node: `distdoctor stacks --format json > node0.json` on every node, then
    `distdoctor stacks --merge node0.json node1.json ...`.
    Exit status: 0 nothing hung, 1 a hang diagnosed, 2 usage errors.
    """
    try:
        status = _run(pids, output_format, merge, samples, interval, timeout_s, parallel, no_native, py_spy, verbose)
    except click.ClickException:
        raise
    except (KeyboardInterrupt, BrokenPipeError):
        raise SystemExit(EXIT_ERROR) from None
    except Exception as exc:  # never a traceback for the user; DISTDOCTOR_DEBUG=1 shows it
        if os.environ.get("DISTDOCTOR_DEBUG"):
            raise
        raise StacksError(f"internal error: {type(exc).__name__}: {exc} (set DISTDOCTOR_DEBUG=1 for the traceback, and please report it)") from None
    sys.exit(status)


def _run(pids, output_format, merge, samples, interval, timeout_s, parallel, no_native, py_spy, verbose) -> int:
    from distdoctor.probe.stacks import discover, live, report, sampler

    started = time.monotonic()
    if merge:
        if not pids:
            raise StacksError("--merge needs the JSON files written by `distdoctor stacks --format json` on each node")
        try:
            jobs = report.load_merge(pids)
        except report.MergeError as exc:
            raise StacksError(str(exc)) from None
        return _emit(jobs, [], output_format, time.monotonic() - started, {"merged": list(pids)}, "merged from " + ", ".join(pids), verbose)

    numbers = []
    for text in pids:
        if not text.strip().isdigit():
            hint = " (to merge per-node JSON files, add --merge)" if text.endswith(".json") else ""
            raise StacksError(f"{text!r} is not a process id{hint}")
        numbers.append(int(text))
    if not sys.platform.startswith("linux"):
        raise StacksError("distdoctor stacks reads processes through /proc: Linux only")
    try:
        binary = sampler.find_py_spy(py_spy)
    except sampler.SamplerMissing as exc:
        raise StacksError(str(exc)) from None
    try:
        jobs = discover.find_jobs(numbers)
    except discover.DiscoveryError as exc:
        raise StacksError(str(exc)) from None
    if not jobs:
        raise StacksError("no training job found on this machine (looked for ranks of torchrun, horovodrun, mpirun, "
                          "Slurm and torch.multiprocessing.spawn); give the PID of a rank or of its launcher")
    options = live.Options(samples, interval, timeout_s, parallel, native=not no_native)
    read = live.read_jobs(jobs, binary, options)

    errors = []
    ranks = [r for job in read for r in job.ranks]
    failed = [r for r in ranks if r.error is not None]
    kinds = {r.error_kind for r in failed}
    if failed and len(failed) == len(ranks):
        first = failed[0].error
        raise StacksError(first if len(kinds) == 1 else "no rank could be read: " + "; ".join(r.error or "" for r in failed[:5]))
    for rank in failed:
        if rank.error_kind in (sampler.EXITED, sampler.NOT_PYTHON, sampler.PERMISSION):
            errors.append(f"{rank.label}: {rank.error}")
    info = {"name": "py-spy", "version": sampler.py_spy_version(binary), "nonblocking": True,
            "samples": samples, "interval_s": interval, "timeout_s": timeout_s, "native": not no_native}
    text = f"{samples} samples {interval:g} s apart by py-spy --nonblocking"
    status = _emit(read, errors, output_format, time.monotonic() - started, info, text, verbose)
    if errors:
        for error in errors:
            click.echo(f"distdoctor: error: {error}", err=True)
        if any(r.error_kind == sampler.EXITED for r in failed):
            click.echo("distdoctor: error: the job changed while it was read (a rank exited): run again", err=True)
        return EXIT_ERROR
    return status


def _emit(jobs, errors, output_format, duration, info, options_text, verbose) -> int:
    from distdoctor.probe.stacks import report

    if output_format == "json":
        click.echo(report.format_json(jobs, duration, info, errors))
    else:
        click.echo(report.format_text(jobs, duration, options_text, verbose))
    return EXIT_HUNG if any(job.verdict.hung for job in jobs) else EXIT_CLEAN
