"""The rank side of `distdoctor probe --framework horovod`: one process per rank, started by horovodrun.

Each rank trains a small seeded regression model through `hvd.DistributedOptimizer`, after
`hvd.broadcast_parameters` and `hvd.broadcast_optimizer_state`, exactly as Horovod documents it, and
writes what it saw to `<out>/rank<R>.json`: one evidence object per check id, in the shape each
Horovod check of the catalog names in its `needs` (`env`, `grad-sync`, `param-sync` share theirs
with the torchrun checks). The launcher (`distdoctor.probe.builtin.horovod`) has the checks compare
the ranks with each other and with a single-process reference; the ranks never compare among
themselves, so a rank that stalls or dies still leaves the others' evidence behind. The model, the
shards and the checksums are the torchrun probe's rank kit (`distdoctor.probe.builtin.rank`).

The setup is chosen so that each documented step matters:
- the model is initialised with a rank-dependent seed (as scripts that seed by rank do), so only
  `broadcast_parameters` makes the ranks start equal;
- rank 0 resumes from a "checkpoint" (one earlier step, with its momentum buffers), so only
  `broadcast_parameters` + `broadcast_optimizer_state` give every rank the same starting point;
- the learning rate is `BASE_LR * hvd.size()` (Horovod's scaling rule for the global batch);
- gradients are clipped after `optimizer.synchronize()`, inside `optimizer.skip_synchronize()`.

The single-process reference (rank 0's initial model and checkpoint, the concatenated global batch,
the scaled learning rate, clipping of the averaged gradient) is computed on every rank without any
collective; Horovod averages gradients, so a healthy run follows it to float rounding.

`--fault` plants one of the bugs that the checks must find (see `FAULTS`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

# Planted faults, each one documented user mistake.
FAULTS = {
    "none": "healthy: the documented Horovod recipe",
    "no-broadcast": "no hvd.broadcast_parameters / hvd.broadcast_optimizer_state after a rank-dependent init",
    "unscaled-lr": "the learning rate is not multiplied by hvd.size()",
    "clip-before-sync": "clip_grad_norm_ runs before optimizer.synchronize(), on local, still-reducing gradients",
}

SEED = 1234
IN_FEATURES = 8
HIDDEN = 16
PER_RANK_BATCH = 16
BASE_LR = 0.02
MOMENTUM = 0.9
# Small enough that clipping engages on every step of this task: clipping in the wrong place shows.
CLIP_NORM = 0.5


def _flat(tensors):
    import torch

    return torch.cat([t.detach().reshape(-1).double() for t in tensors])


def _global_batch(step: int, world_size: int):
    """The step's global batch, the same on every rank: a learnable, noisy nonlinear target."""
    import torch

    from distdoctor.probe.builtin.rank import seeded_generator

    gen = seeded_generator(SEED * 1000 + step)
    x = torch.randn(PER_RANK_BATCH * world_size, IN_FEATURES, generator=gen)
    w = torch.linspace(-1.0, 1.0, IN_FEATURES)
    y = torch.sin(x @ w).unsqueeze(1) * 2.0 + 0.05 * torch.randn(x.shape[0], 1, generator=gen)
    return x, y


def _checkpoint(model) -> dict:
    """Rank 0 "resumes from a checkpoint": one earlier step of plain SGD, with its momentum buffers.

    Runs before the model's parameters get Horovod's gradient hooks (an all-reduce on one rank
    only would never complete) and returns the optimizer state to load afterwards.
    """
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=BASE_LR, momentum=MOMENTUM)
    x, y = _global_batch(-1, 1)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
    return opt.state_dict()


def _load_checkpoint(optimizer, checkpoint: dict, lr: float) -> None:
    optimizer.load_state_dict(checkpoint)
    for group in optimizer.param_groups:  # the checkpoint's lr would override the configured one
        group["lr"] = lr


def _reference(ctx, lr: float) -> dict:
    """Single process, rank 0's start, global batch, scaled lr, clipping of the averaged gradient."""
    import torch

    from distdoctor.probe.builtin.rank import tiny_mlp

    model = tiny_mlp(ctx, IN_FEATURES, HIDDEN, seed=SEED)
    checkpoint = _checkpoint(model)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    _load_checkpoint(opt, checkpoint, lr)
    grads, losses = None, []
    for step in range(ctx.steps):
        x, y = _global_batch(step, ctx.world_size)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        losses.append(float(loss))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
        if step == 0:
            grads = [p.grad.clone() for p in model.parameters()]
        opt.step()
    return {"first_grads": grads, "losses": losses}


def rank_context(steps: int, fault: str):
    """This rank's `RankContext` (the torchrun probe's), from Horovod's rank and size; CPU, Gloo."""
    import horovod.torch as hvd
    import torch

    from distdoctor.probe.builtin.rank import RankContext

    return RankContext(rank=hvd.rank(), world_size=hvd.size(), local_rank=hvd.local_rank(), backend="gloo",
                       device=torch.device("cpu"), steps=steps, faults=frozenset({fault} - {"none"}), seed=SEED)


def run_rank(ctx) -> dict:
    """Train on this rank through Horovod and return the evidence of every Horovod check, by check id."""
    import horovod.torch as hvd
    import torch

    from distdoctor.probe.builtin.rank import checksum, shard, tiny_mlp
    from distdoctor.probes.builtin import env
    from distdoctor.probes.builtin.grad_sync import HOROVOD_RTOL

    rank, size = ctx.rank, ctx.world_size
    scaled_lr = BASE_LR * size
    lr = BASE_LR if ctx.planted("unscaled-lr") else scaled_lr

    # rank-dependent on purpose: only the broadcast makes it right
    model = tiny_mlp(ctx, IN_FEATURES, HIDDEN, seed=SEED + rank)
    checkpoint = _checkpoint(model) if rank == 0 else None
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=MOMENTUM)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    if checkpoint is not None:
        _load_checkpoint(optimizer, checkpoint, lr)
    if not ctx.planted("no-broadcast"):
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    reference = _reference(ctx, scaled_lr)
    param_sums = [checksum(model.parameters())]
    # The momentum buffers after the broadcasts (none on a rank that never got rank 0's checkpoint).
    state = [buf for p in model.parameters() if (buf := optimizer.state.get(p, {}).get("momentum_buffer")) is not None]
    state_sum = checksum(state) if state else None
    losses, local_losses, first_grads = [], [], None
    for step in range(ctx.steps):
        batch = _global_batch(step, size)
        with torch.no_grad():  # the global loss of this rank's model: no collective needed
            losses.append(float(torch.nn.functional.mse_loss(model(batch[0]), batch[1])))
        x, y = shard(batch[0], ctx), shard(batch[1], ctx)
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        local_losses.append(float(loss))
        loss.backward()
        if ctx.planted("clip-before-sync"):
            # The bug: the all-reduce started by backward's hooks has not been waited for.
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            if step == 0:
                optimizer.synchronize()
                first_grads = [p.grad.clone() for p in model.parameters()]
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        else:
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_NORM)
            if step == 0:
                first_grads = [p.grad.clone() for p in model.parameters()]
            with optimizer.skip_synchronize():
                optimizer.step()
        param_sums.append(checksum(model.parameters()))

    ref_grads = _flat(reference["first_grads"])
    grads = _flat(first_grads)
    scale = float(ref_grads.abs().max()) or 1.0
    relative = float((grads - ref_grads).abs().max()) / scale
    return {
        "env": env.run(ctx),
        "grad-sync": {
            "checksum": checksum(first_grads),
            "max_abs_diff_vs_reference": float((grads - ref_grads).abs().max()),
            "relative_diff_vs_reference": relative,
            "matches_reference": relative <= HOROVOD_RTOL,
            "grad_norm_ratio_vs_reference": round(float(grads.abs().sum()) / max(float(ref_grads.abs().sum()), 1e-30), 6),
            "grad_norm": float(grads.norm()),
            "reference_grad_norm": float(ref_grads.norm()),
        },
        "param-sync": {"checksums": param_sums, "optimizer_state": state_sum},
        "convergence": {"losses": losses, "reference_losses": reference["losses"], "local_losses": local_losses,
                        "lr": lr, "scaled_lr": scaled_lr},
    }


def main(argv: list[str] | None = None) -> int:
    """Entry point on each rank: `python -m distdoctor.probe.builtin.horovod_worker --out DIR [...]`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--fault", choices=sorted(FAULTS), default="none")
    args = parser.parse_args(argv)

    import torch

    torch.set_num_threads(1)  # ranks share the machine's cores
    import horovod.torch as hvd

    hvd.init()
    out = args.out / f"rank{hvd.rank()}.json"
    try:
        evidence = run_rank(rank_context(args.steps, args.fault))
    except Exception:
        out.write_text(json.dumps({"rank": hvd.rank(), "error": traceback.format_exc()}))
        raise
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(evidence))
    os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
