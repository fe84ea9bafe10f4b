"""What the built-in probe's launcher and its ranks agree on: environment variables and file names.

No torch here: both sides import it. The step budget travels in `launch.torchrun.STEPS_ENV`.
"""

from __future__ import annotations

from pathlib import Path

# Faults a test can plant (hidden `--inject`); the checks that must fail name them in their FAULTS.
FAULTS: dict[str, str] = {
    "rank-init": "parameters re-initialised per rank after DDP wrapped them (no broadcast)",
    "no-allreduce": "a DDP comm hook that skips the gradient all-reduce",
    "sum-grads": "a DDP comm hook that sums gradients instead of averaging them",
    "no-syncbn": "BatchNorm left per rank instead of SyncBatchNorm",
    "no-set-epoch": "DistributedSampler iterated without set_epoch",
    "corrupt-allreduce": "the last rank feeds one wrong element into the exactness all_reduce",
    "slow-link": "the last rank sleeps inside the timed all_reduce of the largest size",
    "same-gpu": "every rank picks GPU 0 instead of its LOCAL_RANK",
    "rank-dies": "the last rank raises at convergence step 2",
    "rank-stalls": "the last rank sleeps forever at convergence step 2",
}
CHECKS_ENV = "DISTDOCTOR_CHECKS"
FAULTS_ENV = "DISTDOCTOR_INJECT"
OUT_DIR_ENV = "DISTDOCTOR_OUT_DIR"
GATHERED_FILE = "gathered.json"
WORKER_MODULE = "distdoctor.probe.builtin.worker"


def rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}.json"


def progress_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"progress-{rank}.json"


def ranks_phrase(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 1', for summaries."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
