"""DD505 sharded-collective-under-rank-guard: a collective state-dict or checkpoint call made on
some ranks only."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis.context import LintContext, RankGuard
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.sharding import FSDP1, FSDP2, FSDP_CLASS, TP, type_checked

DCP = "torch.distributed.checkpoint"
DCP_CALLS = frozenset(
    {
        "save", "load", "async_save", "save_state_dict", "load_state_dict", "get_state_dict",
        "get_model_state_dict", "get_optimizer_state_dict", "set_state_dict", "set_model_state_dict",
        "set_optimizer_state_dict",
    }
)
STATE_DICT_CALLS = frozenset(
    {
        "get_state_dict", "get_model_state_dict", "get_optimizer_state_dict", "set_state_dict",
        "set_model_state_dict", "set_optimizer_state_dict",
    }
)
# FullyShardedDataParallel's static methods that gather or scatter across ranks.
FSDP_STATIC = frozenset(
    {
        "optim_state_dict", "full_optim_state_dict", "sharded_optim_state_dict",
        "scatter_full_optim_state_dict", "optim_state_dict_to_load", "summon_full_params",
    }
)
# Methods of an FSDP (v1) wrapper that all-gather (the default FULL_STATE_DICT) or unshard.
FSDP_METHODS = frozenset({"state_dict", "load_state_dict", "summon_full_params"})


class ShardedCollectiveUnderRankGuard(Rule):
    """
    ## What it does
    Flags a call that every rank must make, made under a rank condition (`if rank == 0:`,
    `if dist.get_rank() == 0:`, `if is_main_process():`, code after `if rank != 0: return`):
    `torch.distributed.checkpoint.save` / `load` / `async_save`, `get_state_dict`,
    `get_model_state_dict`, `get_optimizer_state_dict`, `set_state_dict` (and the model/optimizer
    variants), `FSDP.optim_state_dict(...)`, `FSDP.full_optim_state_dict(...)`,
    `FSDP.summon_full_params(...)`, and `state_dict()` / `load_state_dict()` /
    `summon_full_params()` on an FSDP (v1) wrapper (whose default `FULL_STATE_DICT` all-gathers).

    `get_state_dict` and its relatives count only when their model was sharded earlier on the code
    path (on a plain module they gather nothing: composer reads a rank-0 model's state that way
    before sharding). It stays silent when the call runs on every rank and only the write is
    guarded, when the other ranks make the same call on their side of the condition, and for
    `dcp.save(..., no_dist=True)`.

    ## Why is this bad?
    These calls are collectives: they all-gather shards or exchange checkpoint metadata between
    ranks. Rank 0 waits inside the call for peers that never enter it, and the job hangs until the
    NCCL timeout kills it — usually at the first checkpoint, hours into the run.

    ## Example
    ```python
    if dist.get_rank() == 0:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
            state = model.state_dict()
        torch.save(state, "model.pt")
    ```

    ## Use instead
    ```python
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        state = model.state_dict()          # every rank takes part
    if dist.get_rank() == 0:
        torch.save(state, "model.pt")       # one rank writes
    ```

    ## Fix safety
    No autofix: which statements to move out of the branch is the author's decision.
    """

    code = "DD505"
    name = "sharded-collective-under-rank-guard"
    severity = "error"
    summary = "collective state-dict/checkpoint call (dcp, get_state_dict, FSDP state_dict) under a rank guard"
    requires = (frameworks.DISTRIBUTED_WORDS, frozenset({"checkpoint", "FullyShardedDataParallel"}))

    invalid = (
        Example(
            """
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            if dist.get_rank() == 0:
                dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")  # expect: DD505
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP, StateDictType

            def main(model, rank):
                model = FSDP(model)
                train(model)
                if rank == 0:
                    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                        state = model.state_dict()  # expect: DD505
                    torch.save(state, "model.pt")
            """
        ),
        Example(
            """
            from torch.distributed.checkpoint.state_dict import get_state_dict
            from torch.distributed.fsdp import fully_shard

            def save(model, optimizer, path):
                model_sd, optim_sd = get_state_dict(model, optimizer)  # expect: DD505
                write(model_sd, optim_sd, path)

            def train(model, optimizer, args):
                fully_shard(model)
                for step in range(args.steps):
                    if args.rank == 0 and step % 100 == 0:
                        save(model, optimizer, args.out)

            train(model, optimizer, args)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def checkpoint(model, optimizer, local_rank):
                if local_rank != 0:
                    return
                osd = FSDP.optim_state_dict(model, optimizer)  # expect: DD505
                torch.save(osd, "optim.pt")

            checkpoint(model, optimizer, int(os.environ["LOCAL_RANK"]))
            """
        ),
    )
    valid = (
        Example(
            # The rank-0 save of the DDP arm: the model is FSDP only in the other branch of the same
            # flag, where every rank gathers.
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            from torch.nn.parallel import DistributedDataParallel as DDP


            def train(args, model, path):
                if args.use_fsdp:
                    model = FSDP(model)
                else:
                    model = DDP(model)
                if args.use_fsdp:
                    state = model.state_dict()
                    if dist.get_rank() == 0:
                        torch.save(state, path)
                else:
                    if dist.get_rank() == 0:
                        torch.save(model.state_dict(), path)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            model = FSDP(build_model()) if args.fsdp else torch.nn.parallel.DistributedDataParallel(build_model())
            full = None
            if args.fsdp:
                full = model.state_dict()  # every rank gathers
            if dist.get_rank() == 0:
                # only the non-FSDP arm asks the model here
                torch.save(full if args.fsdp else model.state_dict(), "model.pt")
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

            state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            if dist.get_rank() == 0:
                torch.save(state, "model.pt")
            """
        ),
        Example(
            """
            import torch.distributed.checkpoint as dcp

            dcp.save({"model": model.state_dict()}, checkpoint_id="ckpt")
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(model)
            if dist.get_rank() == 0:
                torch.save(model.module.state_dict(), "model.pt")  # DDP: no collective
            """
        ),
        Example(
            """
            import torch.distributed as dist
            import torch.distributed.checkpoint as dcp

            if dist.get_rank() == 0:
                dcp.save(state, checkpoint_id=path)
            else:
                dcp.save(state, checkpoint_id=path)
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, StateDictOptions

            model = Net()  # not sharded yet: nothing to gather
            if dist.get_rank() == 0:
                full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed or not any(word in ctx.source for word in ("checkpoint", "FullyShardedDataParallel")):
            return
        if not _may_have_collectives(ctx):
            return
        for trace in ctx.traces:
            every = [(step, call, name, ctx.rank_guards(trace, step)) for step, call, name in _collectives(ctx, trace)]
            for step, call, name, guards in every:
                if not guards:
                    continue
                if _matched(guards, name, every) or _one_arm_of_a_conditional(ctx, call, step):
                    continue
                guard = guards[-1]
                where = ("local rank 0" if guard.local else "rank 0") if guard.zero else "the ranks other than 0"
                line = ctx.position(guard.guard.test).start.line
                yield Report(
                    call,
                    f"`{name}` is a collective (every rank must call it) but runs only on {where} (condition on line "
                    f"{line}): the job hangs. Call it on every rank and guard only the write to disk.",
                )


def _one_arm_of_a_conditional(ctx: LintContext, call: cst.Call, step: Step) -> bool:
    """`cpu_state if args.fsdp else model.state_dict()`: the call runs only when its arm is
    chosen, and the other arm says the author handled the sharded case apart: cannot decide."""
    node: cst.CSTNode | None = call
    while node is not None and node is not step.node:
        parent = ctx.parent(node)
        if isinstance(parent, cst.IfExp) and node is not parent.test:
            return True
        node = parent
    return False


def _may_have_collectives(ctx: LintContext) -> bool:
    """Whether any call of the file can be one `_collectives` yields, without the traces: a DCP or
    static FSDP call, or a method of an FSDP (v1) wrapper."""
    if any(qual.startswith(DCP) or qual.rpartition(".")[0] in FSDP_CLASS for qual in ctx.called_qualnames):
        return True
    return ctx.sharding.uses(FSDP1)


def _collectives(ctx: LintContext, trace: Trace) -> Iterator[tuple[Step, cst.Call, str]]:
    sharding = ctx.sharding
    for step, call in trace.calls():
        qual = ctx.qualname(call.func) or ""
        head, _, last = qual.rpartition(".")
        if head.startswith(DCP) and last in DCP_CALLS:
            if last in STATE_DICT_CALLS:
                # Collective only for a sharded model: on a plain module nothing is gathered.
                model = syntax.argument(call, 0, "model")
                if model is None or sharding.sharded_before(trace, step, model, FSDP1, FSDP2, TP) is None:
                    continue
            elif _is_true(syntax.keyword(call, "no_dist")):
                continue
            yield step, call, last
            continue
        if head in FSDP_CLASS and last in FSDP_STATIC:
            yield step, call, f"FSDP.{last}"
            continue
        if isinstance(call.func, cst.Attribute) and call.func.attr.value in FSDP_METHODS and sharding.uses(FSDP1):
            if sharding.fsdp1_wrapper(trace, step, call.func.value) is not None and not _local_state_dict(ctx, step) and not type_checked(ctx, step, call):
                yield step, call, f"{ctx.code(call.func)}() of an FSDP model"


def _local_state_dict(ctx: LintContext, step: Step) -> bool:
    """Inside `with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT)`: no gather."""
    node: cst.CSTNode | None = step.node
    while node is not None:
        node = ctx.parent(node)
        if isinstance(node, cst.With) and any("LOCAL_STATE_DICT" in ctx.code(item) for item in node.items):
            return True
    return False


def _matched(guards: list[RankGuard], name: str, every: list) -> bool:
    sides = {guard.zero for guard in guards}
    if len(sides) > 1:
        return True  # contradictory guards: cannot tell who runs it
    side = sides.pop()
    return any(other_name == name and any(g.zero != side for g in other_guards) for _, _, other_name, other_guards in every)


def _is_true(expr: cst.BaseExpression | None) -> bool:
    return isinstance(expr, cst.Name) and expr.value == "True"
