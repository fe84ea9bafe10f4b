"""Whether a quantity is scaled by the number of workers: a learning rate multiplied by the world
size, a per-worker batch divided by it. Shared by the learning-rate rules (DD104, DD401)."""

from __future__ import annotations

import libcst as cst

from distdoctor.lint.analysis import syntax
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.trace import Step, Trace

LOADER = "torch.utils.data.DataLoader"
GPU_COUNT = "torch.cuda.device_count"
WORKER_COUNT_WORDS = ("world", "gpus", "gpu_count", "n_gpu", "nproc", "replicas", "num_workers_total", "nodes")
MAX_FOLLOW = 4


def batch_divided_by_workers(ctx) -> bool:
    """A DataLoader whose batch size is scaled by the number of workers (`args.batch_size //
    world_size`): the global batch stays the same however many workers run, so the learning
    rate needs no scaling."""
    for trace, step, call in ctx.calls(LOADER):
        batch = syntax.argument(call, 1, "batch_size")
        if batch is not None and scaled_by_workers(ctx, trace, step, batch):
            return True
    return False


def scaled_by_workers(ctx, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """Scaled by the world size, or by a name that counts the workers (`world_size` passed to an
    `mp.spawn` worker, `ngpus_per_node`), directly or through what the names in `expr` were
    assigned (`args.batch_size = int(args.batch_size / ngpus_per_node)` before the loader,
    `lr_schedule = cosine_scheduler(base * get_world_size(), ...)` before `group["lr"] =
    lr_schedule[it]`, also through a helper's parameter)."""
    if ctx.scales_with_world_size(trace, step, expr):
        return True
    for node in syntax.walk(expr):
        if isinstance(node, cst.Name) and any(word in node.value.lower() for word in WORKER_COUNT_WORDS):
            return True
        if isinstance(node, cst.Call) and ctx.qualname(node.func) == GPU_COUNT:
            return True
    if depth >= MAX_FOLLOW:
        return False
    for name in _dotted_names(expr):
        found = ctx.binding(trace, step, name)
        if found is not None and found[1] is not expr and scaled_by_workers(ctx, trace, found[0], found[1], depth + 1):
            return True
    return False


def _dotted_names(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    """The outermost names and dotted attributes read by `expr` (`args.batch_size`, not `args`)."""
    out: list[cst.BaseExpression] = []
    stack: list[cst.CSTNode] = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, cst.Lambda):
            continue
        if isinstance(node, cst.Name) or (isinstance(node, cst.Attribute) and dotted(node) is not None):
            out.append(node)
            continue
        for field in node.__dataclass_fields__:
            value = getattr(node, field)
            if isinstance(value, cst.CSTNode):
                stack.append(value)
            elif isinstance(value, (list, tuple)):
                stack.extend(item for item in value if isinstance(item, cst.CSTNode))
    return out
