"""The code path a training script runs, as an ordered list of steps, with what each name holds.

A *trace* linearises one entry point (the module body, or a function nothing in the module calls,
such as an `mp.spawn` worker or a trainer method): statements in order, loop and `if` bodies once
each, and calls to functions, methods and constructors of the same module inlined where they are
made, in evaluation order, so `model = wrap(build(...))` runs `build`, then `wrap`, then binds.
Every step carries the loops and `if`-conditions around it and the environment before it: an
immutable map from names (`model`, `self.model`, `args.rank`) to abstract `Value`s such as "a DDP
wrapper of the module made at line 12" or "the rank, read from the environment".

Rules read traces; they never walk the tree to rebuild this. What cannot be known is `unknown`,
and rules stay silent on it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import libcst as cst

from distdoctor.lint.analysis.names import ImportTable, dotted

# Value kinds
UNKNOWN = "unknown"
DDP = "ddp"  # a DistributedDataParallel wrapper; inner = the wrapped module
MODULE = "module"  # an nn.Module we know of (a local nn.Module subclass, `ddp.module`)
SAMPLER = "dist_sampler"  # a torch DistributedSampler
LOADER = "loader"  # a DataLoader; inner = its sampler (if known)
OPTIMIZER = "optimizer"  # a torch.optim optimizer
HVD_OPTIMIZER = "hvd_optimizer"  # horovod DistributedOptimizer; inner = the wrapped optimizer
SCALER = "grad_scaler"
RANK = "rank"  # the global rank
LOCAL_RANK = "local_rank"  # the rank within the node (a valid device index)
WORLD_SIZE = "world_size"
LOCAL_SIZE = "local_size"
RANK_TEST = "rank_test"  # a boolean that is true on rank 0 only (or on all others)
INSTANCE = "instance"  # an instance of a class of this module; attrs["class"]
TUPLE = "tuple"  # items
CONST = "const"  # a literal; attrs["value"]
PARAMS = "params"  # model.parameters() / named_parameters() / state_dict(); inner = the model

RANK_NAMES = frozenset({"rank", "global_rank", "world_rank", "ddp_rank", "grank", "rank_id"})
LOCAL_RANK_NAMES = frozenset({"local_rank", "ddp_local_rank", "localrank", "local_rank_id", "lrank"})
MAIN_PROCESS_FUNCS = frozenset(
    {
        "is_main_process",
        "is_master",
        "is_master_process",
        "is_rank_zero",
        "is_rank_0",
        "is_primary",
        "is_global_zero",
        "main_process",
        "is_main_worker",
        "master_only",
        "is_root",
        "is_chief",
    }
)


@dataclass(frozen=True, eq=False)
class Value:
    """What a name is known to hold. Identity (`node`) says which object: two names bound from the
    same `DistributedSampler(...)` call hold the same sampler."""

    kind: str
    node: cst.CSTNode | None = None
    origin: str = ""
    inner: Value | None = None
    items: tuple[Value | None, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    name: str = ""

    def same_object(self, other: Value | None) -> bool:
        return other is not None and self.node is not None and self.node is other.node

    @property
    def is_rank_like(self) -> bool:
        return self.kind in (RANK, LOCAL_RANK)


@dataclass(frozen=True)
class Guard:
    """An enclosing `if`: its test, and whether the step runs when the test is false."""

    test: cst.BaseExpression
    negated: bool
    frame: Frame


@dataclass(eq=False)
class Frame:
    """One execution of a function body (or the module body)."""

    function: cst.FunctionDef | None
    cls: cst.ClassDef | None
    parent: Frame | None
    call: cst.Call | None
    id: int
    returns: list[Value | None] = field(default_factory=list)

    @property
    def depth(self) -> int:
        return 0 if self.parent is None else self.parent.depth + 1

    def chain(self) -> Iterator[Frame]:
        frame: Frame | None = self
        while frame is not None:
            yield frame
            frame = frame.parent


@dataclass(frozen=True, eq=False)
class Step:
    """One statement on the code path (a small statement, or the header of a compound one)."""

    index: int
    node: cst.CSTNode
    line: cst.CSTNode  # the whole statement line: what a fix moves, where `# noqa` sits
    frame: Frame
    loops: tuple[cst.For | cst.While, ...]
    guards: tuple[Guard, ...]
    env: Mapping[Any, Value]
    block: tuple[cst.CSTNode, int] | None  # (the block's owner, index in its body): for fixes
    # What the calls of this statement to functions of the module returned (id(call) -> Value):
    # `lr=scaled_lr(base)` evaluates through the helper's return.
    results: Mapping[int, Value | None] = field(default_factory=dict)

    def in_loop(self, loop: cst.CSTNode) -> bool:
        return any(enclosing is loop for enclosing in self.loops)


@dataclass
class Trace:
    """The steps of one entry point, in execution order."""

    root: cst.CSTNode
    steps: list[Step]
    ctx: ModuleInfo

    def value(self, expr: cst.BaseExpression | None, step: Step) -> Value | None:
        """The abstract value of `expr` evaluated just before `step`."""
        if expr is None:
            return None
        return Evaluator(self.ctx, step.env, step.frame, step.results).eval(expr)

    def calls(self) -> Iterator[tuple[Step, cst.Call]]:
        """Every call made by a step's own statement (not by inlined callees), in order."""
        for step in self.steps:
            for call in own_calls(step.node):
                yield step, call


# --------------------------------------------------------------------------------------------
# Module facts


@dataclass
class ModuleInfo:
    """What the module defines: its imports, functions and classes."""

    module: cst.Module
    imports: ImportTable
    functions: dict[str, cst.FunctionDef]
    classes: dict[str, cst.ClassDef]
    spawn_targets: dict[str, str]  # function name -> how it is started ("spawn")

    @classmethod
    def of(cls, module: cst.Module, imports: ImportTable, calls: Sequence[cst.Call] | None = None) -> ModuleInfo:
        functions: dict[str, cst.FunctionDef] = {}
        classes: dict[str, cst.ClassDef] = {}
        for stmt in _flat_body(module.body):
            if isinstance(stmt, cst.FunctionDef):
                functions[stmt.name.value] = stmt
            elif isinstance(stmt, cst.ClassDef):
                classes[stmt.name.value] = stmt
        info = cls(module, imports, functions, classes, {})
        finder = _SpawnFinder(info)
        for node in calls if calls is not None else (n for n in walk(module) if isinstance(n, cst.Call)):
            finder.visit_Call(node)
        return info

    def methods(self, cls_node: cst.ClassDef) -> dict[str, cst.FunctionDef]:
        return {
            stmt.name.value: stmt
            for stmt in _flat_body(cls_node.body.body)
            if isinstance(stmt, cst.FunctionDef)
        }

    def qualname(self, node: cst.CSTNode) -> str | None:
        return self.imports.qualname(node)


def _flat_body(body: Sequence[cst.CSTNode]) -> Iterator[cst.CSTNode]:
    """Statements of a block, looking through `if`/`try` at module level (guarded imports, defs)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, cst.If) and _is_main_guard(stmt.test):
            continue
        if isinstance(stmt, (cst.If, cst.Try)):
            yield from _flat_body(stmt.body.body)


def _is_main_guard(test: cst.BaseExpression) -> bool:
    return (
        isinstance(test, cst.Comparison)
        and isinstance(test.left, cst.Name)
        and test.left.value == "__name__"
    )


class _SpawnFinder:
    """Functions started as worker processes: `mp.spawn(fn, ...)`, `Process(target=fn)`."""

    def __init__(self, info: ModuleInfo) -> None:
        self.info = info

    def visit_Call(self, node: cst.Call) -> None:
        qual = self.info.qualname(node.func) or ""
        name = qual.rsplit(".", 1)[-1]
        if qual in ("torch.multiprocessing.spawn", "torch.multiprocessing.start_processes") or (
            name == "spawn" and qual.startswith("torch")
        ):
            if node.args and isinstance(node.args[0].value, cst.Name):
                self.info.spawn_targets[node.args[0].value.value] = "spawn"


# --------------------------------------------------------------------------------------------
# Evaluation of expressions to abstract values

_SAMPLER_QUALS = ("torch.utils.data.DistributedSampler",)
_LOADER_QUALS = ("torch.utils.data.DataLoader",)
_DDP_QUALS = ("torch.nn.parallel.DistributedDataParallel",)
_FSDP_PREFIX = "torch.distributed.fsdp"
_CONVERT_SYNCBN = ("torch.nn.SyncBatchNorm.convert_sync_batchnorm",)
_PASSTHROUGH_METHODS = frozenset({"to", "cuda", "cpu", "train", "eval", "float", "half", "double", "bfloat16", "requires_grad_", "share_memory", "to_empty"})


def _const_value(node: cst.BaseExpression) -> tuple[bool, Any]:
    if isinstance(node, cst.Integer):
        return True, int(node.value, 0) if node.value.isdigit() else node.evaluated_value
    if isinstance(node, cst.Float):
        return True, node.evaluated_value
    if isinstance(node, cst.Name) and node.value in ("True", "False", "None"):
        return True, {"True": True, "False": False, "None": None}[node.value]
    if isinstance(node, cst.SimpleString):
        return True, node.evaluated_value
    if isinstance(node, cst.UnaryOperation) and isinstance(node.operator, cst.Minus):
        known, value = _const_value(node.expression)
        if known and isinstance(value, (int, float)):
            return True, -value
    return False, None


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
        known, value = _const_value(node)
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
                known, value = _const_value(index.value)
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
        if qual in _DDP_QUALS:
            inner = self.eval(node.args[0].value) if node.args else None
            return Value(DDP, node, inner=inner, name=dotted(node.args[0].value) or "" if node.args else "")
        if qual.startswith(_FSDP_PREFIX) and qual.endswith(("FullyShardedDataParallel", "FSDP")):
            return Value("fsdp", node)
        if qual in _CONVERT_SYNCBN:
            inner = self.eval(node.args[0].value) if node.args else None
            return inner if inner is not None and inner.kind != UNKNOWN else Value(MODULE, node, attrs={"syncbn": True})
        if qual == "torch.compile":
            return self.eval(node.args[0].value) if node.args else None
        if qual in _SAMPLER_QUALS:
            shuffle = keyword(node, "shuffle")
            shuffle_value: Any = True
            if shuffle is not None:
                known, shuffle_value = _const_value(shuffle)
                if not known:
                    shuffle_value = None  # computed: unknown
            return Value(SAMPLER, node, attrs={"shuffle": shuffle_value})
        if qual in _LOADER_QUALS:
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


def keyword(call: cst.Call, name: str) -> cst.BaseExpression | None:
    """The expression passed as keyword `name`, if any."""
    for arg in call.args:
        if arg.keyword is not None and arg.keyword.value == name:
            return arg.value
    return None


def argument(call: cst.Call, position: int, name: str) -> cst.BaseExpression | None:
    """An argument given by position or by keyword."""
    value = keyword(call, name)
    if value is not None:
        return value
    positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
    return positional[position].value if position < len(positional) else None


def arg_node(call: cst.Call, expr: cst.BaseExpression) -> cst.CSTNode:
    """The `Arg` of `call` that holds `expr` (what a finding about that argument points at, and
    what a fix rewrites), or the call itself when `expr` is not one of its arguments."""
    for arg in call.args:
        if arg.value is expr:
            return arg
    return call


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


def env_value(name: str, node: cst.CSTNode) -> Value | None:
    if name in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID", "PMI_RANK"):
        return Value(RANK, node, origin="env", name=name)
    if name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID", "MPI_LOCALRANKID"):
        return Value(LOCAL_RANK, node, origin="env", name=name)
    if name in ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS"):
        return Value(WORLD_SIZE, node, origin="env", name=name)
    if name in ("LOCAL_WORLD_SIZE",):
        return Value(LOCAL_SIZE, node, origin="env", name=name)
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
            values = {_const_value(el.value)[1] for el in right.elements}
            if 0 in values and values <= {0, -1, None}:
                return isinstance(op, cst.In)
        return None
    known, value = _const_value(right)
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


# Fields that hold only layout (whitespace, commas, parentheses, blank lines): never code.
_LAYOUT_FIELDS = frozenset(
    {
        "lpar", "rpar", "lbracket", "rbracket", "lbrace", "rbrace", "comma", "semicolon", "colon",
        "equal", "dot", "star", "leading_lines", "lines_after_decorators", "header", "footer",
        "trailing_whitespace", "newline", "first_line", "empty_lines", "whitespace_before",
        "whitespace_after", "whitespace_before_colon", "whitespace_after_colon", "whitespace_before_params",
        "whitespace_after_def", "whitespace_after_class", "whitespace_after_for", "whitespace_before_in",
        "whitespace_after_in", "whitespace_after_if", "whitespace_after_with", "whitespace_after_while",
        "whitespace_after_import", "whitespace_after_from", "whitespace_before_import", "whitespace_after_as",
        "whitespace_before_as", "whitespace_after_func", "whitespace_before_args", "whitespace_after_arg",
        "whitespace_after_star", "whitespace_after_param", "whitespace_after_equal", "whitespace_before_equal",
        "whitespace_after_return", "whitespace_after_lambda", "whitespace_after_await", "whitespace_after_del",
        "whitespace_after_raise", "whitespace_after_assert", "whitespace_after_global", "whitespace_after_nonlocal",
        "whitespace_after_except", "whitespace_after_yield", "whitespace_after_indicator", "whitespace_after_test",
        "whitespace_before_from", "whitespace_after_match", "whitespace_after_case", "whitespace_before_if",
        "whitespace_after_async", "whitespace_after_at", "whitespace_after_type",
    }
)
_CODE_FIELDS: dict[type, tuple[str, ...]] = {}


def _code_fields(kind: type) -> tuple[str, ...]:
    fields = _CODE_FIELDS.get(kind)
    if fields is None:
        fields = tuple(name for name in kind.__dataclass_fields__ if name not in _LAYOUT_FIELDS)
        _CODE_FIELDS[kind] = fields
    return fields


def walk(node: cst.CSTNode, skip: tuple[type, ...] = ()) -> Iterator[cst.CSTNode]:
    """Every code node under `node` (itself included), parents before children, in field order,
    not descending into nodes of the `skip` types nor into layout (whitespace, commas,
    parentheses). Much faster than a libcst visitor, which rebuilds every node it passes."""
    node_type = cst.CSTNode
    stack = [node]
    while stack:
        current = stack.pop()
        yield current
        children: list[cst.CSTNode] = []
        for name in _code_fields(type(current)):
            value = getattr(current, name)
            if isinstance(value, (list, tuple)):
                children.extend(item for item in value if isinstance(item, node_type))
            elif isinstance(value, node_type):
                children.append(value)
        if skip:
            children = [child for child in children if not isinstance(child, skip)]
        children.reverse()
        stack.extend(children)


def _calls_in_order(node: cst.CSTNode) -> list[cst.Call]:
    """Calls under `node` in evaluation order: arguments (and the receiver) before the call."""
    out: list[cst.Call] = []

    def visit(current: cst.CSTNode) -> None:
        for name in _code_fields(type(current)):
            value = getattr(current, name)
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, cst.CSTNode) and not isinstance(item, _OPAQUE):
                    visit(item)
        if isinstance(current, cst.Call):
            out.append(current)

    visit(node)
    return out


_OPAQUE = (cst.Lambda, cst.FunctionDef, cst.ClassDef)
_CALLS_MEMO: dict[int, tuple[cst.CSTNode, list[cst.Call]]] = {}
_CALLS_MEMO_LIMIT = 200_000


def forget_calls() -> None:
    """Drop the memo of call lists: it holds nodes, so it would keep every linted tree alive."""
    _CALLS_MEMO.clear()


def own_calls(node: cst.CSTNode) -> list[cst.Call]:
    """Calls in a statement in evaluation order (arguments before the call), not descending into
    nested function bodies, lambdas, or the bodies of compound statements. Memoised: every rule
    asks this of the same steps."""
    entry = _CALLS_MEMO.get(id(node))
    if entry is not None and entry[0] is node:
        return entry[1]
    if isinstance(node, cst.For):
        calls = _calls_in_order(node.iter)
    elif isinstance(node, (cst.While, cst.If)):
        calls = _calls_in_order(node.test)
    elif isinstance(node, cst.With):
        calls = [call for item in node.items for call in _calls_in_order(item)]
    elif isinstance(node, (cst.Try, cst.TryStar, cst.FunctionDef, cst.ClassDef, cst.Match)):
        calls = []
    else:
        calls = _calls_in_order(node)
    if len(_CALLS_MEMO) > _CALLS_MEMO_LIMIT:
        _CALLS_MEMO.clear()
    _CALLS_MEMO[id(node)] = (node, calls)  # holding the node keeps its id from being reused
    return calls


# --------------------------------------------------------------------------------------------
# Trace construction

MAX_DEPTH = 6
MAX_STEPS = 20000
_TERMINATORS = (cst.Return, cst.Continue, cst.Break, cst.Raise)


class _Builder:
    def __init__(self, ctx: ModuleInfo) -> None:
        self.ctx = ctx
        self.steps: list[Step] = []
        self.env: dict[Any, Value] = {}
        self.frame_ids = itertools.count()
        self.inlined: set[int] = set()  # id() of function defs entered

    # statements ------------------------------------------------------------------------------
    def run_block(
        self,
        owner: cst.CSTNode,
        body: Sequence[cst.CSTNode],
        frame: Frame,
        loops: tuple,
        guards: tuple[Guard, ...],
    ) -> None:
        guards = tuple(guards)
        for index, stmt in enumerate(body):
            if len(self.steps) > MAX_STEPS:
                return
            self.run_statement(stmt, frame, loops, guards, (owner, index))
            # `if rank != 0: return` guards everything after it in the block.
            if isinstance(stmt, cst.If) and stmt.orelse is None and _ends_block(stmt.body.body):
                guards = (*guards, Guard(stmt.test, True, frame))

    def run_statement(self, stmt, frame, loops, guards, block) -> None:
        if isinstance(stmt, cst.SimpleStatementLine):
            for small in stmt.body:
                self.run_small(small, stmt, frame, loops, guards, block)
        elif isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            key = env_key(stmt.name, frame)
            if key is not None and frame.depth > 0:
                self.env[key] = Value("def", stmt)
        elif isinstance(stmt, cst.If):
            self.emit(stmt, stmt, frame, loops, guards, block)
            before = self.env
            self.run_block(stmt, stmt.body.body, frame, loops, (*guards, Guard(stmt.test, False, frame)))
            orelse = stmt.orelse
            negated = (*guards, Guard(stmt.test, True, frame))
            if orelse is not None:
                after_body = self.env
                self.env = before  # the other branch starts from the state before the `if`
                if isinstance(orelse, cst.If):
                    self.run_statement(orelse, frame, loops, negated, block)
                else:
                    self.run_block(orelse, orelse.body.body, frame, loops, negated)
                self.env = _merge_branches(after_body, self.env)
        elif isinstance(stmt, (cst.For, cst.While)):
            self.emit(stmt, stmt, frame, loops, guards, block)
            if isinstance(stmt, cst.For):
                self.bind_target(stmt.target, self.iter_item(stmt.iter, frame), frame)
            self.run_block(stmt, stmt.body.body, frame, (*loops, stmt), guards)
            if stmt.orelse is not None:
                self.run_block(stmt.orelse, stmt.orelse.body.body, frame, loops, guards)
        elif isinstance(stmt, cst.With):
            self.emit(stmt, stmt, frame, loops, guards, block)
            for item in stmt.items:
                if item.asname is not None:
                    self.bind_target(item.asname.name, self.evaluate(item.item, frame, {}), frame)
            self.run_block(stmt, stmt.body.body, frame, loops, guards)
        elif isinstance(stmt, (cst.Try, cst.TryStar)):
            self.emit(stmt, stmt, frame, loops, guards, block)
            self.run_block(stmt, stmt.body.body, frame, loops, guards)
            for handler in stmt.handlers:
                self.run_block(handler, handler.body.body, frame, loops, guards)
            if stmt.orelse is not None:
                self.run_block(stmt.orelse, stmt.orelse.body.body, frame, loops, guards)
            if stmt.finalbody is not None:
                self.run_block(stmt.finalbody, stmt.finalbody.body.body, frame, loops, guards)
        elif isinstance(stmt, cst.Match):
            self.emit(stmt, stmt, frame, loops, guards, block)
            for case in stmt.cases:
                self.run_block(case, case.body.body, frame, loops, guards)

    def run_small(self, small, line, frame, loops, guards, block) -> None:
        results = self.inline_calls(small, frame, loops, guards)
        self.emit(small, line, frame, loops, guards, block, results)
        if isinstance(small, cst.Assign):
            value = self.evaluate(small.value, frame, results)
            for target in small.targets:
                self.bind_target(target.target, value, frame, small)
        elif isinstance(small, cst.AnnAssign) and small.value is not None:
            self.bind_target(small.target, self.evaluate(small.value, frame, results), frame, small)
        elif isinstance(small, cst.AugAssign):
            key = env_key(small.target, frame)
            if key is not None:
                old = lookup(self.env, dotted(small.target) or "", frame)
                new = self.evaluate(cst.BinaryOperation(small.target, _aug_to_bin(small.operator), small.value), frame, results)
                self.env = {**self.env, key: new or old or Value(UNKNOWN, small)}
        elif isinstance(small, cst.Return):
            frame.returns.append(self.evaluate(small.value, frame, results) if small.value is not None else None)

    def emit(self, node, line, frame, loops, guards, block, results=None) -> None:
        self.steps.append(Step(len(self.steps), node, line, frame, loops, guards, self.env, block, results or {}))

    def evaluate(self, expr, frame, results) -> Value | None:
        return Evaluator(self.ctx, self.env, frame, results).eval(expr)

    def iter_item(self, iterable: cst.BaseExpression, frame: Frame) -> Value | None:
        # `for x in loader`, `enumerate(loader)`, `tqdm(loader)`: the loop draws from the loader.
        inner = iterable
        while isinstance(inner, cst.Call) and inner.args and dotted(inner.func) in (
            "enumerate", "tqdm", "tqdm.tqdm", "iter", "zip",
        ):
            inner = inner.args[0].value
        value = self.evaluate(inner, frame, {})
        return None if value is None else Value("item_of", iterable, inner=value)

    def bind_target(self, target, value, frame, node=None) -> None:
        if isinstance(target, (cst.Tuple, cst.List)):
            items = value.items if value is not None and value.kind == TUPLE else ()
            for index, element in enumerate(target.elements):
                item = items[index] if index < len(items) else None
                self.bind_target(element.value, item, frame, node)
            return
        key = env_key(target, frame)
        if key is None:
            return
        if value is None:
            value = Value(UNKNOWN, node or target)
        if not value.name and (text := dotted(target)):
            value = replace(value, name=text)
        self.env = {**self.env, key: value}

    # calls -----------------------------------------------------------------------------------
    def inline_calls(self, small, frame, loops, guards) -> dict[int, Value | None]:
        results: dict[int, Value | None] = {}
        for call in own_calls(small):
            target = self.resolve_callee(call, frame, results)
            if target is None:
                continue
            if isinstance(target, _NoBody):
                results[id(call)] = target.value
                continue
            function, cls, self_value, skip_first = target
            results[id(call)] = self.enter(function, cls, self_value, call, frame, loops, guards, results, skip_first)
        return results

    def resolve_callee(self, call: cst.Call, frame: Frame, results):
        """The function of this module a call runs, with its class and `self`, if knowable."""
        func = call.func
        qual = self.ctx.qualname(func)
        if qual is not None:
            if qual.endswith("multiprocessing.spawn") and call.args and isinstance(call.args[0].value, cst.Name):
                worker = self.ctx.functions.get(call.args[0].value.value)
                if worker is not None:
                    return worker, None, None, "spawn"
            return None
        if isinstance(func, cst.Name):
            local = lookup(self.env, func.value, frame)
            if local is not None and local.kind == "def" and isinstance(local.node, cst.FunctionDef):
                return local.node, None, None, False
            if func.value in self.ctx.functions:
                return self.ctx.functions[func.value], None, None, False
            if func.value in self.ctx.classes:
                cls = self.ctx.classes[func.value]
                instance = Value(INSTANCE, call, attrs={"class": func.value}, name=func.value)
                init = self.ctx.methods(cls).get("__init__")
                if init is None:
                    return _NoBody(instance)
                return init, cls, instance, True
            return None
        if isinstance(func, cst.Attribute):
            receiver_text = dotted(func.value)
            method = func.attr.value
            if receiver_text == "self" and frame.cls is not None:
                function = self.ctx.methods(frame.cls).get(method)
                if function is not None:
                    return function, frame.cls, None, True
                return None
            receiver = self.evaluate(func.value, frame, results)
            if receiver is not None and receiver.kind == INSTANCE:
                cls = self.ctx.classes.get(receiver.attrs.get("class", ""))
                if cls is not None and method in self.ctx.methods(cls):
                    return self.ctx.methods(cls)[method], cls, receiver, True
        return None

    def enter(self, function, cls, self_value, call, caller, loops, guards, results, skip_first):
        if id(function) in {id(f.function) for f in caller.chain()} or caller.depth >= MAX_DEPTH:
            return self_value
        self.inlined.add(id(function))
        frame = Frame(function, cls, caller, call, next(self.frame_ids))
        self.bind_params(function, call, frame, caller, results, skip_first)
        self.run_block(function, function.body.body, frame, loops, guards)
        if self_value is not None and function.name.value == "__init__":
            return self_value
        returns = [value for value in frame.returns if value is not None and value.kind != UNKNOWN]
        return returns[-1] if returns else None

    def bind_params(self, function, call, frame, caller, results, skip_first) -> None:
        params = list(function.params.params)
        if skip_first == "spawn":
            # mp.spawn(fn, args=(a, b)): fn(index, a, b); the index is the local rank.
            if params:
                self.env = {**self.env, ("local", frame.id, params[0].name.value): Value(LOCAL_RANK, params[0], origin="spawn", name=params[0].name.value)}
            extra = keyword(call, "args")
            passed = []
            if isinstance(extra, cst.Tuple):
                passed = [self.evaluate(el.value, caller, results) for el in extra.elements]
            for param, value in zip(params[1:], passed):
                if value is not None:
                    self.env = {**self.env, ("local", frame.id, param.name.value): value}
            return
        if skip_first and params:
            params = params[1:]
        positional = [arg for arg in call.args if arg.keyword is None and not arg.star]
        for param, arg in zip(params, positional):
            value = self.evaluate(arg.value, caller, results)
            if value is not None:
                self.env = {**self.env, ("local", frame.id, param.name.value): value}
        by_name = {param.name.value for param in [*function.params.params, *function.params.kwonly_params]}
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value in by_name:
                value = self.evaluate(arg.value, caller, results)
                if value is not None:
                    self.env = {**self.env, ("local", frame.id, arg.keyword.value): value}


@dataclass(frozen=True)
class _NoBody:
    value: Value


def _merge_branches(first: Mapping[Any, Value], second: Mapping[Any, Value]) -> dict[Any, Value]:
    """The state after an if/else: where the branches disagree, keep the value that says more
    about distributed training (`master = rank == 0` in one branch, `master = True` in the
    other, is a rank test), else the first branch's."""
    merged = dict(second)
    for key, value in first.items():
        other = second.get(key)
        if other is None or other is value:
            merged[key] = value
        elif value.kind in (UNKNOWN, CONST) and other.kind not in (UNKNOWN, CONST):
            merged[key] = other
        else:
            merged[key] = value
    return merged


def _ends_block(body: Sequence[cst.CSTNode]) -> bool:
    if not body:
        return False
    last = body[-1]
    return isinstance(last, cst.SimpleStatementLine) and any(isinstance(s, _TERMINATORS) for s in last.body)


def _aug_to_bin(op: cst.BaseAugOp) -> cst.BaseBinaryOp:
    mapping = {
        cst.AddAssign: cst.Add,
        cst.SubtractAssign: cst.Subtract,
        cst.MultiplyAssign: cst.Multiply,
        cst.DivideAssign: cst.Divide,
        cst.FloorDivideAssign: cst.FloorDivide,
        cst.ModuloAssign: cst.Modulo,
    }
    return mapping.get(type(op), cst.Add)()


def build_traces(ctx: ModuleInfo) -> list[Trace]:
    """One trace for the module body, then one for each function or method that nothing on an
    earlier trace ran (workers started by `mp.spawn`, trainer methods called from elsewhere)."""
    builder = _Builder(ctx)
    module_frame = Frame(None, None, None, None, next(builder.frame_ids))
    builder.run_block(ctx.module, ctx.module.body, module_frame, (), ())
    traces = [Trace(ctx.module, builder.steps, ctx)]
    module_env = builder.env
    reached = set(builder.inlined)

    candidates: list[tuple[cst.FunctionDef, cst.ClassDef | None]] = [
        (function, None) for function in ctx.functions.values()
    ]
    for cls in ctx.classes.values():
        candidates.extend((method, cls) for method in ctx.methods(cls).values())
    for function, cls in candidates:
        if id(function) in reached:
            continue
        root = _Builder(ctx)
        root.env = dict(module_env)
        root.frame_ids = builder.frame_ids
        frame = Frame(None, cls, None, None, next(builder.frame_ids))
        if cls is not None:
            instance = Value(INSTANCE, cls, attrs={"class": cls.name.value})
            init = ctx.methods(cls).get("__init__")
            if init is not None and init is not function:
                root.enter(init, cls, instance, cst.Call(func=cst.Name("__init__")), frame, (), (), {}, True)
            fake_call = cst.Call(func=cst.Name(function.name.value))
            root.enter(function, cls, instance, fake_call, frame, (), (), {}, True)
        else:
            spawn = "spawn" if function.name.value in ctx.spawn_targets else False
            fake_call = cst.Call(func=cst.Name(function.name.value))
            root.enter(function, None, None, fake_call, frame, (), (), {}, spawn)
        reached |= root.inlined
        traces.append(Trace(function, root.steps, ctx))
    return traces


def iter_steps(traces: Sequence[Trace]) -> Iterator[tuple[Trace, Step]]:
    for trace in traces:
        for step in trace.steps:
            yield trace, step
