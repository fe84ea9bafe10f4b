"""What a name can be known to hold: the abstract values of the trace (a DDP wrapper, a sampler,
the global rank read from the environment, ...). Plain data, no evaluation here."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import libcst as cst

# Value kinds
UNKNOWN = "unknown"
DDP = "ddp"  # a DistributedDataParallel wrapper; inner = the wrapped module
MODULE = "module"  # an nn.Module we know of (a local nn.Module subclass, `ddp.module`)
SAMPLER = "dist_sampler"  # a torch DistributedSampler
LOADER = "loader"  # a DataLoader; inner = its sampler (if known)
OPTIMIZER = "optimizer"  # a torch.optim optimizer
HVD_OPTIMIZER = "hvd_optimizer"  # horovod DistributedOptimizer; inner = the wrapped optimizer
SCALER = "grad_scaler"
RANK = "rank"  # the global rank
LOCAL_RANK = "local_rank"  # the rank within the node (a valid device index)
WORLD_SIZE = "world_size"
LOCAL_SIZE = "local_size"
RANK_TEST = "rank_test"  # a boolean that is true on rank 0 only (or on all others)
INSTANCE = "instance"  # an instance of a class of this module; attrs["class"]
TUPLE = "tuple"  # items
CONST = "const"  # a literal; attrs["value"]
PARAMS = "params"  # model.parameters() / named_parameters() / state_dict(); inner = the model
RANK_NAMES = frozenset({"rank", "global_rank", "world_rank", "ddp_rank", "grank", "rank_id"})
LOCAL_RANK_NAMES = frozenset({"local_rank", "ddp_local_rank", "localrank", "local_rank_id", "lrank"})
MAIN_PROCESS_FUNCS = frozenset(
    {
        "is_main_process",
        "is_master",
        "is_master_process",
        "is_rank_zero",
        "is_rank_0",
        "is_primary",
        "is_global_zero",
        "main_process",
        "is_main_worker",
        "master_only",
        "is_root",
        "is_chief",
    }
)


@dataclass(frozen=True, eq=False)
class Value:
    """What a name is known to hold. Identity (`node`) says which object: two names bound from the
    same `DistributedSampler(...)` call hold the same sampler."""

    kind: str
    node: cst.CSTNode | None = None
    origin: str = ""
    inner: Value | None = None
    items: tuple[Value | None, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""

    def same_object(self, other: Value | None) -> bool:
        return other is not None and self.node is not None and self.node is other.node

    @property
    def is_rank_like(self) -> bool:
        return self.kind in (RANK, LOCAL_RANK)


def env_value(name: str, node: cst.CSTNode) -> Value | None:
    if name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
        return Value(RANK, node, origin="env", name=name)
    if name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"):
        return Value(LOCAL_RANK, node, origin="env", name=name)
    if name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        return Value(WORLD_SIZE, node, origin="env", name=name)
    if name in ("LOCAL_WORLD_SIZE",):
        return Value(LOCAL_SIZE, node, origin="env", name=name)
    return None
