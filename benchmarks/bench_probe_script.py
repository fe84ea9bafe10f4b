"""Wall time of a script under `distdoctor probe` against the same script under plain torchrun.

Both runs make the same number of optimizer steps on the same ranks (2 gloo ranks on CPU by
default); runs alternate so that load from elsewhere on the machine hits both alike, and the
median of each is compared. The target is a ratio of at most 1.3. The probe's own measurement of
its hooks (time inside them, per step) is printed too.

    python benchmarks/bench_probe_script.py [--runs 3] [--steps 200] [--nproc 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from distdoctor.probe.launch.torchrun import LaunchSpec, launch
from distdoctor.probe.script.launcher import run_script_probe

WORKLOAD = Path(__file__).resolve().parent / "probe_script_workload.py"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args(argv)
    spec = LaunchSpec(nproc=args.nproc, backend="gloo", timeout_s=300.0)
    script_args = ["--steps", str(args.steps), "--width", str(args.width)]
    plain, probed, hook_ms, shares = [], [], [], []
    for run in range(args.runs):
        began = time.monotonic()
        result = launch(spec, [str(WORKLOAD), *script_args])
        plain.append(time.monotonic() - began)
        if not result.ok:
            print(result.output, file=sys.stderr)
            return 2
        began = time.monotonic()
        report = run_script_probe(str(WORKLOAD), script_args, spec, steps=args.steps, framework="torch",
                                  log_file="/dev/null")
        probed.append(time.monotonic() - began)
        if not report.ok:
            print(report.to_json(), file=sys.stderr)
            return 2
        ranks = report.extra["overhead"]["ranks"].values()
        hook_ms.append(max(r["hook_ms_per_step"] for r in ranks))
        shares.append(report.extra["overhead"]["max_share_of_train_time"])
        print(f"run {run + 1}: torchrun {plain[-1]:.2f} s, probe {probed[-1]:.2f} s", file=sys.stderr)
    result = {
        "steps": args.steps, "nproc": args.nproc, "runs": args.runs,
        "torchrun_median_s": round(statistics.median(plain), 3),
        "probe_median_s": round(statistics.median(probed), 3),
        "ratio": round(statistics.median(probed) / statistics.median(plain), 3),
        "probe_hook_ms_per_step_median": round(statistics.median(hook_ms), 3),
        "probe_hook_share_of_train_time_median": round(statistics.median(shares), 4),
    }
    print(json.dumps(result, indent=2))
    return 0 if result["ratio"] <= 1.3 else 1


if __name__ == "__main__":
    sys.exit(main())
