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
