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

from distdoctor import flow
from distdoctor.finding import Edit
from distdoctor.flow import Guard, ModuleInfo, Step, Trace, Value
from distdoctor.names import ImportTable, dotted


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
        return ModuleInfo.of(self.module, self.imports)

    @cached_property
    def traces(self) -> list[Trace]:
        return flow.build_traces(self.info)

    def qualname(self, node: cst.CSTNode) -> str | None:
        return self.imports.qualname(node)

    def steps(self) -> Iterator[tuple[Trace, Step]]:
        return flow.iter_steps(self.traces)

    def calls(self, *qualnames: str, suffix: str | None = None) -> Iterator[tuple[Trace, Step, cst.Call]]:
        """Calls on the code path to any of `qualnames` (or whose qualified name ends with
        `.suffix`), with their trace and step."""
        for trace in self.traces:
            for step, call in trace.calls():
                qual = self.qualname(call.func)
                if qual is None:
                    continue
                if qual in qualnames or (suffix is not None and qual.endswith("." + suffix)):
                    yield trace, step, call

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
            value = flow.Evaluator(self.info, step.env, guard.frame, {}).eval(guard.test)
            if value is None or value.kind != flow.RANK_TEST:
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

        class Collector(cst.CSTVisitor):
            def on_visit(self, node: cst.CSTNode) -> bool:
                for child in node.children:
                    parents[id(child)] = node
                return True

        self.module.visit(Collector())
        return parents

    def grad_disabled(self, step: Step) -> bool:
        """Whether `step` runs with autograd off: inside `with torch.no_grad()` /
        `torch.inference_mode()`, or in a function decorated with them, here or at a call site
        that led to it."""
        node: cst.CSTNode | None = step.node
        frame: flow.Frame | None = step.frame
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
        key = flow.env_key(expr, step.frame)
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
            other = flow.env_key(target, earlier.frame)
            if other == key or (other is not None and other[0] == "local" and id(earlier.frame) in visible):
                return earlier, node.value
        frame = step.frame
        if isinstance(expr, cst.Name) and frame.function is not None and frame.call is not None:
            params = [p.name.value for p in frame.function.params.params]
            if expr.value in params and frame.parent is not None:
                if frame.cls is not None and params and params[0] == "self":
                    params = params[1:]
                arg = flow.argument(frame.call, params.index(expr.value), expr.value) if expr.value in params else None
                caller = next(
                    (s for s in trace.steps[step.index :] if s.frame is frame.parent and any(c is frame.call for c in flow.own_calls(s.node))),
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
            if value is not None and value.kind in (flow.WORLD_SIZE, flow.LOCAL_SIZE, "scaled"):
                return True
        return False

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
    """Whether a rank test reads the local rank (true once per node, not once per job)."""
    found = False

    class Finder(cst.CSTVisitor):
        def visit_Name(self, node: cst.Name) -> None:
            nonlocal found
            value = flow.Evaluator(ctx.info, step.env, step.frame, {}).eval(node)
            if value is not None and value.kind == flow.LOCAL_RANK:
                found = True

        def visit_Attribute(self, node: cst.Attribute) -> bool:
            nonlocal found
            value = flow.Evaluator(ctx.info, step.env, step.frame, {}).eval(node)
            if value is not None and value.kind == flow.LOCAL_RANK:
                found = True
                return False
            return True

        def visit_Call(self, node: cst.Call) -> bool:
            nonlocal found
            value = flow.Evaluator(ctx.info, step.env, step.frame, {}).eval(node)
            if value is not None and value.kind == flow.LOCAL_RANK:
                found = True
            return True

    test.visit(Finder())
    return found


def _subexpressions(expr: cst.BaseExpression) -> list[cst.BaseExpression]:
    found: list[cst.BaseExpression] = []

    class Collector(cst.CSTVisitor):
        def on_visit(self, node: cst.CSTNode) -> bool:
            if isinstance(node, cst.BaseExpression):
                found.append(node)
            return not isinstance(node, (cst.Lambda,))

    expr.visit(Collector())
    return found
