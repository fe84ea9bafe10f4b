"""What the ranks and the launcher agree on: environment variables and the record files.

Each rank appends JSON lines to `<run dir>/rank<R>.jsonl`, one object per event, flushed as written,
so the launcher can follow progress while the job runs and still read everything after a crash or
a kill. Ranks never talk to each other for the probe: the launcher compares their files.
This module must not import torch (the launcher side reads the files without it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Set by the launcher side (distdoctor.probe.script.launcher), read by distdoctor.probe.script.run;
# the step budget travels in distdoctor.probe.launch.torchrun.STEPS_ENV, as for the built-in probe.
RUN_DIR_ENV = "DISTDOCTOR_RUN_DIR"
FRAMEWORK_ENV = "DISTDOCTOR_FRAMEWORK"  # "torch" (DDP/torchrun) or "horovod"

# The module torchrun starts in place of the script: `-m distdoctor.probe.script.run SCRIPT ARGS`.
RUN_MODULE = "distdoctor.probe.script.run"

# Event kinds ("e" field). The payload of each is documented where it is written (hooks, horovod_hooks).
START, DDP, OPTIMIZER, BACKWARD, BACKWARD_END, COLLECTIVE, COLLECTIVE_END = (
    "start", "ddp", "opt", "bwd", "bwd_end", "coll", "coll_end",
)
SAMPLER_ITER, STEP, STOP, EXIT, ERROR = "sampler", "step", "stop", "exit", "error"
# Everything the Horovod hooks record (distdoctor.probe.script.horovod_hooks), told apart by "what".
HOROVOD = "hvd"
# A sampler pass during which an optimizer step happened; the probe's own hook failing; a
# tensor-parallel group (parallelize_module).
SAMPLER_FED, PROBE_ERROR, TENSOR_PARALLEL = "sampler_fed", "probe_error", "tp"
# DDP's constructor entered (its parameter broadcast is a collective of its own); DDP is written after.
DDP_BEGIN = "ddp_begin"
# What each observation feeds: a failed hook (PROBE_ERROR's "what") makes these checks unreliable.
OBSERVATIONS = {
    "steps": ("optimizer steps", ("param-sync", "grad-sync", "data-shard", "loss", "hparams", "desync")),
    "backward": ("backward passes", ("loss", "desync")),
    "forward": ("model inputs", ("data-shard",)),
    "ddp": ("DDP construction", ("param-sync", "grad-sync")),
    "sampler": ("DistributedSampler iteration", ("epoch-shuffle",)),
    "collectives": ("collectives", ("desync",)),
    "hparams": ("hyperparameters", ("hparams",)),
}


def records_path(run_dir: str | Path, rank: int) -> Path:
    """The file where `rank` writes its events."""
    return Path(run_dir) / f"rank{rank}.jsonl"


def stacks_path(run_dir: str | Path, rank: int) -> Path:
    """The file where `rank` dumps its Python stacks on SIGUSR1 (faulthandler)."""
    return Path(run_dir) / f"stacks{rank}.txt"


def read_records(path: str | Path, offset: int = 0) -> tuple[list[dict[str, Any]], int]:
    """Complete records after byte `offset`, and the offset just past the last complete line.

    A line still being written (no newline yet) is left for the next read.
    """
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            data = f.read()
    except OSError:
        return [], offset
    end = data.rfind(b"\n")
    if end < 0:
        return [], offset
    records = list(_parse_lines(data[: end + 1]))
    return records, offset + end + 1


def _parse_lines(data: bytes) -> Iterator[dict[str, Any]]:
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:  # a rank killed mid-write leaves a torn line: skip it
            continue
        if isinstance(record, dict):
            yield record
