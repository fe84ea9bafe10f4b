"""Under Slurm, the node count, this node's rank and the rendezvous endpoint come from Slurm's
environment, so `srun distdoctor probe train.py` needs no flag (one task per node, as torchrun
wants: each task starts the node's ranks itself)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

# A rendezvous port derived from the job id: every node computes the same, and two jobs sharing
# a node rarely collide. The probe's record relay uses the next port.
BASE_PORT = 29500
PORT_SPAN = 10000


@dataclass(frozen=True)
class SlurmNodes:
    nnodes: int
    node_rank: int
    rdzv_endpoint: str


def first_host(nodelist: str) -> str:
    """The first host of a Slurm host list: `gpu[003-010,012],cpu01` -> `gpu003`."""
    match = re.match(r"\s*([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if match is None or not match.group(1):
        raise ValueError(f"cannot read the Slurm node list {nodelist!r}")
    prefix, ranges = match.group(1), match.group(2)
    if ranges is None:
        return prefix
    first = ranges.split(",", 1)[0].split("-", 1)[0]
    return prefix + first


def slurm_nodes(env: Mapping[str, str]) -> SlurmNodes | None:
    """The multi-node launch Slurm describes, or None outside a multi-node Slurm step."""
    try:
        nnodes = int(env.get("SLURM_STEP_NUM_NODES") or env.get("SLURM_NNODES") or 0)
        node_rank = int(env["SLURM_NODEID"])
        job = int(env["SLURM_JOB_ID"])
        nodelist = env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"]
    except (KeyError, ValueError):
        return None
    if nnodes <= 1:
        return None
    port = BASE_PORT + (job % PORT_SPAN) * 2 % PORT_SPAN
    return SlurmNodes(nnodes, node_rank, f"{first_host(nodelist)}:{port}")
