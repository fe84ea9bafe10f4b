"""DD507 fp16-without-sharded-scaler: float16 with FSDP and a plain GradScaler (or none)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FLOAT16, FSDP1, FSDP2, dtype_name

AUTOCAST = frozenset({"torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.amp.autocast_mode.autocast"})
CUDA_AUTOCAST = "torch.cuda.amp.autocast"  # float16 unless told otherwise
POLICIES = frozenset(
    {
        "torch.distributed.fsdp.MixedPrecision",
        "torch.distributed.fsdp.MixedPrecisionPolicy",
        "torch.distributed._composable.fsdp.MixedPrecisionPolicy",
        "torch.distributed.fsdp.fully_sharded_data_parallel.MixedPrecision",
    }
)
PLAIN_SCALER = "torch.amp.GradScaler"


class FP16WithoutShardedScaler(Rule):
    """
    ## What it does
    Flags float16 mixed precision in an FSDP or FSDP2 script that has no `ShardedGradScaler`:
    `torch.autocast(..., dtype=torch.float16)`, `torch.cuda.amp.autocast()`,
    `MixedPrecision(param_dtype=torch.float16)` or `MixedPrecisionPolicy(param_dtype=torch.float16)`.
    When the script builds a plain `torch.amp.GradScaler` / `torch.cuda.amp.GradScaler`, the
    finding points at it; when it builds none, at the float16 setting.

    It stays silent for bfloat16, for a dtype it cannot read, when a `ShardedGradScaler` (or a
    scaler of the script's own) is used, when Accelerate's `Accelerator` runs the training (it
    builds a ShardedGradScaler itself for float16 under FSDP), and in scripts that shard nothing.

    ## Why is this bad?
    float16 gradients underflow without loss scaling. The plain `GradScaler` decides whether a
    step overflowed from the gradients this rank holds, which under FSDP are shards: one rank may
    skip `optimizer.step()` while the others take it, and the shards of one parameter fall out of
    step with each other. FSDP's `ShardedGradScaler` all-reduces the overflow check across ranks.
    bfloat16 needs no scaler at all.

    ## Example
    ```python
    model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    scaler = torch.cuda.amp.GradScaler()
    ```

    ## Use instead
    ```python
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
    scaler = ShardedGradScaler()
    # or MixedPrecision(param_dtype=torch.bfloat16) and no scaler
    ```

    ## Fix safety
    No autofix: replacing the scaler changes which import the script needs and how its state is
    checkpointed.
    """

    code = "DD507"
    name = "fp16-without-sharded-scaler"
    severity = "warning"
    summary = "float16 with FSDP and a plain GradScaler (or none): use ShardedGradScaler or bfloat16"
    requires = (frameworks.SHARDING_WORDS | frozenset({"MixedPrecision", "MixedPrecisionPolicy"}),)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

            model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
            scaler = torch.cuda.amp.GradScaler()  # expect: DD507
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            for x in loader:
                with torch.autocast("cuda", dtype=torch.float16):  # expect: DD507
                    loss = model(x).sum()
                loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.cuda.amp import autocast, GradScaler
            from torch.distributed.fsdp import FullyShardedDataParallel

            def main(net):
                model = FullyShardedDataParallel(net)
                scaler = GradScaler(enabled=True)  # expect: DD507
                for x in loader:
                    with autocast():
                        loss = model(x).sum()
                    scaler.scale(loss).backward()
            """
        ),
    )
    valid = (
        Example(
            # A float16 autocast under `torch.no_grad()` (a frozen encoder's forward) makes no gradients
            # to underflow; the sharded model trains in bfloat16.
            """
            import torch
            from torch.distributed.fsdp import fully_shard


            def encode(vae, video):
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
                    return vae.encode(video)


            def train_step(model, vae, video, optimizer):
                latents = encode(vae, video)
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(latents).mean()
                loss.backward()
                optimizer.step()


            model = fully_shard(torch.nn.Linear(8, 8))
            """
        ),
        Example(
            # Accelerate builds the ShardedGradScaler itself for fp16 under its FSDP plugin, and steps
            # the prepared optimizer through it.
            """
            import torch
            from accelerate import Accelerator, FullyShardedDataParallelPlugin
            from torch.distributed.fsdp import MixedPrecision


            def main(args):
                policy = MixedPrecision(param_dtype=torch.float16, reduce_dtype=torch.float16, buffer_dtype=torch.float16)
                fsdp_plugin = FullyShardedDataParallelPlugin(mixed_precision_policy=policy)
                accelerator = Accelerator(mixed_precision=args.mixed_precision, fsdp_plugin=fsdp_plugin)
                model = build_model()
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
                model, optimizer, loader = accelerator.prepare(model, optimizer, make_loader())
                for batch in loader:
                    loss = model(**batch).loss
                    accelerator.backward(loss)
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision

            fp16_policy = MixedPrecision(param_dtype=torch.float16)  # defined, never given to FSDP
            bf16_policy = MixedPrecision(param_dtype=torch.bfloat16)
            model = FSDP(build_model(), mixed_precision=bf16_policy if args.bf16 else None)
            scaler = torch.cuda.amp.GradScaler(enabled=False)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, MixedPrecision
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            model = FSDP(model, mixed_precision=MixedPrecision(param_dtype=torch.float16))
            scaler = ShardedGradScaler()
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            scaler = torch.cuda.amp.GradScaler()  # DDP: the plain scaler is right
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).sum()
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            with torch.autocast("cuda", dtype=args.dtype):  # cannot tell
                loss = model(x).sum()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        sources = list(_fp16_sources(ctx, sharding.uses(FSDP1, FSDP2)))
        if not sources or _has_other_scaler(ctx):
            return
        plain = [node for node in ctx.nodes(cst.Call) if ctx.qualname(node.func) == PLAIN_SCALER]
        source_line = ctx.position(sources[0][0]).start.line
        if plain:
            for node in plain:
                yield Report(
                    node,
                    f"a plain GradScaler with float16 under FSDP (line {source_line}): it checks for overflow on this "
                    f"rank's gradient shards only, so ranks can disagree on skipping a step. Use "
                    f"torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler, or bfloat16 without a scaler.",
                )
            return
        for node, what in sources:
            yield Report(
                node,
                f"{what} with FSDP and no gradient scaler: float16 gradients underflow. Use bfloat16, or scale the "
                f"loss with torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler.",
            )


def _fp16_sources(ctx: LintContext, shards: bool) -> Iterator[tuple[cst.Call, str]]:
    for node in ctx.nodes(cst.Call):
        qual = ctx.qualname(node.func)
        if qual in POLICIES:
            if dtype_name(ctx, syntax.argument(node, 0, "param_dtype")) in FLOAT16 and not _unused_policy(ctx, node):
                yield node, f"{qual.rsplit('.', 1)[-1]}(param_dtype=torch.float16)"
        elif shards and qual in AUTOCAST and not ctx.no_grad_around(node):  # no gradients to underflow
            dtype = syntax.keyword(node, "dtype")
            if dtype is None and qual == CUDA_AUTOCAST and syntax.keyword(node, "enabled") is None:
                yield node, "torch.cuda.amp.autocast() (float16)"
            elif dtype is not None and dtype_name(ctx, dtype) in FLOAT16:
                yield node, "float16 autocast"


def _unused_policy(ctx: LintContext, policy: cst.Call) -> bool:
    """`fp16_policy = MixedPrecision(param_dtype=torch.float16)` and the name never read again: a
    policy defined beside the one the model is really given."""
    assign = ctx.parent(policy)
    if not isinstance(assign, cst.Assign) or len(assign.targets) != 1 or not isinstance(assign.targets[0].target, cst.Name):
        return False
    name = assign.targets[0].target
    return not any(node.value == name.value and node is not name for node in ctx.nodes(cst.Name))


def _has_other_scaler(ctx: LintContext) -> bool:
    """A ShardedGradScaler, or a scaler class of the script's own: assume it is right. So is
    Accelerate's: `Accelerator(mixed_precision="fp16", fsdp_plugin=...)` builds a
    ShardedGradScaler itself and steps the prepared optimizer through it."""
    calls = list(ctx.nodes(cst.Call))
    for node in calls:
        text = dotted(node.func) or ""
        if "Scaler" in text.rsplit(".", 1)[-1] and ctx.qualname(node.func) != PLAIN_SCALER:
            return True
    if any(ctx.qualname(node.func) == PLAIN_SCALER for node in calls):
        return False
    return any((ctx.qualname(node.func) or "").startswith("accelerate.") and (dotted(node.func) or "").endswith("Accelerator") for node in calls)
