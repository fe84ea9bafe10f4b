"""distdoctor side by side with ruff and TorchFix on the same files, cold, in one run.

    python benchmarks/bench_peers.py                      # all of the installed torch's sources
    python benchmarks/bench_peers.py --runs 5 PATH...     # other trees
    python benchmarks/bench_peers.py --torchfix /venv/bin/torchfix --slowest 15

Each tool lints the same paths `--runs` times, without cache, alternating tools so that a change in
the machine's load falls on all of them alike: distdoctor with every rule (`--select ALL
--no-cache`), `ruff check --select ALL --no-cache` (the fastest peer; a benchmark dependency only,
never one of distdoctor's), and TorchFix (`--select ALL`) when it is installed. Printed per tool:
the medians of wall time and of CPU time (user + system of the tool and every process it started),
the peak resident memory of its largest process, and distdoctor's ratio to each peer. Then the
files that cost distdoctor the most, each linted alone in a fresh process (CPU seconds and peak
memory), with ruff's time on the same file.

TorchFix pins its own libcst: install it in a separate environment with `--no-deps` (and a libcst
it accepts) so that it can never replace the torch or libcst distdoctor runs with, and pass its
executable with `--torchfix`.

Standard library only (the tools are run as commands).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Measure:
    wall: float
    cpu: float
    peak_mb: float
    status: int


def run_measured(command: list[str], cwd: Path | None = None) -> Measure:
    """Run `command` to its end; its wall time, its CPU time and that of every process it waited
    for, and the peak RSS of the largest of them (wait4's rusage)."""
    start = time.perf_counter()
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=cwd)
    _, status, usage = os.wait4(process.pid, 0)
    wall = time.perf_counter() - start
    process.returncode = os.waitstatus_to_exitcode(status)
    return Measure(wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, process.returncode)


def torch_sources() -> Path:
    """The folder of the installed torch package, found without importing it."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        raise SystemExit("bench_peers: torch is not installed here; pass the paths to lint")
    return Path(spec.origin).parent


def count_files(paths: list[str]) -> tuple[int, int]:
    files = lines = 0
    for given in paths:
        path = Path(given)
        candidates = [path] if path.is_file() else path.rglob("*.py")
        for file in candidates:
            files += 1
            with open(file, "rb") as handle:
                lines += handle.read().count(b"\n")
    return files, lines


def tool_commands(args: argparse.Namespace, paths: list[str]) -> dict[str, list[str]]:
    commands = {
        "distdoctor": [sys.executable, "-m", "distdoctor", "lint", "--select", "ALL", "--no-cache", "--exit-zero", "-q", *paths],
    }
    if args.jobs:
        commands["distdoctor"][4:4] = ["--jobs", str(args.jobs)]
    ruff = args.ruff or shutil.which("ruff") or _beside_python("ruff")
    if ruff:
        commands["ruff"] = [ruff, "check", "--select", "ALL", "--no-cache", "--exit-zero", "--quiet", "--isolated", *paths]
    else:
        print("bench_peers: ruff not found (pip install ruff, or --ruff PATH): compared with nothing", file=sys.stderr)
    torchfix = None if args.no_torchfix else args.torchfix or shutil.which("torchfix") or _beside_python("torchfix")
    if torchfix:
        commands["torchfix"] = [torchfix, "--select", "ALL", *paths]
    else:
        print("bench_peers: TorchFix not found (--torchfix PATH): skipped", file=sys.stderr)
    return commands


def _beside_python(name: str) -> str | None:
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else None


def slowest_files(paths: list[str], count: int) -> list[tuple[str, float]]:
    """distdoctor's CPU time per file, measured in this process, the costliest first."""
    from distdoctor.lint.engine import discover, lint_source, read_source
    from distdoctor.lint.config import Config
    from distdoctor.lint.rule import all_rules

    rules = all_rules()
    files, _ = discover(paths, Config(cache=False))
    timed = []
    for file in files:
        try:
            source = read_source(file)
        except Exception:
            continue
        start = time.process_time()
        lint_source(source, str(file), rules)
        timed.append((str(file), time.process_time() - start))
    timed.sort(key=lambda item: -item[1])
    return timed[:count]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", help="files or folders (default: the installed torch's sources)")
    parser.add_argument("--runs", type=int, default=3, help="cold runs per tool (default 3)")
    parser.add_argument("--jobs", type=int, help="distdoctor's -j (default: its own)")
    parser.add_argument("--ruff", help="ruff executable")
    parser.add_argument("--torchfix", help="TorchFix executable (in its own environment)")
    parser.add_argument("--no-torchfix", action="store_true", help="leave TorchFix out (it takes minutes on all of torch)")
    parser.add_argument("--slowest", type=int, default=10, help="how many of distdoctor's slowest files to show")
    parser.add_argument("--rank-files", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_files:
        for path, _ in slowest_files(args.paths, args.rank_files):
            print(path)
        return 0
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    paths = args.paths or [str(torch_sources())]
    for path in paths:
        if not Path(path).exists():
            parser.error(f"{path}: no such file or directory")
    for tool in (args.ruff, args.torchfix):
        if tool and not shutil.which(tool):
            parser.error(f"{tool}: not an executable")

    files, lines = count_files(paths)
    print(f"{files} files, {lines} lines, {args.runs} cold runs per tool, {os.cpu_count()} CPUs", flush=True)
    commands = tool_commands(args, paths)
    measures: dict[str, list[Measure]] = {tool: [] for tool in commands}
    for run in range(1, args.runs + 1):
        for tool, command in commands.items():
            measure = run_measured(command)
            measures[tool].append(measure)
            print(f"  run {run} {tool:<11} wall {measure.wall:7.2f} s  CPU {measure.cpu:7.2f} s  peak {measure.peak_mb:5.0f} MB", flush=True)

    medians = {
        tool: (statistics.median(m.wall for m in ms), statistics.median(m.cpu for m in ms), max(m.peak_mb for m in ms))
        for tool, ms in measures.items()
    }
    print(f"\n{'tool':<11} {'wall s':>8} {'CPU s':>8} {'peak MB':>8}  exit")
    for tool, (wall, cpu, peak) in medians.items():
        print(f"{tool:<11} {wall:8.2f} {cpu:8.2f} {peak:8.0f}  {sorted({m.status for m in measures[tool]})}")
    ours = medians["distdoctor"]
    for peer in (tool for tool in medians if tool != "distdoctor"):
        theirs = medians[peer]
        print(
            f"distdoctor / {peer}: wall {ours[0] / theirs[0]:.1f}x, CPU {ours[1] / theirs[1]:.1f}x, "
            f"peak memory {ours[2] / theirs[2]:.1f}x"
        )

    if args.slowest > 0:
        print(f"\nslowest files for distdoctor (alone, fresh process; CPU s, peak MB; ruff CPU s):")
        ruff = commands.get("ruff")
        # Ranked in a child: a process forked from a large one starts with its peak memory.
        ranking = subprocess.run(
            [sys.executable, __file__, "--rank-files", str(args.slowest), *paths],
            capture_output=True, text=True, check=True,
        ).stdout.splitlines()
        for path in ranking:
            alone = run_measured([sys.executable, "-m", "distdoctor", "lint", "--select", "ALL", "--no-cache", "--exit-zero", "-q", path])
            peer = run_measured([*ruff[:-len(paths)], path]) if ruff else None
            print(f"  {alone.cpu:6.2f} s {alone.peak_mb:6.0f} MB   ruff {peer.cpu if peer else float('nan'):5.2f} s   {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
