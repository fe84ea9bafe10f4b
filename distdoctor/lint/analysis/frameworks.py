"""One table of the names distdoctor knows: distributed APIs by qualified name, and the training
frameworks that take over part of the work (device selection, `set_epoch`, sharding loaders), so
that a rule about that work stays silent in a script driven by one of them."""

from __future__ import annotations

from dataclasses import dataclass

# Distributed APIs, by the qualified name `names.ImportTable` resolves them to.
DDP = "torch.nn.parallel.DistributedDataParallel"
SAMPLER_QUALS = ("torch.utils.data.DistributedSampler",)
LOADER_QUALS = ("torch.utils.data.DataLoader",)
# DGL's loaders: with use_ddp=True each rank iterates its own part of the indices.
DGL_DDP_LOADERS = tuple(
    f"dgl.dataloading.{package}{name}"
    for package in ("", "pytorch.")
    for name in ("DataLoader", "NodeDataLoader", "EdgeDataLoader", "GraphDataLoader")
)
DDP_QUALS = (DDP,)
FSDP_PREFIX = "torch.distributed.fsdp"
# FSDP (v1), the wrapper class, under both its public and its module path.
FSDP_CLASS = frozenset(
    {
        "torch.distributed.fsdp.FullyShardedDataParallel",
        "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
    }
)
CONVERT_SYNCBN = ("torch.nn.SyncBatchNorm.convert_sync_batchnorm",)
HOROVOD_INIT = "horovod.torch.init"
INIT_PROCESS_GROUP = "torch.distributed.init_process_group"
# What starts a process group, by the last part of the name called: torch's own call and the
# project helpers that wrap it in most research code.
PROCESS_GROUP_STARTERS = frozenset(
    {"init_process_group", "init_distributed_mode", "init_distributed", "setup_distributed", "init_dist"}
)
HVD_OPTIMIZER = "horovod.torch.DistributedOptimizer"
DATALOADER = "torch.utils.data.DataLoader"


@dataclass(frozen=True)
class Framework:
    """A framework a script may import, and which work it does itself."""

    module: str  # the top-level import name
    selects_device: bool  # sets the current CUDA device per process (DD003)
    calls_set_epoch: bool  # gives its samplers the epoch (DD201)
    shards_loaders: bool  # adds a DistributedSampler or shards loaders itself (DD203)
    passes_local_rank_flag: bool = False  # its launcher passes `--local_rank` (DD004)


FRAMEWORKS = (
    Framework("accelerate", selects_device=True, calls_set_epoch=True, shards_loaders=True),
    Framework("lightning", selects_device=True, calls_set_epoch=True, shards_loaders=True),
    Framework("pytorch_lightning", selects_device=True, calls_set_epoch=True, shards_loaders=True),
    Framework("composer", selects_device=True, calls_set_epoch=True, shards_loaders=True),
    Framework("ignite", selects_device=True, calls_set_epoch=True, shards_loaders=True),
    Framework("deepspeed", selects_device=True, calls_set_epoch=False, shards_loaders=True, passes_local_rank_flag=True),
    Framework("colossalai", selects_device=True, calls_set_epoch=False, shards_loaders=True),
    Framework("fabric", selects_device=True, calls_set_epoch=False, shards_loaders=True),
    Framework("ray", selects_device=False, calls_set_epoch=False, shards_loaders=True),
    Framework("mmengine", selects_device=False, calls_set_epoch=False, shards_loaders=True),
    Framework("mmcv", selects_device=False, calls_set_epoch=False, shards_loaders=True),
    Framework("detectron2", selects_device=False, calls_set_epoch=False, shards_loaders=True),
)
SELECTS_DEVICE = tuple(f.module for f in FRAMEWORKS if f.selects_device)
CALLS_SET_EPOCH = tuple(f.module for f in FRAMEWORKS if f.calls_set_epoch)
SHARDS_LOADERS = tuple(f.module for f in FRAMEWORKS if f.shards_loaders)
PASSES_LOCAL_RANK_FLAG = tuple(f.module for f in FRAMEWORKS if f.passes_local_rank_flag)


# Word groups for the rules' gates (`Rule.requires`): a call or import resolved to one of these
# APIs has the word in the code, whatever the alias it is called by.
DDP_WORDS = frozenset({"DistributedDataParallel"})
HOROVOD_WORDS = frozenset({"horovod"})
SHARDING_WORDS = frozenset({"fully_shard", "FullyShardedDataParallel", "parallelize_module"})
SAMPLER_WORDS = frozenset({"DistributedSampler"})
LOADER_WORDS = frozenset({"DataLoader"})
DGL_DDP_WORDS = frozenset({"use_ddp"})  # a DGL loader's own DistributedSampler
DGL_LOADER_WORDS = frozenset({"NodeDataLoader", "EdgeDataLoader", "GraphDataLoader"})
SAVE_WORDS = frozenset({"save"})
CLIP_WORDS = frozenset({"clip_grad_norm_", "clip_grad_value_", "clip_grad_norm"})
# `LintContext.is_distributed`: torch.distributed, torch.nn.parallel, a DistributedSampler or
# Horovod imported, or init_process_group/DistributedDataParallel called.
DISTRIBUTED_WORDS = frozenset({"distributed", "parallel", "DistributedSampler", "horovod", "init_process_group", "DistributedDataParallel"})
# `LintContext.runs_multi_process`: a process group started (by torch or a project helper),
# Horovod initialised, or a model wrapped in DDP.
MULTI_PROCESS_WORDS = PROCESS_GROUP_STARTERS | DDP_WORDS | HOROVOD_WORDS
