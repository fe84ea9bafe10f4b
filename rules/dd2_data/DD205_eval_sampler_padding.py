"""DD205 eval-sampler-padding: evaluation over a padding DistributedSampler (default off)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.loaders import loader_loops, says_eval
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule

LOADER = "torch.utils.data.DataLoader"
# An upper slice bound like these truncates gathered results back to the dataset's length.
TRUNCATION = re.compile(r"len\(|num_samples|dataset_size|n_samples|total_samples|num_examples", re.IGNORECASE)
# Results stored by sample index (DINO's k-NN features) are immune to duplicates.
BY_INDEX = ("index_copy", "index_put", "scatter_", "drop_duplicates", "UnpaddedDistributedSampler", "DistributedEvalSampler")


class EvalSamplerPadding(Rule):
    """
    ## What it does
    Flags a `DistributedSampler` without `drop_last=True` that feeds an evaluation loader — one
    that is iterated but never by a loop calling `backward()`, or whose name (loader, sampler)
    says `val`/`eval`/`test` — in a script that never truncates gathered results to the dataset's
    length (a slice such as `preds[: len(dataset)]`) nor stores results by sample index
    (`index_copy_`, `scatter_`). Off by default: select `DD205`.

    ## Why is this bad?
    To give every rank the same number of samples, `DistributedSampler` (with the default
    `drop_last=False`) pads its index list by repeating the first `N - len(dataset) % N`
    indices. In training that is harmless; in evaluation those samples are counted twice, so an
    accuracy or loss averaged over all ranks is computed on a slightly different set than the
    dataset: off by a little, and different for every world size. torchvision's reference
    scripts warn about exactly this.

    ## Example
    ```python
    val_sampler = DistributedSampler(val_set, shuffle=False)
    val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)
    correct = sum((model(x).argmax(1) == y).sum() for x, y in val_loader)
    dist.all_reduce(correct)
    accuracy = correct / len(val_set)
    ```

    ## Use instead
    ```python
    # gather per-sample results and cut the padding off
    preds = torch.cat(gathered)[: len(val_set)]
    ```
    or evaluate on one rank, or use a sampler that does not pad (for example a
    `SequentialSampler` over `range(rank, len(val_set), world_size)`).

    ## Fix safety
    No fix is offered: `drop_last=True` would drop samples instead of duplicating them, which
    biases the metric the other way.
    """

    code = "DD205"
    name = "eval-sampler-padding"
    severity = "info"
    default_on = False
    summary = "evaluation over a padding DistributedSampler counts some samples twice"
    requires = (frameworks.SAMPLER_WORDS,)

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            val_sampler = DistributedSampler(val_set, shuffle=False)  # expect: DD205
            val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)
            correct = torch.zeros(1, device="cuda")
            with torch.no_grad():
                for x, y in val_loader:
                    correct += (model(x).argmax(1) == y).sum()
            dist.all_reduce(correct)
            """
        ),
        Example(
            """
            import torch
            from torch.utils.data.distributed import DistributedSampler

            def build_loaders(train_set, test_set):
                train = torch.utils.data.DataLoader(train_set, sampler=DistributedSampler(train_set))
                test = torch.utils.data.DataLoader(test_set, sampler=DistributedSampler(test_set, shuffle=False))  # expect: DD205
                return train, test

            @torch.no_grad()
            def evaluate(model, loader):
                return sum(model(x).eq(y).sum().item() for x, y in loader)

            def main():
                train_loader, test_loader = build_loaders(a, b)
                for x, y in train_loader:
                    model(x).sum().backward()
                for x, y in test_loader:
                    model(x)
            """
        ),
        Example(
            """
            import torch.utils.data as tud

            sampler_val = tud.distributed.DistributedSampler(dataset_val, num_replicas=world, rank=rank, shuffle=False)  # expect: DD205
            data_loader_val = tud.DataLoader(dataset_val, sampler=sampler_val, batch_size=64, drop_last=False)
            test_stats = evaluate(data_loader_val, model, device)
            """
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.utils.data import DataLoader, DistributedSampler

            val_sampler = DistributedSampler(val_set, shuffle=False)
            val_loader = DataLoader(val_set, batch_size=256, sampler=val_sampler)
            preds = []
            with torch.no_grad():
                for x, _ in val_loader:
                    preds.append(model(x).argmax(1))
            gathered = [torch.empty_like(torch.cat(preds)) for _ in range(dist.get_world_size())]
            dist.all_gather(gathered, torch.cat(preds))
            preds = torch.stack(gathered, dim=1).flatten()[: len(val_set)]
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            sampler = DistributedSampler(train_set)
            loader = DataLoader(train_set, sampler=sampler)
            for epoch in range(3):
                sampler.set_epoch(epoch)
                for x, y in loader:
                    model(x).sum().backward()
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            val_sampler = DistributedSampler(val_set, shuffle=False, drop_last=True)
            val_loader = DataLoader(val_set, batch_size=64, sampler=val_sampler)
            for x, y in val_loader:
                model(x)
            """
        ),
        Example(
            """
            from torch.utils.data import DataLoader, DistributedSampler

            val_loader = DataLoader(val_set, batch_size=64, shuffle=False)
            for x, y in val_loader:
                model(x)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if _truncates(ctx) or any(word in ctx.source for word in BY_INDEX):
            return
        trained: set[int] = set()
        iterated: dict[int, Value] = {}
        for loop in loader_loops(ctx):
            if not isinstance(loop.loader.node, cst.Call):
                continue
            if loop.trains:
                trained.add(id(loop.loader.node))
            else:
                iterated[id(loop.loader.node)] = loop.loader
        # Loaders named for evaluation count even when the loop is elsewhere (`evaluate(loader)`).
        for trace, step, call in ctx.calls(LOADER):
            if id(call) in iterated:
                continue
            value = trace.value(call, step)
            names = [_target_name(step.node, call), value.inner.name if value is not None and value.inner is not None else ""]
            if value is not None and any(says_eval(name) for name in names if name):
                iterated[id(call)] = value
        reported: set[int] = set()
        for key, loader in iterated.items():
            if key in trained:
                continue
            sampler = loader.inner
            if sampler is None or sampler.kind != kinds.SAMPLER or not isinstance(sampler.node, cst.Call):
                continue
            if id(sampler.node) in reported or not _pads(sampler.node):
                continue
            reported.add(id(sampler.node))
            yield Report(
                sampler.node,
                "this DistributedSampler feeds evaluation and pads (drop_last=False): the last "
                "len(dataset) % world_size shortfall is filled with repeated samples, so metrics "
                "over all ranks count them twice. Gather per-sample results and truncate to "
                "len(dataset), or evaluate without a padding sampler.",
            )


def _pads(sampler_call: cst.Call) -> bool:
    drop_last = syntax.argument(sampler_call, 5, "drop_last")
    return drop_last is None or (isinstance(drop_last, cst.Name) and drop_last.value == "False")


def _target_name(statement: cst.CSTNode, call: cst.Call) -> str:
    if isinstance(statement, cst.Assign) and statement.value is call and len(statement.targets) == 1:
        return dotted(statement.targets[0].target) or ""
    return ""


def _truncates(ctx: LintContext) -> bool:
    """Whether the module slices something down to a length (`[: len(dataset)]`)."""
    return any(
        node.upper is not None and TRUNCATION.search(ctx.code(node.upper)) for node in ctx.nodes(cst.Slice)
    )
