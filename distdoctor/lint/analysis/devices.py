"""Where a script names a CUDA device, and where it relies on the current one.

Several rules ask the same questions about devices: which expression is used as a CUDA device
index (`torch.cuda.set_device(i)`, `.to(i)`, `.cuda(i)`, `device_ids=[i]`, `f"cuda:{i}"`,
`torch.device("cuda", i)`), and which calls use whatever device is current (a bare `.cuda()`,
`.to("cuda")`, `DDP(model)` without `device_ids`). This module answers both along the traces, once
per file; the rules judge what the index is (a global rank, a local rank, an argparse flag).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.names import dotted

SET_DEVICE = "torch.cuda.set_device"
# torch >= 2.6's device-generic spelling of the same call
SET_DEVICE_INDEX = "torch.accelerator.set_device_index"
DEVICE_CONTEXT = "torch.cuda.device"
TORCH_DEVICE = "torch.device"
DDP = frameworks.DDP
INIT_PROCESS_GROUP = frameworks.INIT_PROCESS_GROUP


@dataclass(frozen=True)
class DeviceIndex:
    """An expression used as a CUDA device index, with where it is used."""

    trace: Trace
    step: Step
    site: cst.CSTNode  # the call or string that uses it: where a finding points
    index: cst.BaseExpression  # the expression that is the index
    how: str  # "set_device", "to", "cuda", "device_ids", "output_device", "device", "string", "device_id"


def device_indices(ctx) -> Iterator[DeviceIndex]:
    """Every expression used as a CUDA device index on the code path, in trace order."""
    strings = ctx.index.cuda_strings
    if not strings and not _may_index(ctx):
        return  # no call below can select a device: no trace needs building to say so
    for trace in ctx.traces:
        for step, call in trace.calls():
            yield from _indices_of_call(ctx, trace, step, call)
        if not strings:
            continue
        for step in trace.steps:
            for string, index in _cuda_strings(step.node):
                yield DeviceIndex(trace, step, string, index, "string")


def _may_index(ctx) -> bool:
    """Whether the file makes any call `_indices_of_call` can read a device index from."""
    if not ctx.called_qualnames.isdisjoint(_INDEXING_CALLS):
        return True
    return ctx.may_call_method("to") or ctx.may_call_method("cuda")


_INDEXING_CALLS = frozenset(
    {SET_DEVICE, SET_DEVICE_INDEX, DEVICE_CONTEXT, TORCH_DEVICE, DDP, INIT_PROCESS_GROUP, *frameworks.FSDP_CLASS}
)


def _indices_of_call(ctx, trace: Trace, step: Step, call: cst.Call) -> Iterator[DeviceIndex]:
    qual = ctx.qualname(call.func)
    if qual in (SET_DEVICE, SET_DEVICE_INDEX, DEVICE_CONTEXT):
        arg = syntax.argument(call, 0, "device")
        if arg is not None and not _is_string(arg):
            yield DeviceIndex(trace, step, call, arg, "device" if qual == DEVICE_CONTEXT else "set_device")
        return
    if qual == TORCH_DEVICE:
        kind = syntax.argument(call, 0, "type")
        index = syntax.argument(call, 1, "index")
        if index is not None and kind is not None and syntax.string_value(kind) == "cuda":
            yield DeviceIndex(trace, step, call, index, "device")
        return
    if qual == DDP:
        ids = syntax.keyword(call, "device_ids")
        if isinstance(ids, (cst.List, cst.Tuple)):
            for element in ids.elements:
                if not _is_string(element.value):
                    yield DeviceIndex(trace, step, call, element.value, "device_ids")
        output = syntax.keyword(call, "output_device")
        if output is not None and not _is_string(output):
            yield DeviceIndex(trace, step, call, output, "output_device")
        return
    if qual == INIT_PROCESS_GROUP or qual in frameworks.FSDP_CLASS:  # FSDP(model, device_id=local_rank)
        device_id = syntax.keyword(call, "device_id")
        if device_id is not None:
            yield DeviceIndex(trace, step, call, device_id, "device_id")
        return
    if qual is None and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("to", "cuda"):
        method = call.func.attr.value
        arg = syntax.argument(call, 0, "device")
        if arg is not None and not _is_string(arg) and not _is_literal(arg) and not _looks_like_dtype(arg):
            yield DeviceIndex(trace, step, call, arg, method)


_STRINGS_MEMO = syntax.file_memo(100_000)


def _cuda_strings(node: cst.CSTNode) -> list[tuple[cst.CSTNode, cst.BaseExpression]]:
    """`f"cuda:{i}"`, `"cuda:%d" % i`, `"cuda:{}".format(i)`, `"cuda:" + str(i)` in a statement.
    Memoised: a function inlined at several call sites is the same statement each time."""
    entry = _STRINGS_MEMO.get(id(node))
    if entry is not None and entry[0] is node:
        return entry[1]
    return _STRINGS_MEMO.remember(node, list(_scan_cuda_strings(node)))


def _scan_cuda_strings(node: cst.CSTNode) -> Iterator[tuple[cst.CSTNode, cst.BaseExpression]]:
    if isinstance(node, _STEP_BOUNDARIES):
        return  # the bodies of compound statements are steps of their own
    for inner in syntax.walk(node, skip=_STEP_BOUNDARIES):
        if isinstance(inner, cst.FormattedString):
            for before, after in itertools.pairwise(inner.parts):
                if (
                    isinstance(before, cst.FormattedStringText)
                    and before.value.endswith("cuda:")
                    and isinstance(after, cst.FormattedStringExpression)
                ):
                    yield inner, after.expression
        elif isinstance(inner, cst.BinaryOperation):
            text = syntax.string_value(inner.left)
            if text is None:
                continue
            if isinstance(inner.operator, cst.Modulo) and text.startswith("cuda:%"):
                right = inner.right
                if isinstance(right, cst.Tuple) and right.elements:
                    right = right.elements[0].value
                yield inner, right
            elif isinstance(inner.operator, cst.Add) and text == "cuda:":
                right = inner.right
                if isinstance(right, cst.Call) and dotted(right.func) == "str" and right.args:
                    right = right.args[0].value
                yield inner, right
        elif isinstance(inner, cst.Call):
            func = inner.func
            if isinstance(func, cst.Attribute) and func.attr.value == "format" and inner.args:
                text = syntax.string_value(func.value)
                if text is not None and text.startswith("cuda:{"):
                    yield inner, inner.args[0].value


# Not entered when looking for device strings in one step.
_STEP_BOUNDARIES = (cst.FunctionDef, cst.ClassDef, cst.IndentedBlock)


def current_device_uses(ctx) -> Iterator[tuple[Trace, Step, cst.Call, str]]:
    """Calls that put tensors or modules on whatever CUDA device is current: `x.cuda()`,
    `x.to("cuda")`, `x.to(torch.device("cuda"))`, `x.to(device)` with `device` bound to one of
    those. Yields (trace, step, call, how)."""
    for trace in ctx.traces:
        for step, call in trace.calls():
            func = call.func
            if ctx.qualname(func) is not None or not isinstance(func, cst.Attribute):
                continue
            method = func.attr.value
            if method == "cuda" and not call.args:
                yield trace, step, call, "cuda()"
            elif method == "to":
                arg = syntax.argument(call, 0, "device")
                if arg is not None and _means_current_cuda(ctx, trace, step, arg):
                    yield trace, step, call, "to"


def _means_current_cuda(ctx, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> bool:
    if syntax.string_value(expr) == "cuda":
        return True
    if isinstance(expr, cst.IfExp):  # "cuda" if torch.cuda.is_available() else "cpu"
        return _means_current_cuda(ctx, trace, step, expr.body, depth + 1)
    if isinstance(expr, cst.Call) and ctx.qualname(expr.func) == TORCH_DEVICE:
        return len(expr.args) == 1 and _means_current_cuda(ctx, trace, step, expr.args[0].value, depth + 1)
    if depth < 3 and isinstance(expr, (cst.Name, cst.Attribute)):
        value = trace.value(expr, step)
        bound = _bound_expression(value)
        if bound is not None:
            return _means_current_cuda(ctx, trace, step, bound, depth + 1)
    return False


def _bound_expression(value: kinds.Value | None) -> cst.BaseExpression | None:
    """The right-hand side a name was bound from, when the flow knows no better value."""
    if value is None or value.kind != kinds.UNKNOWN:
        return None
    node = value.node
    if isinstance(node, cst.Assign):
        return node.value
    if isinstance(node, cst.AnnAssign):
        return node.value
    return None


def selects_device_explicitly(ctx) -> bool:
    """Whether the module selects a device per process anywhere, on the code path or not:
    `torch.cuda.set_device`, `torch.cuda.device(...)`, `init_process_group(device_id=...)`,
    `CUDA_VISIBLE_DEVICES` set, or an explicit index anywhere (`.to(local_rank)`, `.cuda(gpu)`,
    `f"cuda:{i}"`, `torch.device("cuda", i)`). `DDP(device_ids=...)` is no selection: it names
    the device the module must already be on."""
    plain_names = _current_device_names(ctx)
    finder = _ExplicitDeviceFinder(ctx, plain_names)
    for call in ctx.nodes(cst.Call):
        finder.visit_Call(call)
        if finder.found:
            return True
    for string in ctx.nodes(cst.FormattedString):
        finder.visit_FormattedString(string)
    for string in ctx.nodes(cst.SimpleString):
        finder.visit_SimpleString(string)
    return finder.found


def one_process_per_host(ctx) -> bool:
    """The mark of examples run one process per pod or host (Kubeflow's PyTorchJob, SageMaker):
    every process group starts with a backend the user picks (`backend=args.backend`), no process
    selects a device of its own (each has one GPU, `"cuda"`), and nothing spawns workers or uses
    Horovod. Each process then also writes into its own container's disk. SageMaker's own mark,
    `rank = hosts.index(current_host)`, says so by itself."""
    if "current_host" in ctx.source:
        return True
    calls = [call for _, _, call in ctx.calls(INIT_PROCESS_GROUP)]
    if not calls or ctx.uses_horovod or ctx.info.spawn_targets:
        return False
    if "local_rank" in ctx.source.lower() or "device_ids" in ctx.source:
        return False  # a process per GPU of a machine
    literal_names = {
        dotted(target.target)
        for node in ctx.nodes(cst.Assign)
        if isinstance(node.value, cst.SimpleString)
        for target in node.targets
    }
    for call in calls:
        backend = syntax.argument(call, 0, "backend")
        if not isinstance(backend, (cst.Name, cst.Attribute)) or dotted(backend) in literal_names:
            return False  # `backend = "mpi"`: the script's own choice
    return not selects_device_explicitly(ctx)


def _current_device_names(ctx) -> set[str]:
    """Names assigned a device without index anywhere: `device = torch.device("cuda")`."""
    names: set[str] = set()
    for node in ctx.nodes(cst.Assign):
        if _plain_device(ctx, node.value):
            for target in node.targets:
                text = dotted(target.target)
                if text is not None:
                    names.add(text)
    return names


def _plain_device(ctx, expr: cst.BaseExpression) -> bool:
    if syntax.string_value(expr) in ("cuda", "cpu") or _plain_device_choice(expr):
        return True
    if isinstance(expr, cst.Call) and ctx.qualname(expr.func) == TORCH_DEVICE and len(expr.args) == 1:
        return _plain_device(ctx, expr.args[0].value)
    return False


class _ExplicitDeviceFinder:
    """The checks of `selects_device_explicitly`, one per node type, fed from the node index."""

    def __init__(self, ctx, plain_names: set[str]) -> None:
        self.ctx = ctx
        self.plain_names = plain_names
        self.found = False

    def visit_Call(self, call: cst.Call) -> None:
        qual = self.ctx.qualname(call.func) or ""
        last = (dotted(call.func) or "").rsplit(".", 1)[-1]
        if qual in (SET_DEVICE, SET_DEVICE_INDEX, DEVICE_CONTEXT) or last in ("set_device", "set_device_index"):
            self.found = True
        elif qual == INIT_PROCESS_GROUP:
            if syntax.keyword(call, "device_id") is not None:
                self.found = True
        elif qual == TORCH_DEVICE:
            kind = syntax.argument(call, 0, "type")
            if syntax.argument(call, 1, "index") is not None:
                self.found = True
            elif kind is not None and not _plain_device(self.ctx, kind) and syntax.string_value(kind) != "cuda":
                self.found = True  # "cuda:1", or a variable that may well hold "cuda:N"
        elif qual == "" and isinstance(call.func, cst.Attribute) and call.func.attr.value in ("cuda", "to"):
            arg = syntax.argument(call, 0, "device")
            if arg is None or _looks_like_dtype(arg) or _plain_device(self.ctx, arg):
                return
            if (dotted(arg) or "") in self.plain_names or _is_literal(arg) and call.func.attr.value == "to":
                return
            if isinstance(arg, (cst.SimpleString, cst.ConcatenatedString)) and syntax.string_value(arg) in (None, "cpu"):
                return
            self.found = True  # .cuda(gpu), .to(local_rank), .to("cuda:1"), .to(device)

    def visit_FormattedString(self, node: cst.FormattedString) -> None:
        if any(isinstance(p, cst.FormattedStringText) and "cuda:" in p.value for p in node.parts):
            self.found = True

    def visit_SimpleString(self, node: cst.SimpleString) -> None:
        text = syntax.string_value(node) or ""
        if text == "CUDA_VISIBLE_DEVICES" or text.startswith("cuda:"):
            self.found = True


def _plain_device_choice(node: cst.CSTNode) -> bool:
    """`"cuda" if torch.cuda.is_available() else "cpu"`: no index either way."""
    return (
        isinstance(node, cst.IfExp)
        and syntax.string_value(node.body) in ("cuda", "cpu")
        and syntax.string_value(node.orelse) in ("cuda", "cpu")
    )


def _is_string(node: cst.CSTNode) -> bool:
    return isinstance(node, (cst.SimpleString, cst.ConcatenatedString, cst.FormattedString))


def _is_literal(node: cst.CSTNode) -> bool:
    return isinstance(node, (cst.Integer, cst.Float)) or (isinstance(node, cst.Name) and node.value in ("None", "True", "False"))


def _looks_like_dtype(node: cst.CSTNode) -> bool:
    text = dotted(node) or ""
    return text.startswith("torch.") and text.rsplit(".", 1)[-1] in {
        "float", "float16", "float32", "float64", "half", "double", "bfloat16", "int", "int8", "int16",
        "int32", "int64", "long", "bool", "uint8", "complex64", "channels_last",
    }
