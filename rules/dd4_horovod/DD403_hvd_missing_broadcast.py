"""DD403 hvd-missing-broadcast: hvd.DistributedOptimizer without any broadcast of the weights."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.trace import Step
from distdoctor.lint.rule import Example, Report, Rule

DISTRIBUTED_OPTIMIZER = "horovod.torch.DistributedOptimizer"
# Anything that aligns the starting weights: the documented broadcast, per-tensor broadcasts, and
# elastic state objects, whose `sync()` broadcasts model and optimizer when training (re)starts.
_ALIGNING_APIS = (
    "broadcast_parameters",
    "broadcast_",
    "broadcast",
    "broadcast_async_",
    "broadcast_object",
    "TorchState",
    "ObjectState",
)


class HorovodMissingBroadcast(Rule):
    """
    ## What it does
    Flags `hvd.DistributedOptimizer(...)` in a file that never broadcasts the model's weights:
    no `hvd.broadcast_parameters(...)`, no per-tensor `hvd.broadcast_`/`hvd.broadcast`, no
    `hvd.broadcast_object`, and no elastic `hvd.elastic.TorchState` (whose `sync()` broadcasts).

    ## Why is this bad?
    `DistributedOptimizer` averages the gradients, but every rank starts from its own random
    initialisation (or its own checkpoint): averaged gradients applied to different weights keep
    the replicas different for the whole run. Unlike DDP, Horovod does not broadcast at wrap time;
    its documentation asks for `hvd.broadcast_parameters(model.state_dict(), root_rank=0)` and
    `hvd.broadcast_optimizer_state(optimizer, root_rank=0)` after the model and optimizer are
    created (and after a checkpoint is restored).

    A call to a function whose name ends in `broadcast_parameters` (a project helper that may
    broadcast) also keeps the rule silent: when in doubt, it stays quiet.

    ## Example
    ```python
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    for data, target in loader:
        ...
    ```

    ## Use instead
    ```python
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ```

    ## Fix safety
    No fix: which model to broadcast, and where (after a checkpoint is restored), is for the
    author to decide.
    """

    code = "DD403"
    name = "hvd-missing-broadcast"
    severity = "error"
    summary = "hvd.DistributedOptimizer used but the weights are never broadcast from rank 0"
    requires = (frameworks.HOROVOD_WORDS,)

    invalid = (
        Example(
            """
            import torch
            import horovod.torch as hvd

            hvd.init()
            model = Net().cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())  # expect: DD403
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            """
        ),
        Example(
            """
            import torch.optim as optim
            from horovod.torch import DistributedOptimizer, init, local_rank

            class Trainer:
                def __init__(self, model):
                    init()
                    self.model = model.cuda(local_rank())
                    self.opt = DistributedOptimizer(  # expect: DD403
                        optim.Adam(self.model.parameters()),
                        named_parameters=self.model.named_parameters(),
                    )
            """
        ),
        Example(
            """
            import horovod.torch

            def main():
                horovod.torch.init()
                model = build()
                opt = horovod.torch.DistributedOptimizer(make_opt(model))  # expect: DD403
                train(model, opt)

            if __name__ == "__main__":
                main()
            """
        ),
    )
    valid = (
        Example(
            # The trainer is handed a model built (and seeded alike on every rank) elsewhere.
            """
            import horovod.torch as hvd

            class HorovodTrainer:
                def fit(self, module):
                    hvd.init()
                    module = module.cuda()
                    optimizer = hvd.DistributedOptimizer(module.optimizer, named_parameters=module.named_parameters())
                    for batch in module.train_dataloader():
                        optimizer.zero_grad()
                        module.training_step(batch).backward()
                        optimizer.step()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            hvd.init()
            model = Net().cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)
            state = hvd.elastic.TorchState(model=model, optimizer=optimizer, epoch=0)

            @hvd.elastic.run
            def train(state):
                ...

            train(state)
            """
        ),
        Example(
            """
            import horovod.torch as hvd
            from utils import broadcast_parameters

            optimizer = hvd.DistributedOptimizer(optimizer)
            broadcast_parameters(model)  # a project helper: trusted
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            def DistributedOptimizer(opt):  # a local function, not Horovod's
                return opt

            optimizer = DistributedOptimizer(optimizer)
            """
        ),
        Example(
            """
            import horovod.torch as hvd

            optimizer = hvd.DistributedOptimizer(optimizer)
            for param in model.parameters():
                hvd.broadcast_(param, root_rank=0)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.uses_horovod or _broadcasts_somewhere(ctx):
            return
        for _, step, call in ctx.calls(DISTRIBUTED_OPTIMIZER):
            if _model_handed_in(step, call):
                continue
            yield Report(
                call,
                "hvd.DistributedOptimizer averages gradients, but the weights are never broadcast: "
                "each rank keeps its own initialisation. Add `hvd.broadcast_parameters(model.state_dict(), "
                "root_rank=0)` and `hvd.broadcast_optimizer_state(optimizer, root_rank=0)` after the "
                "model and optimizer are created (and after any checkpoint is restored).",
            )


def _model_handed_in(step: Step, call: cst.Call) -> bool:
    """The optimizer covers a model the enclosing function was handed (`def fit(self, module):`
    ... `named_parameters=module.named_parameters()`): the model was built, seeded or restored
    where this file cannot see, which may well have made every rank's weights equal."""
    named = syntax.keyword(call, "named_parameters")
    if not (isinstance(named, cst.Call) and isinstance(named.func, cst.Attribute)):
        return False
    text = dotted(named.func.value)
    function = step.frame.function
    if text is None or function is None:
        return False
    root = text.split(".", 1)[0]
    params = (*function.params.posonly_params, *function.params.params, *function.params.kwonly_params)
    return root != "self" and any(param.name.value == root for param in params)


def _broadcasts_somewhere(ctx: LintContext) -> bool:
    """Whether any call in the file (on a traced path or not) could align the weights."""
    for node in ctx.nodes(cst.Call):
        qual = ctx.qualname(node.func) or ""
        text = qual or dotted(node.func) or ""
        last = text.rsplit(".", 1)[-1]
        if qual.startswith("horovod.") and last in _ALIGNING_APIS:
            return True
        if not qual.startswith("horovod.") and last.endswith("broadcast_parameters"):
            return True
    return False
