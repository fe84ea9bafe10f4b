"""What a built-in check sees inside a rank: who it is, its device, the planted faults, and helpers.

Only imported by rank processes (`distdoctor.probe.builtin.worker`, `distdoctor.probe.builtin.horovod_worker`)
and by the rank-side `run` of the checks in `distdoctor.probes`; the launcher never imports it,
because it imports torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

# The step at which the planted rank-dies / rank-stalls faults strike.
FAULT_STEP = 2


@dataclass
class RankContext:
    """One rank's view of the probe. Mutable only through `progress`, which writes a file."""

    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device
    steps: int
    faults: frozenset[str] = frozenset()
    seed: int = 1234
    progress_file: Path | None = None
    _last: dict = field(default_factory=dict)

    @property
    def last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    def planted(self, fault: str) -> bool:
        return fault in self.faults

    def progress(self, check: str, step: int | None = None) -> None:
        """Record where this rank is, so the launcher can name a rank that died or stalled."""
        self._last = {"rank": self.rank, "check": check, "step": step, "time": time.time()}
        if self.progress_file is not None:
            tmp = self.progress_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self._last))
            os.replace(tmp, self.progress_file)

    def maybe_die_or_stall(self, check: str, step: int) -> None:
        """The planted 'rank-dies' / 'rank-stalls' faults, on the last rank at FAULT_STEP."""
        if step != FAULT_STEP or not self.last_rank:
            return
        if self.planted("rank-dies"):
            raise RuntimeError(f"planted fault rank-dies: rank {self.rank} exits at {check} step {step}")
        if self.planted("rank-stalls"):
            while True:  # a rank stuck outside any collective, as a deadlocked data loader would be
                time.sleep(3600)


def seeded_generator(*seeds: int) -> torch.Generator:
    """A CPU generator seeded from several integers, identical on every rank."""
    gen = torch.Generator()
    value = 0
    for seed in seeds:
        value = value * 1_000_003 + seed
    gen.manual_seed(value % (2**63))
    return gen


def shard(batch: torch.Tensor, ctx: RankContext) -> torch.Tensor:
    """This rank's equal slice of a global batch (rows rank*B .. (rank+1)*B)."""
    per_rank = batch.shape[0] // ctx.world_size
    return batch[ctx.rank * per_rank : (ctx.rank + 1) * per_rank]


def checksum(tensors: Iterable[torch.Tensor]) -> list[float]:
    """Two float64 numbers that differ whenever the tensors do in practice: a plain and a weighted sum."""
    flat = torch.cat([t.detach().reshape(-1).to("cpu", torch.float64) for t in tensors])
    weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64) % 97 + 1
    return [float(flat.sum()), float((flat * weights).sum())]


def tiny_mlp(ctx: RankContext, in_features: int = 8, hidden: int = 16, *, seed: int | None = None) -> torch.nn.Module:
    """The same small MLP on every rank (seeded with `seed`, else the probe's seed), on the rank's device."""
    torch.manual_seed(ctx.seed if seed is None else seed)
    return torch.nn.Sequential(
        torch.nn.Linear(in_features, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 1)
    ).to(ctx.device)


def _skip_allreduce_hook(state, bucket):
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


def _sum_allreduce_hook(state, bucket):
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def wrap_ddp(model: torch.nn.Module, ctx: RankContext) -> torch.nn.Module:
    """DistributedDataParallel around `model`, with the DDP faults planted when asked."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    ddp = DistributedDataParallel(model, device_ids=device_ids)
    if ctx.planted("rank-init"):
        # As if each rank built or loaded its weights after DDP's one broadcast at construction.
        gen = seeded_generator(ctx.seed, 7919, ctx.rank)
        with torch.no_grad():
            for param in ddp.module.parameters():
                param.add_(torch.randn(param.shape, generator=gen).to(param.device) * 0.1)
    if ctx.planted("no-allreduce"):
        ddp.register_comm_hook(None, _skip_allreduce_hook)
    elif ctx.planted("sum-grads"):
        ddp.register_comm_hook(None, _sum_allreduce_hook)
    return ddp


def regression_batch(ctx: RankContext, step: int, per_rank: int = 4, features: int = 8):
    """A global batch of a learnable task (y depends smoothly on x), the same on every rank."""
    gen = seeded_generator(ctx.seed, 31, step)
    inputs = torch.randn(per_rank * ctx.world_size, features, generator=gen)
    target_weights = torch.linspace(-1.0, 1.0, features)
    targets = torch.tanh(inputs @ target_weights).unsqueeze(1)
    return inputs.to(ctx.device), targets.to(ctx.device)


def synchronize(ctx: RankContext) -> None:
    if ctx.device.type == "cuda":
        torch.cuda.synchronize(ctx.device)


