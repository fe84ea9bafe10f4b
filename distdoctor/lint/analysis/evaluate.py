"""Evaluation of an expression to an abstract `Value` in the environment of one step of a trace:
`DDP(model)` is a DDP wrapper of that model, `int(os.environ["LOCAL_RANK"])` the local rank,
`rank == 0` a rank test."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import libcst as cst

from distdoctor.lint.analysis import frameworks
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.syntax import argument, const_value, keyword
from distdoctor.lint.analysis.kinds import (
    UNKNOWN, DDP, MODULE, SAMPLER, LOADER, OPTIMIZER, HVD_OPTIMIZER, SCALER,
    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_SIZE, RANK_TEST, INSTANCE, TUPLE, CONST,
    PARAMS, RANK_NAMES, LOCAL_RANK_NAMES, MAIN_PROCESS_FUNCS, Value, env_value,
)
from distdoctor.lint.analysis.scope import Frame, ModuleInfo


_PASSTHROUGH_METHODS = frozenset({"to", "cuda", "cpu", "train", "eval", "float", "half", "double", "bfloat16", "requires_grad_", "share_memory", "to_empty"})


def env_key(node: cst.CSTNode, frame: Frame) -> tuple[Any, ...] | None:
    """Where an assignment target lives: a local of the frame, an attribute of `self`, a global."""
    text = dotted(node)
    if text is None:
        if isinstance(node, cst.Subscript):
            base = dotted(node.value)
            return None if base is None else ("sub", frame.id, base)
        return None
    if text.startswith("self.") and frame.cls is not None:
        return ("self", frame.cls.name.value, text[5:])
    return ("local", frame.id, text)


def lookup(env: Mapping[Any, Value], text: str, frame: Frame) -> Value | None:
    if text.startswith("self.") and frame.cls is not None:
        return env.get(("self", frame.cls.name.value, text[5:]))
    for candidate in frame.chain():
        value = env.get(("local", candidate.id, text))
        if value is not None:
            return value
    return None


class Evaluator:
    """Evaluates an expression to a Value in a given environment."""

    def __init__(
        self,
        ctx: ModuleInfo,
        env: Mapping[Any, Value],
        frame: Frame,
        call_results: Mapping[int, Value | None],
    ) -> None:
        self.ctx = ctx
        self.env = env
        self.frame = frame
        self.call_results = call_results

    def eval(self, node: cst.BaseExpression) -> Value | None:
        if id(node) in self.call_results:
            return self.call_results[id(node)]
        method = getattr(self, "_eval_" + type(node).__name__, None)
        return method(node) if method is not None else None

    # names -----------------------------------------------------------------------------------
    def _eval_Name(self, node: cst.Name) -> Value | None:
        if node.value in ("True", "False", "None"):
            return self._const(node)
        value = lookup(self.env, node.value, self.frame)
        if value is not None:
            return value
        if node.value in RANK_NAMES:
            return Value(RANK, node, origin="name", name=node.value)
        if node.value in LOCAL_RANK_NAMES:
            return Value(LOCAL_RANK, node, origin="name", name=node.value)
        return None

    def _eval_Attribute(self, node: cst.Attribute) -> Value | None:
        text = dotted(node)
        if text is not None:
            value = lookup(self.env, text, self.frame)
            if value is not None:
                return value
        attr = node.attr.value
        base = self.eval(node.value)
        if base is not None:
            if base.kind == DDP and attr == "module":
                return base.inner or Value(MODULE, node, name=text or "")
            if base.kind == LOADER and attr == "sampler":
                return base.inner
            if base.kind == INSTANCE:
                cls_name = base.attrs.get("class")
                value = self.env.get(("self", cls_name, attr))
                if value is not None:
                    return value
        if self.ctx.qualname(node) is not None:
            return None
        if attr in RANK_NAMES:
            return Value(RANK, node, origin="attr", name=text or attr)
        if attr in LOCAL_RANK_NAMES:
            return Value(LOCAL_RANK, node, origin="attr", name=text or attr)
        if attr in MAIN_PROCESS_FUNCS:
            return Value(RANK_TEST, node, attrs={"zero": True}, origin="attr")
        return None

    # literals --------------------------------------------------------------------------------
    def _const(self, node: cst.BaseExpression) -> Value | None:
        known, value = const_value(node)
        return Value(CONST, node, attrs={"value": value}) if known else None

    _eval_Integer = _eval_Float = _eval_SimpleString = _const

    def _eval_UnaryOperation(self, node: cst.UnaryOperation) -> Value | None:
        if isinstance(node.operator, cst.Not):
            inner = self.eval(node.expression)
            if inner is not None and inner.kind == RANK_TEST:
                return replace(inner, node=node, attrs={**inner.attrs, "zero": not inner.attrs.get("zero")})
            return None
        return self._const(node)

    def _eval_Tuple(self, node: cst.Tuple) -> Value | None:
        return Value(TUPLE, node, items=tuple(self.eval(el.value) for el in node.elements))

    _eval_List = _eval_Tuple

    def _eval_Comparison(self, node: cst.Comparison) -> Value | None:
        zero = rank_comparison(node, self)
        return None if zero is None else Value(RANK_TEST, node, attrs={"zero": zero})

    def _eval_BooleanOperation(self, node: cst.BooleanOperation) -> Value | None:
        # `not distributed or rank == 0`: true on rank 0 (and everywhere when not distributed).
        for side in (node.left, node.right):
            value = self.eval(side)
            if value is not None and value.kind == RANK_TEST:
                return replace(value, node=node)
        return None

    def _eval_BinaryOperation(self, node: cst.BinaryOperation) -> Value | None:
        # `args.rank * ngpus + gpu` is a global rank; `rank % ngpus` a local one.
        left = self.eval(node.left)
        right = self.eval(node.right)
        if isinstance(node.operator, cst.Modulo) and left is not None and left.kind == RANK:
            return Value(LOCAL_RANK, node, origin="modulo")
        if isinstance(node.operator, (cst.Add, cst.Multiply)):
            kinds = {v.kind for v in (left, right) if v is not None}
            if RANK in kinds or (LOCAL_RANK in kinds and isinstance(node.operator, cst.Add) and _node_offset(node, left, right)):
                return Value(RANK, node, origin="arith")
        if isinstance(node.operator, (cst.Multiply, cst.Divide, cst.FloorDivide)):
            kinds = {v.kind for v in (left, right) if v is not None}
            if kinds & {WORLD_SIZE, LOCAL_SIZE}:
                return Value("scaled", node, attrs={"by": sorted(kinds & {WORLD_SIZE, LOCAL_SIZE})})
            scaled = [v for v in (left, right) if v is not None and v.kind == "scaled"]
            if scaled:
                return scaled[0]
        return None

    def _eval_Subscript(self, node: cst.Subscript) -> Value | None:
        env_var = environ_name(node, self.ctx)
        if env_var is not None:
            return env_value(env_var, node)
        base = self.eval(node.value)
        if base is not None and base.kind == TUPLE and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index):
                known, value = const_value(index.value)
                if known and isinstance(value, int) and -len(base.items) <= value < len(base.items):
                    return base.items[value]
        if (base is None or base.kind == UNKNOWN) and len(node.slice) == 1:
            # A copy of the environment (`env = dict(os.environ)`, `env_dict["RANK"]` in
            # pytorch/examples ddp): launcher variable names mean the same thing there.
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                key = str(index.value.evaluated_value)
                if key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                    return env_value(key, node)
        return None

    # calls -----------------------------------------------------------------------------------
    def _eval_Call(self, node: cst.Call) -> Value | None:
        qual = self.ctx.qualname(node.func)
        if qual is not None:
            return self._api_call(node, qual)
        func = node.func
        if isinstance(func, cst.Name) and func.value in ("int", "str", "float", "list"):
            return self.eval(node.args[0].value) if node.args else None
        if isinstance(func, cst.Attribute):
            receiver = self.eval(func.value)
            method = func.attr.value
            if receiver is not None:
                if method in _PASSTHROUGH_METHODS and receiver.kind in (DDP, MODULE, INSTANCE, UNKNOWN):
                    return receiver
                if method in ("parameters", "named_parameters", "state_dict"):
                    return Value(PARAMS, node, inner=receiver, attrs={"method": method})
            if method == "get" and environ_name(node, self.ctx) is not None:
                return env_value(environ_name(node, self.ctx) or "", node)
            if method in MAIN_PROCESS_FUNCS:
                return Value(RANK_TEST, node, attrs={"zero": True}, origin="call")
            if method in ("get_rank", "rank") and receiver is None:
                return Value(RANK, node, origin="call")
            if method in ("get_local_rank", "local_rank") and receiver is None:
                return Value(LOCAL_RANK, node, origin="call")
            if method in ("get_world_size", "size") and receiver is None and dotted(func.value) in ("dist", "utils", "misc", "comm"):
                return Value(WORLD_SIZE, node, origin="call")
        if isinstance(func, cst.Name) and func.value in MAIN_PROCESS_FUNCS:
            return Value(RANK_TEST, node, attrs={"zero": True}, origin="call")
        if isinstance(func, cst.Name) and func.value in ("get_rank", "get_global_rank"):
            return Value(RANK, node, origin="call")
        if isinstance(func, cst.Name) and func.value == "get_local_rank":
            return Value(LOCAL_RANK, node, origin="call")
        if isinstance(func, cst.Name) and func.value == "get_world_size":
            return Value(WORLD_SIZE, node, origin="call")
        return None

    def _api_call(self, node: cst.Call, qual: str) -> Value | None:
        ctx = self.ctx
        if qual in frameworks.DDP_QUALS:
            inner = self.eval(node.args[0].value) if node.args else None
            return Value(DDP, node, inner=inner, name=dotted(node.args[0].value) or "" if node.args else "")
        if qual.startswith(frameworks.FSDP_PREFIX) and qual.endswith(("FullyShardedDataParallel", "FSDP")):
            inner = self.eval(node.args[0].value) if node.args else None
            return Value("fsdp", node, inner=inner)
        if qual.endswith((".fully_shard", ".parallelize_module")) and qual.startswith("torch.distributed"):
            # FSDP2 and tensor parallelism shard the module in place and return it: same object.
            inner = self.eval(node.args[0].value) if node.args else None
            return inner
        if qual in frameworks.CONVERT_SYNCBN:
            inner = self.eval(node.args[0].value) if node.args else None
            return inner if inner is not None and inner.kind != UNKNOWN else Value(MODULE, node, attrs={"syncbn": True})
        if qual == "torch.compile":
            return self.eval(node.args[0].value) if node.args else None
        if qual in frameworks.SAMPLER_QUALS:
            shuffle = keyword(node, "shuffle")
            shuffle_value: Any = True
            if shuffle is not None:
                known, shuffle_value = const_value(shuffle)
                if not known:
                    shuffle_value = None  # computed: unknown
            return Value(SAMPLER, node, attrs={"shuffle": shuffle_value})
        if qual in frameworks.LOADER_QUALS:
            # DataLoader(dataset, batch_size, shuffle, sampler, batch_sampler, ...)
            sampler_arg = argument(node, 3, "sampler")
            sampler = self.eval(sampler_arg) if sampler_arg is not None else None
            return Value(LOADER, node, inner=sampler, attrs={"has_sampler": sampler_arg is not None, "batch_sampler": keyword(node, "batch_sampler") is not None})
        if qual.startswith("torch.optim.") and not qual.startswith("torch.optim.lr_scheduler") and qual.rsplit(".", 1)[-1][:1].isupper():
            return Value(OPTIMIZER, node, name=qual.rsplit(".", 1)[-1])
        if qual in ("torch.amp.GradScaler",):
            return Value(SCALER, node)
        if qual.startswith("horovod."):
            api = qual.rsplit(".", 1)[-1]
            if api == "DistributedOptimizer":
                inner = self.eval(node.args[0].value) if node.args else None
                return Value(HVD_OPTIMIZER, node, inner=inner)
            if api == "rank":
                return Value(RANK, node, origin="hvd")
            if api == "local_rank":
                return Value(LOCAL_RANK, node, origin="hvd")
            if api == "size":
                return Value(WORLD_SIZE, node, origin="hvd")
            if api == "local_size":
                return Value(LOCAL_SIZE, node, origin="hvd")
        if qual in ("torch.distributed.get_rank", "torch.distributed.get_global_rank"):
            return Value(RANK, node, origin="dist")
        if qual == "torch.distributed.get_world_size":
            return Value(WORLD_SIZE, node, origin="dist")
        if qual == "torch.distributed.get_node_local_rank":
            return Value(LOCAL_RANK, node, origin="dist")
        if qual in ("os.environ.get", "os.getenv"):
            name = environ_name(node, ctx)
            return env_value(name, node) if name else None
        if qual in ("builtins.int",):
            return self.eval(node.args[0].value) if node.args else None
        if not qual.startswith(("torch.", "horovod.")):
            # Project helpers imported from elsewhere (`from util.misc import is_main_process`,
            # `utils.get_rank()`): the usual names mean what they say.
            last = qual.rsplit(".", 1)[-1]
            if last in MAIN_PROCESS_FUNCS:
                return Value(RANK_TEST, node, attrs={"zero": True}, origin="call")
            if last in ("get_rank", "get_global_rank"):
                return Value(RANK, node, origin="call")
            if last == "get_local_rank":
                return Value(LOCAL_RANK, node, origin="call")
            if last == "get_world_size":
                return Value(WORLD_SIZE, node, origin="call")
        return None

    def _eval_IfExp(self, node: cst.IfExp) -> Value | None:
        body = self.eval(node.body)
        orelse = self.eval(node.orelse)
        return body if body is not None and body.kind != CONST else orelse


def _node_offset(node: cst.BinaryOperation, left: Value | None, right: Value | None) -> bool:
    """`node_rank * gpus + local_rank`, `args.nr * args.gpus + gpu`: a local rank plus a product
    (or anything naming the node) is a global rank."""
    other = node.right if left is not None and left.kind == LOCAL_RANK else node.left
    return _mentions_node_rank(node) or (
        isinstance(other, cst.BinaryOperation) and isinstance(other.operator, cst.Multiply)
    )


def _mentions_node_rank(node: cst.CSTNode) -> bool:
    text = cst.Module([]).code_for_node(node)
    return "node_rank" in text or "node_id" in text


def environ_name(node: cst.CSTNode, ctx: ModuleInfo) -> str | None:
    """`RANK` for `os.environ["RANK"]`, `os.environ.get("RANK")`, `os.getenv("RANK", 0)`."""
    if isinstance(node, cst.Subscript):
        if ctx.qualname(node.value) == "os.environ" and len(node.slice) == 1:
            index = node.slice[0].slice
            if isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString):
                return str(index.value.evaluated_value)
        return None
    if isinstance(node, cst.Call) and node.args:
        qual = ctx.qualname(node.func)
        if qual in ("os.environ.get", "os.getenv") and isinstance(node.args[0].value, cst.SimpleString):
            return str(node.args[0].value.evaluated_value)
    return None


def rank_comparison(node: cst.Comparison, ev: Evaluator) -> bool | None:
    """True if the comparison holds on rank 0 only, False if on all ranks but 0, None if it is
    no comparison of a rank with 0."""
    if len(node.comparisons) != 1:
        return None
    target = node.comparisons[0]
    left, right, op = node.left, target.comparator, target.operator
    lv, rv = ev.eval(left), ev.eval(right)
    if rv is not None and rv.is_rank_like and (lv is None or not lv.is_rank_like):
        left, right, lv, rv = right, left, rv, lv
    if lv is None or not lv.is_rank_like:
        return None
    if isinstance(op, (cst.In, cst.NotIn)):
        if isinstance(right, (cst.List, cst.Tuple, cst.Set)):
            values = {const_value(el.value)[1] for el in right.elements}
            if 0 in values and values <= {0, -1, None}:
                return isinstance(op, cst.In)
        return None
    known, value = const_value(right)
    if not known or value not in (0, -1):
        return None
    if isinstance(op, (cst.Equal, cst.Is)) and value == 0:
        return True
    if isinstance(op, (cst.NotEqual, cst.IsNot, cst.GreaterThan)) and value == 0:
        return False
    if isinstance(op, cst.LessThanEqual) and value == 0:
        return True
    if isinstance(op, cst.LessThan) and value == 1:
        return True
    return None
