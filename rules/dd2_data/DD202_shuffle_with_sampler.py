"""DD202 shuffle-with-sampler: `DataLoader(shuffle=True, sampler=...)` raises at start."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.finding import Edit, Fix
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

LOADER = "torch.utils.data.DataLoader"


class ShuffleWithSampler(Rule):
    """
    ## What it does
    Flags `DataLoader(..., shuffle=True, sampler=...)` (and `shuffle=True` with a
    `batch_sampler=`) when the sampler is not the literal `None`. `shuffle` counts as true when it
    is the literal `True` or a name known to hold `True` on that code path. A conditional
    `shuffle` counts by its branch for the multi-process run when its test says whether the job is
    distributed (`shuffle=False if args.distributed else True` is silent: the sampler is only set
    in that run), and otherwise only when both of its branches are true.

    A sampler held in a variable that may be `None` (`sampler = DistributedSampler(ds) if
    distributed else None`) is flagged too: the distributed run, the one that matters, crashes.

    ## Why is this bad?
    `DataLoader` raises `ValueError: sampler option is mutually exclusive with shuffle` when both
    are given: the job dies before its first step, on every rank. Shuffling is the sampler's job
    (`DistributedSampler(shuffle=True)` is the default, reseeded by `set_epoch`).

    ## Example
    ```python
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(train_set, batch_size=64, shuffle=True, sampler=sampler)
    ```

    ## Use instead
    ```python
    sampler = DistributedSampler(train_set) if distributed else None
    loader = DataLoader(train_set, batch_size=64, shuffle=(sampler is None), sampler=sampler)
    ```

    ## Fix safety
    Safe, offered when `shuffle` is the literal `True`. When the sampler is a variable or an
    attribute, the fix writes `shuffle=(<sampler> is None)`: that is `False` whenever a sampler
    is passed (the only value `DataLoader` accepts then) and keeps shuffling in the
    single-process path, where such variables are commonly `None`, so no run loses its shuffle.
    When the sampler is built inline (`sampler=DistributedSampler(ds)`), it can never be `None`,
    and repeating the expression would build a second sampler, so the fix writes
    `shuffle=False`. Other sampler expressions (a conditional inline) get no fix.
    """

    code = "DD202"
    name = "shuffle-with-sampler"
    severity = "error"
    summary = "DataLoader given both shuffle=True and a sampler"
    requires = (frameworks.LOADER_WORDS,)

    invalid = (
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set)
            loader = DataLoader(train_set, batch_size=64, shuffle=True, sampler=sampler)  # expect: DD202
            """,
            fixed="""
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set)
            loader = DataLoader(train_set, batch_size=64, shuffle=(sampler is None), sampler=sampler)  # expect: DD202
            """,
        ),
        Example(
            """
            import torch
            from torch.utils.data.distributed import DistributedSampler

            loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=32,
                shuffle=True,  # expect: DD202
                sampler=DistributedSampler(dataset),
                num_workers=4,
            )
            """,
            fixed="""
            import torch
            from torch.utils.data.distributed import DistributedSampler

            loader = torch.utils.data.DataLoader(
                dataset,
                batch_size=32,
                shuffle=False,  # expect: DD202
                sampler=DistributedSampler(dataset),
                num_workers=4,
            )
            """,
        ),
        Example(
            """
            import torch.utils.data as data

            class Runner:
                def __init__(self, args, train_set):
                    self.train_sampler = data.distributed.DistributedSampler(train_set) if args.distributed else None
                    self.loader = data.DataLoader(train_set, args.batch_size, True, self.train_sampler)  # expect: DD202
            """,
            fixed="""
            import torch.utils.data as data

            class Runner:
                def __init__(self, args, train_set):
                    self.train_sampler = data.distributed.DistributedSampler(train_set) if args.distributed else None
                    self.loader = data.DataLoader(train_set, args.batch_size, (self.train_sampler is None), self.train_sampler)  # expect: DD202
            """,
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            def make_loader(dataset, shuffle):
                return DataLoader(dataset, batch_size=8, shuffle=shuffle, sampler=DistributedSampler(dataset, shuffle=shuffle))  # expect: DD202

            train_loader = make_loader(train_set, shuffle=True)
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set) if args.distributed else None
            shuffle = True if args.distributed else False
            loader = DataLoader(train_set, batch_size=64, shuffle=shuffle, sampler=sampler)  # expect: DD202
            """
        ),
    )
    valid = (
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set) if distributed else None
            loader = DataLoader(train_set, batch_size=64, shuffle=(sampler is None), sampler=sampler)
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            loader = DataLoader(train_set, batch_size=64, shuffle=False, sampler=DistributedSampler(train_set))
            val_loader = DataLoader(val_set, batch_size=64, shuffle=True, sampler=None)
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            def make_loader(dataset, shuffle):
                return DataLoader(dataset, batch_size=8, shuffle=shuffle, sampler=DistributedSampler(dataset))

            val_loader = make_loader(val_set, shuffle=False)
            """
        ),
        Example(
            """
            import torch.distributed as dist

            class DataLoader:  # a local loader, not torch's
                def __init__(self, dataset, shuffle, sampler):
                    pass

            loader = DataLoader(ds, shuffle=True, sampler=order)
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set) if args.distributed else None
            loader = DataLoader(train_set, batch_size=64, shuffle=False if args.distributed else True, sampler=sampler)
            shuffle_eval = False if args.distributed else True
            eval_sampler = DistributedSampler(eval_set, shuffle=False) if args.distributed else None
            eval_loader = DataLoader(eval_set, batch_size=64, shuffle=shuffle_eval, sampler=eval_sampler)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        reported: set[int] = set()
        for trace, step, call in ctx.calls(LOADER):
            if id(call) in reported or any(arg.star for arg in call.args):
                continue
            shuffle = syntax.argument(call, 2, "shuffle")
            if shuffle is None or not _is_true(ctx, trace, step, shuffle):
                continue
            which = "sampler"
            sampler = syntax.argument(call, 3, "sampler")
            if sampler is None or _is_none(trace, step, sampler):
                which, sampler = "batch_sampler", syntax.argument(call, 4, "batch_sampler")
                if sampler is None or _is_none(trace, step, sampler):
                    continue
            reported.add(id(call))
            yield Report(
                syntax.arg_node(call, shuffle),
                f"DataLoader gets shuffle=True and a {which}: it raises ValueError (mutually exclusive) "
                f"before the first batch. The {which} does the shuffling: pass "
                f"shuffle=({ctx.code(sampler)} is None) or shuffle=False."
                if isinstance(sampler, (cst.Name, cst.Attribute))
                else f"DataLoader gets shuffle=True and a {which}: it raises ValueError (mutually exclusive) "
                f"before the first batch. The {which} does the shuffling: pass shuffle=False.",
                fix=_fix(ctx, shuffle, sampler),
            )


def _is_true(ctx: LintContext, trace: Trace, step: Step, expr: cst.BaseExpression, depth: int = 0) -> bool:
    """Whether `shuffle` is true in the run where the sampler is set. A conditional
    (`False if args.distributed else True`, directly or through a name) counts by its branch for
    the multi-process run, where a distributed sampler is set; under any other test, only when
    both branches are true."""
    if isinstance(expr, cst.Name) and expr.value == "True":
        return True
    if depth > 4:
        return False
    if isinstance(expr, cst.IfExp):
        test = trace.value(expr.test, step)
        if test is not None and test.kind == kinds.PROCESS_COUNT_TEST:
            branch = expr.body if test.attrs.get("multi") else expr.orelse
            return _is_true(ctx, trace, step, branch, depth + 1)
        return _is_true(ctx, trace, step, expr.body, depth + 1) and _is_true(ctx, trace, step, expr.orelse, depth + 1)
    if isinstance(expr, (cst.Name, cst.Attribute)):
        found = ctx.binding(trace, step, expr)
        if found is not None and isinstance(found[1], cst.IfExp):
            return _is_true(ctx, trace, found[0], found[1], depth + 1)
    value = trace.value(expr, step)
    return value is not None and value.kind == kinds.CONST and value.attrs.get("value") is True


def _is_none(trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
    if isinstance(expr, cst.Name) and expr.value == "None":
        return True
    value = trace.value(expr, step)
    return value is not None and value.kind == kinds.CONST and value.attrs.get("value") is None


def _fix(ctx: LintContext, shuffle: cst.BaseExpression, sampler: cst.BaseExpression) -> Fix | None:
    if not (isinstance(shuffle, cst.Name) and shuffle.value == "True"):
        return None
    if isinstance(sampler, (cst.Name, cst.Attribute)):
        text = f"({ctx.code(sampler)} is None)"
    elif isinstance(sampler, cst.Call):
        text = "False"
    else:
        return None
    pos = ctx.position(shuffle)
    return Fix(
        message=f"shuffle={text}",
        edits=(Edit(pos.start.line, pos.start.column + 1, pos.end.line, pos.end.column + 1, text),),
    )
