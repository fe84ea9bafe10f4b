"""DD504 fsdp-clip-local-norm: torch.nn.utils.clip_grad_norm_ on an FSDP (v1) model's shards."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP1, ShardEvent, type_checked

CLIP = "torch.nn.utils.clip_grad_norm_"


class FSDPClipLocalNorm(Rule):
    """
    ## What it does
    Flags `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)` where `model` is a
    `FullyShardedDataParallel` (FSDP v1) wrapper, or the module such a wrapper was built from,
    after the wrap.

    It stays silent for FSDP2 (`fully_shard`) and tensor-parallel models, whose parameters are
    DTensors that the utility reduces correctly, for DDP, and for FSDP with
    `sharding_strategy=ShardingStrategy.NO_SHARD` (every rank holds the whole gradient).

    ## Why is this bad?
    Under FSDP each rank holds one shard of every flattened gradient. The generic utility computes
    the norm of the tensors it is given, so every rank clips by the norm of *its own shard*: the
    ranks scale their shards by different factors, the update is no longer the clipped full
    gradient, and the model drifts from what a single GPU would train. FSDP's documentation says to
    call the wrapper's own `clip_grad_norm_`, which all-reduces the total norm first.

    ## Example
    ```python
    model = FSDP(model, device_id=local_rank)
    ...
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    ```

    ## Use instead
    ```python
    loss.backward()
    model.clip_grad_norm_(1.0)
    ```

    ## Fix safety
    No autofix: the wrapper's method must be called on the root FSDP instance, which the linter
    cannot always name.
    """

    code = "DD504"
    name = "fsdp-clip-local-norm"
    severity = "error"
    summary = "torch.nn.utils.clip_grad_norm_ on FSDP (v1) shards clips by a per-rank norm"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model, device_id=local_rank)
            for x, y in loader:
                loss_fn(model(x), y).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: DD504
                optimizer.step()
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import FullyShardedDataParallel
            from torch.nn.utils import clip_grad_norm_

            class Trainer:
                def __init__(self, model):
                    self.model = FullyShardedDataParallel(model)

                def step(self, loss):
                    loss.backward()
                    clip_grad_norm_(self.model.parameters(), max_norm=0.5)  # expect: DD504
            """
        ),
        Example(
            """
            import torch.nn as nn
            import torch.distributed.fsdp as fsdp

            def main(net, loader):
                wrapped = fsdp.FullyShardedDataParallel(net, use_orig_params=True)
                params = [p for p in net.parameters() if p.requires_grad]
                for batch in loader:
                    wrapped(batch).sum().backward()
                    nn.utils.clip_grad_norm_(params, 1.0)  # expect: DD504
            """
        ),
    )
    valid = (
        Example(
            # The other branch of the test clips through the FSDP wrapper's own method: this branch is
            # the path for the other strategies, which the test tells apart.
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP


            class Trainer:
                def __init__(self, model, strategy):
                    self.strategy = strategy
                    if strategy == "fsdp":
                        self.model = FSDP(model)
                    else:
                        self.model = torch.nn.parallel.DistributedDataParallel(model)

                def step(self, loss, optimizer):
                    loss.backward()
                    if self.strategy == "fsdp":
                        self.model.clip_grad_norm_(1.0)
                    else:
                        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def clip(model, max_norm):
                if isinstance(model, FSDP):
                    return model.clip_grad_norm_(max_norm)
                return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)

            model = FSDP(model)
            clip(model, 1.0)
            """
        ),
        Example(
            """
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model)
            loss.backward()
            model.clip_grad_norm_(1.0)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # DTensor gradients: fine
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, ShardingStrategy

            model = FSDP(model, sharding_strategy=ShardingStrategy.NO_SHARD)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # before the wrap
            teacher = FSDP(teacher)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # another model
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP1):
            return
        for trace, step, call in ctx.calls(CLIP):
            params = syntax.argument(call, 0, "parameters")
            if params is None or type_checked(ctx, step, call):
                continue  # `if isinstance(model, FSDP): ... else: clip_grad_norm_(...)`
            if _wrapper_clip_in_other_branch(ctx, step):
                continue  # `if strategy == FSDP: model.clip_grad_norm_(...) else: clip_grad_norm_(...)`
            for key, _ in sharding.params_owners(trace, step, params):
                event = _fsdp1_of(sharding, trace, step, key)
                if event is None or _no_shard(ctx, event.call):
                    continue
                line = ctx.position(event.call).start.line
                yield Report(
                    call,
                    f"torch.nn.utils.clip_grad_norm_ on the parameters of the FSDP model wrapped on line {line}: each "
                    f"rank clips by the norm of its own shard, not of the whole gradient. Call the wrapper's "
                    f"`clip_grad_norm_(max_norm)` instead.",
                )
                break


def _wrapper_clip_in_other_branch(ctx: LintContext, step) -> bool:
    """The clip sits in one branch of an `if` whose other branch clips through a wrapper's own
    `clip_grad_norm_` method: the script tells its FSDP path from its other ones by a test this
    file may not decide (`self.train_strategy == TrainStrategy.FSDP`), and clips right in each."""
    for guard in step.guards:
        branch = ctx.parent(guard.test)
        if not isinstance(branch, cst.If):
            continue
        other = branch.body if guard.negated else branch.orelse
        if other is None:
            continue
        for node in syntax.walk(other):
            if (
                isinstance(node, cst.Call)
                and isinstance(node.func, cst.Attribute)
                and node.func.attr.value == "clip_grad_norm_"
                and ctx.qualname(node.func) is None
            ):
                return True
    return False


def _fsdp1_of(sharding, trace, step, key) -> ShardEvent | None:
    for event in sharding.events:
        if event.trace is not trace or event.kind != FSDP1 or event.step.index >= step.index:
            continue
        if event.wrapper_key == key or event.holds(key):
            return event
    return None


def _no_shard(ctx: LintContext, call: cst.Call) -> bool:
    strategy = syntax.keyword(call, "sharding_strategy")
    if strategy is None:
        return False
    text = ctx.code(strategy)
    return "NO_SHARD" in text or not isinstance(strategy, cst.Attribute)  # computed: cannot tell
