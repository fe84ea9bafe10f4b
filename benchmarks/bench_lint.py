"""Wall time of `distdoctor lint`, run by hand (never by the tests).

Times, as whole processes (median of --runs):
  1. one fixture script, with no cache at all; and as under pre-commit: the file edited before each
     run (its findings are not cached) in a project whose cache already holds libcst's compiled
     dataclass methods;
  2. a generated tree of a few hundred files: the fixtures copied many times, renamed, mixed with
     plain Python files that mention no distributed API (the prefilter's case), cold cache;
  3. the same tree again with a warm cache (content hashes unchanged);
  4. optionally any folder you pass (e.g. a checkout of real training code).

Usage: python benchmarks/bench_lint.py [--runs 5] [--copies 20] [EXTRA_FOLDER ...]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = sorted((ROOT / "fixtures" / "lint").glob("*.py"))
PLAIN = '''"""A helper module with no distributed API: answered by the prefilter without parsing."""
import math


def cosine(step, total, base):
    return base * 0.5 * (1 + math.cos(math.pi * step / total))


class Meter:
    def __init__(self):
        self.total = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.total += value * n
        self.count += n

    @property
    def avg(self):
        return self.total / max(self.count, 1)
'''


def make_tree(folder: Path, copies: int) -> int:
    count = 0
    for index in range(copies):
        package = folder / f"project{index:03d}"
        package.mkdir(parents=True)
        for fixture in FIXTURES:
            shutil.copy(fixture, package / f"{fixture.stem}_{index}.py")
            count += 1
        for extra in range(5):
            (package / f"util_{extra}.py").write_text(PLAIN + f"\nVERSION = {index}.{extra}\n")
            count += 1
    return count


def wall(command: list[str], runs: int, cwd: str | None = None, before=None) -> tuple[float, float, float]:
    times = []
    for run in range(runs):
        if before is not None:
            before(run)
        start = time.perf_counter()
        subprocess.run(command, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False)
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times), max(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--copies", type=int, default=20)
    parser.add_argument("folders", nargs="*")
    args = parser.parse_args()
    lint = [sys.executable, "-m", "distdoctor", "lint", "--exit-zero", "-q"]

    def report(label: str, figures: tuple[float, float, float]) -> None:
        low, median, high = figures
        print(f"{label:<48} median {median:7.2f} s   (min {low:.2f}, max {high:.2f})")

    report("one fixture (cold: --no-cache)", wall([*lint, "--no-cache", str(FIXTURES[0])], args.runs))
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        original = FIXTURES[0].read_text()
        script.write_text(original)
        subprocess.run([*lint, "train.py"], cwd=tmp, stdout=subprocess.DEVNULL, check=False)  # fills the cache

        def edit(run: int) -> None:
            script.write_text(f"{original}\n# edit {run}\n")

        report("one edited file, as under pre-commit", wall([*lint, "train.py"], args.runs, cwd=tmp, before=edit))
    with tempfile.TemporaryDirectory() as tmp:
        tree = Path(tmp) / "tree"
        files = make_tree(tree, args.copies)
        report(f"{files} files, cold (--no-cache)", wall([*lint, "--no-cache", str(tree)], args.runs))
        subprocess.run([*lint, str(tree)], cwd=tmp, stdout=subprocess.DEVNULL, check=False)
        report(f"{files} files, warm cache", wall([*lint, str(tree)], args.runs, cwd=tmp))
    for folder in args.folders:
        count = sum(1 for _ in Path(folder).rglob("*.py"))
        report(f"{folder} ({count} files, --no-cache)", wall([*lint, "--no-cache", folder], max(1, args.runs // 2)))


if __name__ == "__main__":
    main()
