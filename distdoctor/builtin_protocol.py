"""What the built-in probe's launcher and its ranks agree on: environment variables and file names.

No torch here: both sides import it.
"""

from __future__ import annotations

from pathlib import Path

# Check ids in the order they run; the ones that can make a rank die or stall come last.
CHECK_IDS: tuple[str, ...] = ("env", "collectives", "bandwidth", "grad-sync", "param-sync", "syncbn", "sampler",
                              "convergence")
CHECKS_ENV = "DISTDOCTOR_CHECKS"
FAULTS_ENV = "DISTDOCTOR_INJECT"
STEPS_ENV = "DISTDOCTOR_STEPS"
OUT_DIR_ENV = "DISTDOCTOR_OUT_DIR"
GATHERED_FILE = "gathered.json"
WORKER_MODULE = "distdoctor.builtin_worker"


def check_module(check_id: str) -> str:
    """The module implementing a check: `grad-sync` -> `distdoctor.probes.grad_sync`."""
    return "distdoctor.probes." + check_id.replace("-", "_")


def rank_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"rank-{rank}.json"


def progress_file(out_dir: Path, rank: int) -> Path:
    return out_dir / f"progress-{rank}.json"


def ranks_phrase(ranks: list[int]) -> str:
    """'rank 1' or 'ranks 0, 1', for summaries."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
