"""One file under analysis: its tree, traces and the shared facts rules ask about.

Everything is computed lazily and once per file, whichever rules ask: rules never re-derive
name resolution, statement order or rank guards on their own.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property

import libcst as cst
from libcst.metadata import CodeRange, MetadataWrapper, PositionProvider

from distdoctor.lint.analysis import evaluate, frameworks, kinds, syntax
from distdoctor.lint.finding import Edit
from distdoctor.lint.analysis.scope import Frame, ModuleInfo
from distdoctor.lint.analysis.trace import Guard, Step, Trace, build_traces, iter_steps
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.names import ImportTable, dotted


@dataclass(frozen=True)
class RankGuard:
    """A condition under which a step runs on some ranks only."""

    guard: Guard
    zero: bool  # the step runs on rank 0 only (True) or on every rank but 0 (False)
    local: bool  # the test is on the local rank (once per node), not the global rank


# Calls every rank of the group must make (point-to-point send/recv are not among them): a rank
# that skips one leaves the others waiting forever.
TORCH_COLLECTIVES = frozenset(
    {
        "barrier", "monitored_barrier", "all_reduce", "reduce", "broadcast", "all_gather",
        "all_gather_into_tensor", "_all_gather_base", "gather", "scatter", "reduce_scatter",
        "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all", "all_to_all_single",
        "all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
        "new_group",
    }
)
HOROVOD_COLLECTIVES = frozenset(
    {
        "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce",
        "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_", "allgather",
        "allgather_async", "allgather_object", "grouped_allgather", "broadcast", "broadcast_",
        "broadcast_async", "broadcast_async_", "broadcast_object", "broadcast_parameters",
        "broadcast_optimizer_state", "alltoall", "alltoall_async", "reducescatter",
        "reducescatter_async", "grouped_reducescatter", "barrier", "join",
    }
)
NO_GRAD_CONTEXTS = frozenset({"torch.no_grad", "torch.inference_mode", "torch.autograd.no_grad", "torch.autograd.grad_mode.no_grad"})


class LintContext:
    """The parsed file and everything derived from it."""

    def __init__(self, path: str, source: str, module: cst.Module) -> None:
        self.path = path
        self.source = source
        self.module = module

    # --- structure ---------------------------------------------------------------------------
    @cached_property
    def imports(self) -> ImportTable:
        return ImportTable.of(self.module)

    @cached_property
    def info(self) -> ModuleInfo:
        return ModuleInfo.of(self.module, self.imports, self.nodes(cst.Call))

    @cached_property
    def traces(self) -> list[Trace]:
        return build_traces(self.info)

    def qualname(self, node: cst.CSTNode) -> str | None:
        return self.imports.qualname(node)

    def steps(self) -> Iterator[tuple[Trace, Step]]:
        return iter_steps(self.traces)

    def calls(self, *qualnames: str, suffix: str | None = None) -> Iterator[tuple[Trace, Step, cst.Call]]:
        """Calls on the code path to any of `qualnames` (or whose qualified name ends with
        `.suffix`), with their trace and step."""
        calls, positions = self._qualified_calls
        wanted: list[int] = []
        for qual, where in positions.items():
            if qual in qualnames or (suffix is not None and qual.endswith("." + suffix)):
                wanted.extend(where)
        for index in sorted(wanted):
            yield calls[index]

    @cached_property
    def _qualified_calls(self) -> tuple[list[tuple[Trace, Step, cst.Call]], dict[str, list[int]]]:
        """Every call on the code path whose callee has a qualified name, in path order, and the
        positions of each qualified name's calls: `calls` is asked a dozen times per file, and
        resolving every callee each time cost more than building the traces."""
        calls: list[tuple[Trace, Step, cst.Call]] = []
        positions: dict[str, list[int]] = {}
        for trace in self.traces:
            for step, call in trace.calls():
                qual = self.qualname(call.func)
                if qual is not None:
                    positions.setdefault(qual, []).append(len(calls))
                    calls.append((trace, step, call))
        return calls, positions

    def method_calls(self, method: str) -> Iterator[tuple[Trace, Step, cst.Call]]:
        """`<something>.method(...)` calls on the code path, whatever the receiver."""
        for trace in self.traces:
            for step, call in trace.calls():
                if isinstance(call.func, cst.Attribute) and call.func.attr.value == method:
                    yield trace, step, call

    # --- what kind of script ----------------------------------------------------------------
    @cached_property
    def uses_horovod(self) -> bool:
        return self.imports.imports_any(["horovod.torch", "horovod"])

    @cached_property
    def uses_torch_distributed(self) -> bool:
        if self.imports.imports_any(["torch.distributed", "torch.nn.parallel", "torch.utils.data.DistributedSampler", "torch.utils.data.distributed"]):
            return True
        return any(
            (dotted(call.func) or "").endswith(("init_process_group", "DistributedDataParallel"))
            for _, call in self._all_calls
        )

    @cached_property
    def is_distributed(self) -> bool:
        return self.uses_horovod or self.uses_torch_distributed

    @cached_property
    def _all_calls(self) -> list[tuple[Step, cst.Call]]:
        return [(step, call) for trace in self.traces for step, call in trace.calls()]

    @cached_property
    def process_group_initialised(self) -> bool:
        """Whether `torch.distributed.init_process_group` (or an equivalent) is called."""
        names = ("init_process_group", "init_distributed_mode", "init_distributed", "setup_distributed", "init_dist")
        for _, call in self._all_calls:
            text = dotted(call.func) or ""
            if text.rsplit(".", 1)[-1] in names:
                return True
        return False

    # --- rank guards -------------------------------------------------------------------------
    def rank_guards(self, trace: Trace, step: Step) -> list[RankGuard]:
        """The enclosing conditions of `step` that restrict it to rank 0 or to the other ranks."""
        found = []
        for guard in step.guards:
            value = evaluate.Evaluator(self.info, step.env, guard.frame, {}).eval(guard.test)
            if value is None or value.kind != kinds.RANK_TEST:
                continue
            zero = bool(value.attrs.get("zero")) != guard.negated
            found.append(RankGuard(guard, zero, _tests_local_rank(guard.test, self, step)))
        return found

    def under_rank_zero(self, trace: Trace, step: Step) -> bool:
        return any(g.zero for g in self.rank_guards(trace, step))

    # --- collectives and gradients -----------------------------------------------------------
    def collective_name(self, call: cst.Call) -> str | None:
        """`torch.distributed.barrier` / `horovod.torch.allreduce` if `call` is a collective that
        every rank must join (resolved through imports), else None."""
        qual = self.qualname(call.func)
        if qual is None:
            return None
        head, _, last = qual.rpartition(".")
        if head.startswith("torch.distributed") and last in TORCH_COLLECTIVES:
            return qual
        if head.startswith("horovod") and last in HOROVOD_COLLECTIVES:
            return qual
        return None

    def parent(self, node: cst.CSTNode) -> cst.CSTNode | None:
        return self._parents.get(id(node))

    @cached_property
    def _parents(self) -> dict[int, cst.CSTNode]:
        parents: dict[int, cst.CSTNode] = {}
        for node in syntax.walk(self.module):
            for name in syntax._code_fields(type(node)):
                value = getattr(node, name)
                items = value if isinstance(value, (list, tuple)) else (value,)
                for item in items:
                    if isinstance(item, cst.CSTNode):
                        parents[id(item)] = node
        return parents

    @cached_property
    def _nodes_by_type(self) -> dict[type, list[cst.CSTNode]]:
        index: dict[type, list[cst.CSTNode]] = {}
        for node in syntax.walk(self.module):
            index.setdefault(type(node), []).append(node)
        return index

    def nodes(self, *types: type) -> list[cst.CSTNode]:
        """Every node of the given types in the file, in source order per type: one walk of the
        tree shared by all rules, instead of a libcst visitor per rule."""
        return [node for kind in types for node in self._nodes_by_type.get(kind, [])]

    def grad_disabled(self, step: Step) -> bool:
        """Whether `step` runs with autograd off: inside `with torch.no_grad()` /
        `torch.inference_mode()`, or in a function decorated with them, here or at a call site
        that led to it."""
        node: cst.CSTNode | None = step.node
        frame: Frame | None = step.frame
        while node is not None:
            parent = self.parent(node)
            if isinstance(parent, cst.With) and any(self._is_no_grad(item.item) for item in parent.items):
                return True
            if isinstance(parent, cst.FunctionDef):
                if any(self._is_no_grad(d.decorator) for d in parent.decorators):
                    return True
                # Continue at the call site that ran this function, if the trace inlined it.
                while frame is not None and frame.function is not parent:
                    frame = frame.parent
                if frame is None or frame.parent is None or frame.call is None or self.parent(frame.call) is None:
                    return False
                node, frame = frame.call, frame.parent
                continue
            node = parent
        return False

    def _is_no_grad(self, expr: cst.BaseExpression) -> bool:
        target = expr.func if isinstance(expr, cst.Call) else expr
        qual = self.qualname(target)
        if qual in NO_GRAD_CONTEXTS:
            return True
        if qual == "torch.set_grad_enabled" and isinstance(expr, cst.Call) and expr.args:
            return isinstance(expr.args[0].value, cst.Name) and expr.args[0].value.value == "False"
        return False

    def binding(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> tuple[Step, cst.BaseExpression] | None:
        """Where the name `expr` got its value before `step`: the step of the latest assignment to
        it and the assigned expression (or, for a parameter of an inlined function, the argument
        at the call site and the step that made the call). None when unknown."""
        text = dotted(expr)
        if text is None:
            return None
        key = evaluate.env_key(expr, step.frame)
        visible = {id(f) for f in step.frame.chain()}
        for earlier in reversed(trace.steps[: step.index]):
            node = earlier.node
            if isinstance(node, cst.Assign) and len(node.targets) == 1:
                target = node.targets[0].target
            elif isinstance(node, cst.AnnAssign) and node.value is not None:
                target = node.target
            else:
                continue
            if dotted(target) != text:
                continue
            other = evaluate.env_key(target, earlier.frame)
            if other == key or (other is not None and other[0] == "local" and id(earlier.frame) in visible):
                return earlier, node.value
        frame = step.frame
        if isinstance(expr, cst.Name) and frame.function is not None and frame.call is not None:
            params = [p.name.value for p in frame.function.params.params]
            if expr.value in params and frame.parent is not None:
                if frame.cls is not None and params and params[0] == "self":
                    params = params[1:]
                arg = syntax.argument(frame.call, params.index(expr.value), expr.value) if expr.value in params else None
                caller = next(
                    (s for s in trace.steps[step.index :] if s.frame is frame.parent and any(c is frame.call for c in syntax.own_calls(s.node))),
                    None,
                )
                if arg is not None and caller is not None:
                    return caller, arg
        return None

    def value(self, trace: Trace, step: Step, expr: cst.BaseExpression | None) -> Value | None:
        return trace.value(expr, step)

    def scales_with_world_size(self, trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
        """Whether `expr` involves the number of workers: `hvd.size()`, `dist.get_world_size()`,
        `WORLD_SIZE`, directly or through a variable or helper computed from them."""
        for sub in _subexpressions(expr):
            value = trace.value(sub, step)
            if value is not None and value.kind in (kinds.WORLD_SIZE, kinds.LOCAL_SIZE, "scaled"):
                return True
        return False

    # --- backward passes and optimizer steps -------------------------------------------------
    def is_backward(self, call: cst.Call) -> bool:
        """`loss.backward()`, `scaler.scale(loss).backward()`, `torch.autograd.backward(...)`."""
        if self.qualname(call.func) == "torch.autograd.backward":
            return True
        return isinstance(call.func, cst.Attribute) and call.func.attr.value == "backward" and self.qualname(call.func) is None

    def stepped_optimizer(self, trace: Trace, step: Step, call: cst.Call) -> Value | None:
        """The optimizer (OPTIMIZER or HVD_OPTIMIZER value) that `opt.step()` or
        `scaler.step(opt)` steps, or None when `call` is no known optimizer step."""
        if not (isinstance(call.func, cst.Attribute) and call.func.attr.value == "step"):
            return None
        optimizer_kinds = (kinds.OPTIMIZER, kinds.HVD_OPTIMIZER)
        receiver = trace.value(call.func.value, step)
        if receiver is not None and receiver.kind in optimizer_kinds:
            return receiver
        if receiver is not None and receiver.kind == kinds.SCALER and call.args:
            stepped = trace.value(call.args[0].value, step)
            if stepped is not None and stepped.kind in optimizer_kinds:
                return stepped
        return None

    def backward_passes_per_step(self, trace: Trace, step: Step) -> int | None:
        """How many backward passes run for each execution of the optimizer step at `step`,
        when statically known: backward and step once per iteration of the same loop (1), the
        step under `if (i + 1) % k == 0` (k), the backward inside `for _ in range(k)` nested in
        the step's loop (k), several unconditional backward calls per iteration (their number),
        or `if amp: scaler.scale(loss).backward() else: loss.backward()` (1). None otherwise."""
        if not step.loops:
            return None
        loop = step.loops[-1]
        step_guards = {(id(g.test), g.negated) for g in step.guards}
        passes: list[tuple[int, tuple[tuple[int, bool], ...], set[tuple[int, bool]]]] = []
        updates = 0
        for other in trace.steps:
            if not other.in_loop(loop):
                continue
            for call in syntax.own_calls(other.node):
                if isinstance(call.func, cst.Attribute) and call.func.attr.value == "step" and self.stepped_optimizer(trace, other, call) is not None:
                    updates += 1
                if not self.is_backward(call):
                    continue
                inner = other.loops[other.loops.index(loop) + 1 :]
                count = 1
                for nested in inner:
                    times = _static_range_length(trace, other, nested)
                    if times is None or step.in_loop(nested):
                        return None
                    count *= times
                extra = tuple((id(g.test), g.negated) for g in other.guards if (id(g.test), g.negated) not in step_guards)
                passes.append((count, extra, {(id(g.test), g.negated) for g in other.guards}))
        if not passes or updates != 1:
            return None
        unconditional = [count for count, extra, _ in passes if not extra]
        conditional = [(count, extra) for count, extra, _ in passes if extra]
        if conditional:
            # One if/else pair choosing between two spellings of the same backward pass.
            if unconditional or len(conditional) != 2:
                return None
            (c1, e1), (c2, e2) = conditional
            if not (len(e1) == len(e2) == 1 and e1[0][0] == e2[0][0] and e1[0][1] != e2[0][1] and c1 == c2):
                return None
            per_iteration = c1
        else:
            per_iteration = sum(unconditional)
        # Conditions on the step that not every backward pass shares: `if (i + 1) % k == 0`.
        shared = set.intersection(*(guards for _, _, guards in passes))
        step_only = [g for g in step.guards if (id(g.test), g.negated) not in shared]
        if not step_only:
            return per_iteration
        if len(step_only) != 1 or step_only[0].negated:
            return None
        period = _modulo_period(trace, step, step_only[0].test)
        return None if period is None else period * per_iteration

    def is_entry(self, trace: Trace) -> bool:
        """Whether a trace is a known entry point of the script: the module body, or a function
        handed to a launcher (`mp.spawn(worker, ...)`, `launch(main, ...)`,
        `Process(target=train)`). A function that nothing in the file calls or references may be
        library code whose callers, and their rank guards, cannot be seen."""
        if isinstance(trace.root, cst.Module):
            return True
        return isinstance(trace.root, cst.FunctionDef) and trace.root.name.value in self._referenced_functions

    @cached_property
    def _referenced_functions(self) -> frozenset[str]:
        names: set[str] = set(self.info.spawn_targets)
        functions = self.info.functions

        for node in self.nodes(cst.Arg):
            if isinstance(node.value, cst.Name) and node.value.value in functions:
                names.add(node.value.value)
        return frozenset(names)

    @cached_property
    def runs_multi_process(self) -> bool:
        """A script that really runs several processes: it starts a process group or Horovod, or
        wraps a model in DDP (importing `torch.distributed` alone is not enough)."""
        if not self.is_distributed:
            return False
        if self.process_group_initialised:
            return True
        wanted = (frameworks.HOROVOD_INIT, frameworks.DDP)
        return any(self.qualname(call.func) in wanted for _, call in self._all_calls)

    def data_flow(self, trace: Trace, start: Step, seeds: set[tuple[int, str]]) -> Iterator[tuple[Step, bool]]:
        """Follow data forward from `start` along the trace: yields every later step with whether
        it reads a tainted name, tainting what such a step assigns. `seeds` are
        (frame id, name) pairs; a helper that returns tainted data taints its call site's targets.
        Names only: attributes and containers are followed through their base name."""
        tainted = set(seeds)
        returned: set[int] = set()
        for step in trace.steps[start.index + 1 :]:
            calls = syntax.own_calls(step.node)
            uses = any((step.frame.id, name) in tainted for name in _read_names(step.node))
            uses = uses or any(id(call) in returned for call in calls)
            if uses:
                for name in _assigned_names(step.node):
                    tainted.add((step.frame.id, name))
                if isinstance(step.node, cst.Return) and step.frame.call is not None:
                    returned.add(id(step.frame.call))
            yield step, uses

    def parts_of(self, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> Iterator[tuple[Step, cst.BaseExpression]]:
        """The expressions whose values make up `expr`, each with the step to evaluate it at:
        `expr` itself, the entries of a dict/list/tuple literal or `dict(...)` call, and, through
        names, what was assigned to them (including `ckpt["model"] = ...` stores in between) and
        the argument a helper's parameter was given. `torch.save(state, f)` in a helper called
        with `{"model": model.state_dict()}` yields that `state_dict()` call."""
        yield step, expr
        if depth > 6:
            return
        if isinstance(expr, cst.Dict):
            for element in expr.elements:
                yield from self.parts_of(trace, step, element.value, depth + 1)
        elif isinstance(expr, (cst.List, cst.Tuple)):
            for element in expr.elements:
                yield from self.parts_of(trace, step, element.value, depth + 1)
        elif isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name) and expr.func.value == "dict":
            for arg in expr.args:
                yield from self.parts_of(trace, step, arg.value, depth + 1)
        elif isinstance(expr, (cst.Name, cst.Attribute)):
            found = self.binding(trace, step, expr)
            if found is None:
                return
            source_step, source = found
            yield from self.parts_of(trace, source_step, source, depth + 1)
            text = dotted(expr)
            for between in trace.steps[source_step.index + 1 : step.index]:
                node = between.node
                if isinstance(node, cst.Assign) and len(node.targets) == 1:
                    target = node.targets[0].target
                    if isinstance(target, cst.Subscript) and dotted(target.value) == text:
                        yield from self.parts_of(trace, between, node.value, depth + 1)

    # --- positions and edits -----------------------------------------------------------------
    @cached_property
    def _positions(self):
        # Only files that report anything pay for positions.
        return MetadataWrapper(self.module, unsafe_skip_copy=True).resolve(PositionProvider)

    def position(self, node: cst.CSTNode) -> CodeRange:
        return self._positions[node]

    @cached_property
    def lines(self) -> list[str]:
        return self.source.splitlines(keepends=True)

    def indentation_of(self, node: cst.CSTNode) -> str:
        line = self.lines[self.position(node).start.line - 1]
        return line[: len(line) - len(line.lstrip())]

    def line_text(self, node: cst.CSTNode) -> str:
        """The full source lines a statement spans, with their newline."""
        pos = self.position(node)
        return "".join(self.lines[pos.start.line - 1 : pos.end.line])

    def delete_lines(self, node: cst.CSTNode) -> Edit:
        pos = self.position(node)
        return Edit(pos.start.line, 1, pos.end.line + 1, 1, "")

    def insert_before(self, node: cst.CSTNode, text: str) -> Edit:
        line = self.position(node).start.line
        return Edit(line, 1, line, 1, text)

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)


def _tests_local_rank(test: cst.BaseExpression, ctx: LintContext, step: Step) -> bool:
    """Whether a rank test reads the local rank (true once per node, not once per job), e.g.
    `local_rank == 0`, or `args.rank % ngpus_per_node == 0` (pytorch/examples imagenet)."""
    evaluator = evaluate.Evaluator(ctx.info, step.env, step.frame, {})
    for node in syntax.walk(test):
        if isinstance(node, (cst.Name, cst.Attribute, cst.Call, cst.BinaryOperation)):
            value = evaluator.eval(node)
            if value is not None and value.kind == kinds.LOCAL_RANK:
                return True
    return False


def _read_names(node: cst.CSTNode) -> set[str]:
    """Names a step reads: the whole small statement, or the header of a compound one."""
    parts: list[cst.CSTNode]
    if isinstance(node, (cst.If, cst.While)):
        parts = [node.test]
    elif isinstance(node, cst.For):
        parts = [node.iter]
    elif isinstance(node, cst.With):
        parts = list(node.items)
    elif isinstance(node, cst.Assign):
        parts = [node.value, *(t.target for t in node.targets if not isinstance(t.target, (cst.Name, cst.Tuple, cst.List)))]
    elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
        parts = [node.value] if node.value is not None else []
        if isinstance(node, cst.AugAssign):
            parts.append(node.target)
    elif isinstance(node, cst.BaseSmallStatement):
        parts = [node]
    else:
        parts = []
    names: set[str] = set()
    for part in parts:
        attribute_names: set[int] = set()
        for node in syntax.walk(part, skip=(cst.Lambda,)):
            if isinstance(node, cst.Attribute):
                attribute_names.add(id(node.attr))  # `x.attr` reads x, not a name `attr`
            elif isinstance(node, cst.Name) and id(node) not in attribute_names:
                names.add(node.value)
    return names


def _assigned_names(node: cst.CSTNode) -> set[str]:
    """Base names a statement binds or mutates (`x = ...`, `a, b = ...`, `d["k"] = ...`, `x += ...`,
    `for x in ...`, `with ... as x`)."""
    targets: list[cst.CSTNode] = []
    if isinstance(node, cst.Assign):
        targets = [t.target for t in node.targets]
    elif isinstance(node, (cst.AnnAssign, cst.AugAssign)):
        targets = [node.target]
    elif isinstance(node, cst.For):
        targets = [node.target]
    elif isinstance(node, cst.With):
        targets = [item.asname.name for item in node.items if item.asname is not None]
    names: set[str] = set()
    for target in targets:
        while isinstance(target, (cst.Subscript, cst.Attribute)):
            target = target.value
        if isinstance(target, cst.Name):
            names.add(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                names |= _assigned_names(cst.Assign([cst.AssignTarget(element.value)], cst.Name("None")))
    return names


def _subexpressions(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    if isinstance(expr, cst.Lambda):
        return [expr]  # a lambda's body runs later, not where the expression is evaluated
    return [node for node in syntax.walk(expr, skip=(cst.Lambda,)) if isinstance(node, cst.BaseExpression)]


def _static_int(trace: Trace, step: Step, expr: cst.BaseExpression) -> int | None:
    value = trace.value(expr, step)
    if value is None or value.kind != kinds.CONST:
        return None
    number = value.attrs.get("value")
    return number if isinstance(number, int) and not isinstance(number, bool) else None


def _static_range_length(trace: Trace, step: Step, loop: cst.CSTNode) -> int | None:
    """The number of iterations of `for _ in range(k)` / `range(a, b)` with known bounds."""
    if not (isinstance(loop, cst.For) and isinstance(loop.iter, cst.Call) and dotted(loop.iter.func) == "range"):
        return None
    args = [arg.value for arg in loop.iter.args if arg.keyword is None and not arg.star]
    if not 1 <= len(args) <= 2 or len(args) != len(loop.iter.args):
        return None
    bounds = [_static_int(trace, step, arg) for arg in args]
    if any(bound is None for bound in bounds):
        return None
    start, stop = (0, bounds[0]) if len(bounds) == 1 else (bounds[0], bounds[1])
    return max(0, stop - start)


def _modulo_period(trace: Trace, step: Step, test: cst.BaseExpression) -> int | None:
    """k for `(i + 1) % k == 0`, `not i % k`, `... % k == 0 or last_batch`, with k known."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        periods = [p for p in (_modulo_period(trace, step, test.left), _modulo_period(trace, step, test.right)) if p is not None]
        return periods[0] if len(periods) == 1 else None
    modulo: cst.BaseExpression | None = None
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        modulo = test.expression
    elif isinstance(test, cst.Comparison) and len(test.comparisons) == 1 and isinstance(test.comparisons[0].operator, cst.Equal):
        # `(i + 1) % k == 0`, `i % k == k - 1`: once every k iterations, whatever the remainder.
        left, right = test.left, test.comparisons[0].comparator
        if _static_int(trace, step, left) is not None:
            left, right = right, left
        if _static_int(trace, step, right) is not None:
            modulo = left
    if not (isinstance(modulo, cst.BinaryOperation) and isinstance(modulo.operator, cst.Modulo)):
        return None
    period = _static_int(trace, step, modulo.right)
    return period if period is not None and period > 0 else None


def wrapper_holding(trace: Trace, step: Step, expr: cst.BaseExpression) -> Value | None:
    """The DDP wrapper (already built before `step`) whose wrapped module `expr` is:
    `ddp.module`, or the name that was passed to `DDP(...)`."""
    if isinstance(expr, cst.Attribute) and expr.attr.value == "module":
        outer = trace.value(expr.value, step)
        if outer is not None and outer.kind == kinds.DDP:
            return outer
    value = trace.value(expr, step)
    if value is None or value.node is None or value.kind in (kinds.DDP, kinds.CONST, kinds.TUPLE):
        return None
    for other in step.env.values():
        if other.kind == kinds.DDP and other.inner is not None and other.inner.same_object(value):
            return other
    return None


def is_lr_slot(target: cst.BaseExpression) -> bool:
    """`group["lr"]` / `optimizer.param_groups[0]["lr"]`: an assignment target that sets a
    learning rate."""
    if not isinstance(target, cst.Subscript) or len(target.slice) != 1:
        return False
    index = target.slice[0].slice
    return isinstance(index, cst.Index) and isinstance(index.value, cst.SimpleString) and index.value.evaluated_value == "lr"
