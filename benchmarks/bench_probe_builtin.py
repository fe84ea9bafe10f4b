"""Wall time of the whole built-in probe against a bare torchrun launch of a 20-step DDP script.

Both run on 2 gloo ranks on CPU, alternately (so machine load hits both alike), several times;
medians are compared. Target (issue 4): probe <= 1.5x bare.

    python benchmarks/bench_probe_builtin.py [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BARE = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(HERE / "bare_ddp.py")]
PROBE = [sys.executable, "-m", "distdoctor", "probe", "--nproc", "2", "--backend", "gloo", "--format", "json"]


FAILED: dict[str, int] = {}


def wall(cmd: list[str]) -> float:
    """Seconds `cmd` took. A failed run still counts (its time is spent) but is tallied: torch 2.13's
    gloo sometimes aborts a rank at interpreter exit, after the work is done."""
    start = time.perf_counter()
    done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode != 0:
        name = "probe" if cmd is PROBE else "bare"
        FAILED[name] = FAILED.get(name, 0) + 1
        print(f"{name} run exited {done.returncode}: {done.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    wall(BARE)  # warm the file cache for both
    wall(PROBE)
    bare, probe = [], []
    for _ in range(args.runs):
        bare.append(wall(BARE))
        probe.append(wall(PROBE))
    b, p = statistics.median(bare), statistics.median(probe)
    print(f"bare torchrun 20-step DDP: median {b:.2f} s  runs {', '.join(f'{t:.2f}' for t in bare)}")
    print(f"distdoctor probe (all checks): median {p:.2f} s  runs {', '.join(f'{t:.2f}' for t in probe)}")
    print(f"ratio {p / b:.2f} (target <= 1.5)")
    if FAILED:
        print(f"failed runs (timed anyway): {FAILED}")


if __name__ == "__main__":
    main()
