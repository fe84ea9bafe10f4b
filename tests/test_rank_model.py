"""The shared model of ranks: what a name holds and which ranks a condition lets through. Rules
(DD301, DD302, DD304, ...) all read these answers, so they are tested once here."""

from __future__ import annotations

import textwrap

import libcst as cst
import pytest

from distdoctor.lint.analysis import evaluate, kinds
from distdoctor.lint.analysis.context import LintContext

ZERO, OTHERS = kinds.RankSet(True), kinds.RankSet(False)
MAYBE_ZERO, MAYBE_OTHERS = kinds.RankSet(True, certain=False), kinds.RankSet(False, certain=False)

PRELUDE = """
import os
import torch.distributed as dist
import horovod.torch as hvd
from utils.dist import init_distributed

rank = int(os.environ["RANK"])
local_rank = int(os.environ["LOCAL_RANK"])
world_size, grank = init_distributed()
opt_rank, opt_local = rank, *[local_rank]
node = int(os.environ["NODE_RANK"])
is_rank0 = dist.get_rank() == 0
"""


def _last_if(source: str):
    module = cst.parse_module(textwrap.dedent(source))
    ctx = LintContext("t.py", module.code, module)
    trace = ctx.traces[0]
    step = [s for s in trace.steps if isinstance(s.node, cst.If)][-1]
    value = evaluate.Evaluator(ctx.info, step.env, step.frame, step.results).eval(step.node.test)
    return ctx, trace, step, value


def _ranks(test: str):
    _, _, _, value = _last_if(PRELUDE + f"if {test}:\n    pass\n")
    if value is None or value.kind != kinds.RANK_TEST:
        return None
    return value.attrs.get("true"), value.attrs.get("false")


@pytest.mark.parametrize(
    ("test", "expected"),
    [
        ("rank == 0", (ZERO, OTHERS)),
        ("0 == rank", (ZERO, OTHERS)),
        ("rank != 0", (OTHERS, ZERO)),
        ("rank > 0", (OTHERS, ZERO)),
        ("0 < rank", (OTHERS, ZERO)),
        ("rank <= 0", (ZERO, OTHERS)),
        ("rank < 1", (ZERO, OTHERS)),
        ("rank >= 1", (OTHERS, ZERO)),
        ("rank in [-1, 0]", (ZERO, OTHERS)),
        ("rank in (-1, 0)", (ZERO, OTHERS)),
        ("rank not in (-1, 0)", (OTHERS, ZERO)),
        ("not rank", (ZERO, OTHERS)),
        ("not is_rank0", (OTHERS, ZERO)),
        ("hvd.rank() != 0", (OTHERS, ZERO)),
        # names bound from an unknown helper, or through starred unpacking, keep their meaning
        ("grank == 0", (ZERO, OTHERS)),
        ("opt_rank == 0", (ZERO, OTHERS)),
        # a term on the number of processes is decided for a multi-process run
        ("not dist.is_initialized() or dist.get_rank() == 0", (ZERO, OTHERS)),
        ("world_size == 1 or rank == 0", (ZERO, OTHERS)),
        ("args.distributed and rank == 0", (ZERO, OTHERS)),
        # a term that says nothing of ranks leaves the other side only possible
        ("rank == 0 and epoch % 10 == 0", (ZERO, MAYBE_OTHERS)),
        ("args.debug or rank == 0", (MAYBE_ZERO, OTHERS)),
        ("not use_fsdp_eval and not is_rank0", (OTHERS, MAYBE_ZERO)),
        ("not is_rank0 or skip", (MAYBE_OTHERS, ZERO)),
    ],
)
def test_which_ranks_a_condition_lets_through(test, expected):
    assert _ranks(test) == expected


@pytest.mark.parametrize("test", ["rank == -1", "args.distributed", "epoch == 0", "world_size > 1", "node == 0"])
def test_conditions_that_do_not_select_ranks(test):
    assert _ranks(test) is None


@pytest.mark.parametrize(
    ("expr", "kind"),
    [
        ("node * 8 + local_rank", kinds.RANK),
        ("args.node_rank * ngpus + gpu_index", kinds.RANK),
        ("args.node_rank * ngpus", kinds.NODE_RANK),
        ("opt_local", kinds.LOCAL_RANK),  # `a, *[local_rank]`: the starred items are spliced in
        ("rank % 8", kinds.LOCAL_RANK),
    ],
)
def test_what_an_expression_holds(expr, kind):
    module = cst.parse_module(textwrap.dedent(PRELUDE + f"x = {expr}\nif x:\n    pass\n"))
    ctx = LintContext("t.py", module.code, module)
    step = [s for s in ctx.traces[0].steps if isinstance(s.node, cst.If)][-1]
    held = evaluate.lookup(step.env, "x", step.frame)
    assert held is not None and held.kind == kind


def test_early_return_guards_what_follows_and_continue_too():
    source = PRELUDE + textwrap.dedent(
        """
        def save(model):
            if hvd.rank() != 0:
                return
            torch.save(model.state_dict(), "m.pt")

        for epoch in range(3):
            save(model)
            if dist.get_rank() != 0:
                continue
            print(epoch)
        """
    )
    module = cst.parse_module(source)
    ctx = LintContext("t.py", module.code, module)
    trace = ctx.traces[0]
    for text in ('torch.save(model.state_dict(), "m.pt")', "print(epoch)"):
        step = next(s for s in trace.steps if ctx.code(s.node) == text)
        assert ctx.under_rank_zero(trace, step), text


def test_spawned_worker_keeps_its_index_at_a_constant_call_site():
    source = textwrap.dedent(
        """
        import torch.multiprocessing as mp

        def train(rank, args):
            if rank == 0:
                print("ready")

        if __name__ == "__main__":
            if args.ngpus > 1:
                mp.spawn(train, nprocs=args.ngpus, args=(args,))
            else:
                train(0, args)
        """
    )
    module = cst.parse_module(source)
    ctx = LintContext("t.py", module.code, module)
    trace = ctx.traces[0]
    prints = [s for s in trace.steps if ctx.code(s.node) == 'print("ready")']
    assert len(prints) == 2  # both call sites are on the trace
    assert all(ctx.under_rank_zero(trace, step) for step in prints)
