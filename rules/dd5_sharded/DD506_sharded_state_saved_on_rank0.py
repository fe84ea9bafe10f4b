"""DD506 sharded-state-saved-on-rank0: torch.save of a sharded state dict on one rank."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP1, FSDP2, TP, Sharding, type_checked

SAVE = "torch.save"


class ShardedStateSavedOnRank0(Rule):
    """
    ## What it does
    Flags `torch.save(...)` under a rank-0 condition when what it saves holds `state_dict()` of a
    model sharded in place by `fully_shard` (FSDP2) or `parallelize_module` (tensor parallelism),
    of an optimizer over such a model or over an FSDP (v1) model (its state holds this rank's
    shard of each flat parameter), or of an FSDP (v1) model inside
    `FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT | LOCAL_STATE_DICT)`: directly,
    through a name, or in a checkpoint dict.

    It stays silent when the state was gathered first (`get_model_state_dict(model,
    options=StateDictOptions(full_state_dict=True))`, `.full_tensor()`), when it is written with
    `torch.distributed.checkpoint.save`, and for DDP and plain models.

    ## Why is this bad?
    The state dict of a sharded model holds `DTensor`s (or `ShardedTensor`s): each rank's entries
    are views of its own shard. Saved by rank 0 alone, the file holds one shard of every parameter
    and a placement that only makes sense inside the job; loading it elsewhere fails or, worse,
    loads 1/N of the model. The checkpoint looks fine until it is needed.

    ## Example
    ```python
    fully_shard(model)
    ...
    if rank == 0:
        torch.save(model.state_dict(), "model.pt")
    ```

    ## Use instead
    ```python
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(state, "model.pt")
    # or, sharded: dcp.save({"model": model.state_dict()}, checkpoint_id=path) on every rank
    ```

    ## Fix safety
    No autofix: gathering a full state dict needs memory the author must plan for.
    """

    code = "DD506"
    name = "sharded-state-saved-on-rank0"
    severity = "error"
    summary = "torch.save of an FSDP2/DTensor (sharded) state dict on one rank saves one shard"
    requires = (frameworks.SHARDING_WORDS, frameworks.SAVE_WORDS)

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model, device_id=local_rank)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            train(model, optimizer)
            if dist.get_rank() == 0:
                torch.save({"optimizer": optimizer.state_dict()}, "ckpt.pt")  # expect: DD506
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            train(model)
            if dist.get_rank() == 0:
                torch.save(model.state_dict(), "model.pt")  # expect: DD506
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.tensor.parallel import parallelize_module, ColwiseParallel

            def main(model, mesh, rank):
                model = parallelize_module(model, mesh, {"fc": ColwiseParallel()})
                optimizer = torch.optim.AdamW(model.parameters())
                train(model, optimizer)
                ckpt = {"model": model.state_dict(), "step": 10}
                if rank == 0:
                    torch.save(ckpt, "ckpt.pt")  # expect: DD506
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            class Trainer:
                def __init__(self, model):
                    fully_shard(model)
                    self.model = model
                    self.opt = torch.optim.AdamW(self.model.parameters())

                def save(self):
                    if self.is_main_process():
                        torch.save({"optimizer": self.opt.state_dict()}, "opt.pt")  # expect: DD506
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(model)
            optimizer = torch.optim.AdamW(model.parameters())
            osd = FSDP.optim_state_dict(model, optimizer)  # gathered on every rank
            if dist.get_rank() == 0:
                torch.save(osd, "optim.pt")
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

            fully_shard(model)
            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if dist.get_rank() == 0:
                torch.save(state, "model.pt")
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            state = {k: v.full_tensor() for k, v in model.state_dict().items()}
            if dist.get_rank() == 0:
                torch.save(state, "model.pt")
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            if dist.get_rank() == 0:
                torch.save(model.module.state_dict(), "model.pt")
            """
        ),
        Example(
            """
            import torch.distributed.checkpoint as dcp
            from torch.distributed.fsdp import fully_shard

            fully_shard(model)
            dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.any:
            return
        optimizers = {id(call): (trace, step, call) for trace, step, call in sharding.optimizers()}
        for trace, step, call in ctx.calls(SAVE):
            if not call.args or not ctx.under_rank_zero(trace, step) or type_checked(ctx, step, call):
                continue
            for part_step, part in ctx.parts_of(trace, step, call.args[0].value):
                what = _sharded_state(ctx, sharding, optimizers, trace, part_step, part)
                if what is None:
                    continue
                yield Report(
                    call,
                    f"torch.save on rank 0 of {what}: its tensors are this rank's shards (DTensor), so the file holds "
                    f"one shard, not the model. Gather first (get_model_state_dict(..., options="
                    f"StateDictOptions(full_state_dict=True))) on every rank, or save with "
                    f"torch.distributed.checkpoint on every rank.",
                )
                break


def _sharded_state(ctx: LintContext, sharding: Sharding, optimizers, trace: Trace, step: Step, expr: cst.BaseExpression) -> str | None:
    if not (isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value == "state_dict"):
        return None
    owner = expr.func.value
    event = sharding.in_place_sharded(trace, step, owner, FSDP2, TP)
    if event is not None:
        how = "fully_shard" if event.kind == FSDP2 else "parallelize_module"
        return f"`{ctx.code(expr)}` (sharded by {how} on line {ctx.position(event.call).start.line})"
    wrapper = sharding.fsdp1_wrapper(trace, step, owner)
    if wrapper is not None and _sharded_state_dict_type(ctx, step):
        return f"`{ctx.code(expr)}` (an FSDP model under a sharded/local state_dict_type)"
    value = trace.value(owner, step)
    if value is not None and value.kind == kinds.OPTIMIZER and id(value.node) in optimizers:
        opt_trace, opt_step, opt_call = optimizers[id(value.node)]
        params = syntax.argument(opt_call, 0, "params")
        if params is not None and opt_trace is trace:
            for key, _ in sharding.params_owners(opt_trace, opt_step, params):
                for event in sharding.events:
                    if event.trace is not trace or event.step.index >= step.index or event.kind not in (FSDP1, FSDP2, TP):
                        continue
                    if not (event.holds(key) or key == event.wrapper_key):
                        continue
                    if event.kind == FSDP1 and "NO_SHARD" in ctx.code(syntax.keyword(event.call, "sharding_strategy") or cst.Name("x")):
                        continue
                    return f"`{ctx.code(expr)}` (an optimizer over the model sharded on line {ctx.position(event.call).start.line}; gather it with FSDP.optim_state_dict / get_optimizer_state_dict)"
    return None


def _sharded_state_dict_type(ctx: LintContext, step: Step) -> bool:
    node: cst.CSTNode | None = step.node
    while node is not None:
        node = ctx.parent(node)
        if isinstance(node, cst.With) and any(
            "SHARDED_STATE_DICT" in ctx.code(item) or "LOCAL_STATE_DICT" in ctx.code(item) for item in node.items
        ):
            return True
    return False
