"""The rank side of the built-in probe: `torchrun ... -m distdoctor.probe.builtin.worker`.

Runs the requested checks in order inside one process group, writes this rank's evidence and
progress to files as it goes (so a rank that dies or stalls is still named), then gathers every
rank's evidence to every rank and lets the first rank of each node write it: every node of a
multi-node launch reports from the same data, hence the same verdict.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from distdoctor.probe.builtin.protocol import CHECKS_ENV, FAULTS_ENV, GATHERED_FILE, OUT_DIR_ENV, progress_file, rank_file
from distdoctor.probe.builtin.rank import RankContext
from distdoctor.probe.checks import select_checks
from distdoctor.probe.launch.torchrun import COLLECTIVE_TIMEOUT_ENV, STEPS_ENV


def _write_json(path: Path, data: object) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _device(backend: str, local_rank: int, faults: frozenset[str]) -> torch.device:
    if backend != "nccl":
        return torch.device("cpu")
    index = 0 if "same-gpu" in faults else local_rank
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


class SettingsMismatch(RuntimeError):
    """The nodes of one launch were started with different probe flags (a usage error)."""


def agree_on_settings(ctx: RankContext, checks) -> None:
    """Raise on every rank when the ranks were not all given the same checks, steps and faults.

    Each node's launcher passes its own flags: a node started with another `--steps` would run
    another number of collectives in `convergence` and hang the others until the collective
    timeout. One gather before the first check turns that into a clear usage error on every node.
    """
    import socket

    mine = {"host": socket.gethostname(), "steps": ctx.steps, "checks": ",".join(c.id for c in checks),
            "inject": ",".join(sorted(ctx.faults))}
    everyone: list[dict | None] = [None] * ctx.world_size
    dist.all_gather_object(everyone, mine)
    differ = []
    for flag in ("steps", "checks", "inject"):
        values: dict[str, dict[str, list[int]]] = {}
        for rank, settings in enumerate(everyone):
            values.setdefault(str(settings[flag]), {}).setdefault(settings["host"], []).append(rank)
        if len(values) > 1:
            differ.append(f"--{flag} " + "; ".join(
                f"{value or '(none)'} on " + ", ".join(f"{host} (rank{'s' if len(r) > 1 else ''} {','.join(map(str, r))})"
                                                      for host, r in hosts.items())
                for value, hosts in values.items()))
    if differ:
        raise SettingsMismatch("the nodes were started with different probe flags: " + "; ".join(differ)
                               + ". Start every node with the same flags")


@record
def main() -> None:
    out_dir = Path(os.environ[OUT_DIR_ENV])
    checks = select_checks("builtin", "torch", os.environ[CHECKS_ENV].split(","))
    faults = frozenset(f for f in os.environ.get(FAULTS_ENV, "").split(",") if f)
    backend = os.environ.get("DISTDOCTOR_BACKEND", "gloo")
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    # Bitwise comparisons against a reference need full-precision matmuls on GPUs too.
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    device = _device(backend, local_rank, faults)
    timeout = datetime.timedelta(seconds=float(os.environ.get(COLLECTIVE_TIMEOUT_ENV, "60")))
    ctx = RankContext(rank=rank, world_size=int(os.environ["WORLD_SIZE"]), local_rank=local_rank, backend=backend,
                      device=device, steps=int(os.environ.get(STEPS_ENV, "10")), faults=faults,
                      progress_file=progress_file(out_dir, rank))
    ctx.progress("init")
    dist.init_process_group(backend, timeout=timeout)
    try:
        agree_on_settings(ctx, checks)
        evidence: dict[str, dict] = {}
        for check in checks:
            ctx.progress(check.id)
            evidence[check.id] = check.run(ctx)
            _write_json(rank_file(out_dir, rank), evidence)
        ctx.progress("gather")
        everyone: list[dict | None] = [None] * ctx.world_size
        dist.all_gather_object(everyone, evidence)
        if local_rank == 0:
            _write_json(out_dir / GATHERED_FILE, everyone)
        dist.barrier()  # no rank tears gloo down while another is still in the gather
        ctx.progress("done")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    # torch 2.13 with gloo sometimes aborts in C++ teardown at interpreter exit ("terminate called
    # without an active exception", SIGABRT) after destroy_process_group has returned. Every result
    # is on disk by now, so leave without running those destructors.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
