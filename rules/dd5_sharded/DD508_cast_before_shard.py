"""DD508 cast-before-shard: a model cast to half/bfloat16 before FSDP shards it for training."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule
from distdoctor.lint.analysis.sharding import FSDP1, FSDP2, ShardEvent, Sharding, low_precision_cast


class CastBeforeShard(Rule):
    """
    ## What it does
    Flags `.half()`, `.bfloat16()`, `.to(torch.bfloat16)` / `.to(dtype=torch.float16)` applied to a
    model before `fully_shard(model)` or `FullyShardedDataParallel(model)` shards it, when an
    optimizer is then built over that model's parameters.

    It stays silent for a model used only for inference (no optimizer over it: a frozen teacher
    or a reference model), for casts it cannot tie to the sharded model, and for DDP.

    ## Why is this bad?
    The cast makes the *parameters* low precision, so the sharded master weights, their gradients
    and the optimizer's state are all half or bfloat16: small updates round away (bfloat16 keeps 8
    bits of mantissa) and training stalls or diverges, while the script looks like ordinary mixed
    precision. FSDP keeps float32 master weights and computes in low precision when asked through
    `MixedPrecisionPolicy(param_dtype=torch.bfloat16)` (FSDP2) or
    `MixedPrecision(param_dtype=torch.bfloat16)` (FSDP).

    ## Example
    ```python
    model = Transformer(args).to(torch.bfloat16)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Use instead
    ```python
    model = Transformer(args)
    fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    optimizer = torch.optim.AdamW(model.parameters())
    ```

    ## Fix safety
    No autofix: pure low-precision training can be a deliberate choice (with a compensated
    optimizer); the policy to use instead depends on the model. Suppress the finding there.
    """

    code = "DD508"
    name = "cast-before-shard"
    severity = "warning"
    summary = "model cast to half/bfloat16 before fully_shard()/FSDP(): use a mixed-precision policy"
    requires = (frameworks.SHARDING_WORDS,)

    invalid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Transformer().to(torch.bfloat16)  # expect: DD508
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

            def main(net, local_rank):
                model = FSDP(net.half(), device_id=local_rank)  # expect: DD508
                opt = torch.optim.SGD(model.parameters(), lr=0.1)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            def main(model):
                model.bfloat16()  # expect: DD508
                for block in model.layers:
                    fully_shard(block)
                fully_shard(model)
                optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Net()
            model = model.cuda().to(dtype=torch.float16)  # expect: DD508
            fully_shard(model)
            opt = torch.optim.Adam(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            def build_model(cfg):
                model = Transformer(cfg)
                return model.to(torch.bfloat16)  # expect: DD508

            model = build_model(cfg)
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            teacher = Teacher().to(torch.bfloat16)
            fully_shard(teacher)  # inference only: no optimizer over it
            student = Student()
            fully_shard(student)
            optimizer = torch.optim.AdamW(student.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard, MixedPrecisionPolicy

            model = Transformer()
            fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = Net().half()
            model = DDP(model)
            optimizer = torch.optim.AdamW(model.parameters())
            """
        ),
        Example(
            """
            import torch
            from torch.distributed.fsdp import fully_shard

            model = Transformer()
            fully_shard(model)
            optimizer = torch.optim.AdamW(model.parameters())
            model.to(torch.float32)  # not a low-precision cast
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        sharding = ctx.sharding
        if not sharding.uses(FSDP1, FSDP2):
            return
        reported: set[int] = set()
        for event in sharding.events:
            if event.kind not in (FSDP1, FSDP2) or not _trained(sharding, event):
                continue
            for cast, dtype in _casts_before(ctx, sharding, event):
                if id(cast) in reported:
                    continue
                reported.add(id(cast))
                what = "fully_shard()" if event.kind == FSDP2 else "FullyShardedDataParallel()"
                policy = "MixedPrecisionPolicy" if event.kind == FSDP2 else "MixedPrecision"
                line = ctx.position(event.call).start.line
                yield Report(
                    cast,
                    f"the model is cast to {dtype} before {what} shards it (line {line}): master weights, gradients and "
                    f"optimizer state become {dtype}. Keep float32 parameters and pass {policy}(param_dtype={dtype}) "
                    f"to the sharding call instead.",
                )


def _trained(sharding: Sharding, event: ShardEvent) -> bool:
    """Whether an optimizer over the sharded model is built after the sharding call."""
    for trace, step, call in sharding.optimizers():
        if trace is not event.trace or step.index < event.step.index:
            continue
        params = syntax.argument(call, 0, "params")
        if params is None:
            continue
        for key, _ in sharding.params_owners(trace, step, params):
            if event.holds(key) or key == event.wrapper_key:
                return True
    return False


def _chain(expr: cst.BaseExpression) -> Iterator[cst.Call]:
    """The calls of a method chain `x.cuda().half()`, outermost first."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        yield expr
        expr = expr.func.value


def _casts_before(ctx: LintContext, sharding: Sharding, event: ShardEvent) -> Iterator[tuple[cst.Call, str]]:
    for call in _chain(event.target):
        dtype = low_precision_cast(ctx, call)
        if dtype is not None:
            yield call, dtype
    trace = event.trace
    for step in trace.steps[: event.step.index]:
        for call in syntax.own_calls(step.node):
            dtype = low_precision_cast(ctx, call)
            if dtype is None:
                continue
            if _cast_object(sharding, trace, step, call) and any(event.holds(key) for key in _cast_object(sharding, trace, step, call)):
                yield call, dtype


def _cast_object(sharding: Sharding, trace: Trace, step: Step, call: cst.Call) -> list:
    """Keys of the object a cast applies to: its receiver, and the name the result is bound to."""
    keys = [sharding.key(trace, step, call.func.value)]
    node = step.node
    if isinstance(node, cst.Assign) and len(node.targets) == 1 and any(c is call for c in _chain(node.value)):
        keys.append(sharding.key_after(trace, step, node.targets[0].target))
    if isinstance(node, cst.Return) and node.value is not None and any(c is call for c in _chain(node.value)):
        keys.extend(_bound_by_caller(sharding, trace, step))
    return [key for key in keys if key is not None]


def _bound_by_caller(sharding: Sharding, trace: Trace, step: Step) -> list:
    """`model = build_model(cfg)` where `build_model` returns the cast module: what `model`
    holds in the caller."""
    frame = step.frame
    if frame.call is None or frame.parent is None:
        return []
    for later in trace.steps[step.index + 1 :]:
        if later.frame is frame.parent and any(c is frame.call for c in syntax.own_calls(later.node)):
            node = later.node
            if isinstance(node, cst.Assign) and len(node.targets) == 1 and (node.value is frame.call or any(c is frame.call for c in _chain(node.value))):
                return [sharding.key_after(trace, later, node.targets[0].target)]
            return []
    return []
