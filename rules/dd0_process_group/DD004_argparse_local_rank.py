"""DD004 argparse-local-rank: the device comes from a `--local_rank` flag torchrun never passes."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, names, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.devices import device_indices
from distdoctor.lint.rule import Example, Report, Rule

FLAGS = ("--local_rank", "--local-rank")
ENV_NAME = "LOCAL_RANK"
SPAWNERS = (
    "torch.multiprocessing.spawn",
    "torch.multiprocessing.start_processes",
    "torch.multiprocessing.Process",
    "multiprocessing.Process",
)
# Launchers that still pass `--local_rank` to the script.


class ArgparseLocalRank(Rule):
    """
    ## What it does
    Flags a `--local_rank` (or `--local-rank`) command-line argument whose value selects the
    CUDA device (`torch.cuda.set_device(args.local_rank)`, `.to(args.local_rank)`,
    `device_ids=[args.local_rank]`, ...) in a script that never reads the `LOCAL_RANK`
    environment variable. The finding points at the `add_argument` line.

    Silent when the script reads `LOCAL_RANK` anywhere (for instance as the argument's default,
    or `if "LOCAL_RANK" in os.environ: ...`), when the flag is never used for a device, in
    DeepSpeed scripts (the `deepspeed` launcher still passes `--local_rank`), and in projects
    that target PyTorch 1.x: `target-torch = "1.13"` in `[tool.distdoctor]`, or a 1.x pin in the
    project's own files (`torch==1.9.0` in requirements.txt, `pytorch=1.7.0` in environment.yml,
    "PyTorch 1.8.1" in the README beside them; a floor such as `torch>=1.6` admits 2.x and does
    not count). There `python -m torch.distributed.launch` passes `--local_rank=N` to every
    rank, so the flag is right until the project moves to PyTorch 2.

    ## Why is this bad?
    `python -m torch.distributed.launch` passes the local rank as a flag: `--local_rank=N` up
    to PyTorch 1.13, `--local-rank=N` since 2.0 (which a parser that declares only
    `--local_rank` rejects), and none with `--use-env`. `torchrun`, which replaces it, passes
    no flag at all: it sets the `LOCAL_RANK` environment variable. Under torchrun the flag
    keeps its default on every rank, so all processes select the same GPU (or none): they
    pile onto GPU 0, run out of memory, or NCCL hangs on duplicate devices.

    ## Example
    ```python
    parser.add_argument("--local_rank", type=int, default=0)
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    ```

    ## Use instead
    ```python
    parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    args = parser.parse_args()
    torch.cuda.set_device(args.local_rank)
    ```

    ## Fix safety
    No fix is offered: the default may be used elsewhere (`-1` often means "not distributed"),
    so the right default expression is the author's choice.
    """

    code = "DD004"
    name = "argparse-local-rank"
    severity = "warning"
    summary = "--local_rank argument selects the device but LOCAL_RANK is never read"
    requires = (frozenset({"add_argument"}), frozenset({"local_rank", "local"}))  # "--local_rank" or "--local-rank"

    invalid = (
        Example(
            # The parsed flags turned into a dict are still the flags.
            """
            import argparse
            import torch
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)  # expect: DD004
            parser.add_argument("--distributed", action="store_true")
            args = vars(parser.parse_args())
            if args["distributed"]:
                torch.cuda.set_device(args["local_rank"])
                dist.init_process_group("nccl", init_method="env://")
            """
        ),
        Example(
            # Copying the flag into a config object is no reading of LOCAL_RANK.
            """
            import argparse
            import torch

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)  # expect: DD004
            args = parser.parse_args()
            cfg.local_rank = args.local_rank
            torch.cuda.set_device(args.local_rank)
            """
        ),
        Example(
            # The flag's value goes through a starred reassignment before it picks the device.
            """
            import argparse
            import torch
            import torch.distributed as dist
            import helpers

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)  # expect: DD004
            opt = parser.parse_args()
            opt.global_rank, opt.local_rank = helpers.global_rank(), *[opt.local_rank]
            if opt.local_rank != -1:
                torch.cuda.set_device(opt.local_rank)
                dist.init_process_group("nccl")
            """
        ),
        Example(
            """
            import argparse
            import torch
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)  # expect: DD004
            args = parser.parse_args()
            torch.cuda.set_device(args.local_rank)
            dist.init_process_group("nccl")
            """
        ),
        Example(
            """
            import argparse
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def get_args():
                p = argparse.ArgumentParser()
                p.add_argument("--local-rank", type=int, default=-1)  # expect: DD004
                return p.parse_args()

            def main():
                opt = get_args()
                device = torch.device("cuda", opt.local_rank)
                model = DDP(Net().to(device), device_ids=[opt.local_rank])
            """
        ),
        Example(
            """
            import argparse
            import torch
            import torch.distributed as dist

            class Trainer:
                def __init__(self, args):
                    self.local_rank = args.local_rank
                    dist.init_process_group(backend="nccl", init_method="env://")
                    self.model = build().cuda(self.local_rank)

            if __name__ == "__main__":
                parser = argparse.ArgumentParser()
                parser.add_argument('--local_rank', default=0, type=int,  # expect: DD004
                                    help='node rank for distributed training')
                Trainer(parser.parse_args())
            """
        ),
    )
    valid = (
        Example(
            # The device comes from a module's attribute (`idr_torch.local_rank`, read from Slurm),
            # not from the unused flag.
            """
            import argparse

            import idr_torch
            import torch
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=None)
            args = parser.parse_args()
            dist.init_process_group("nccl", rank=idr_torch.rank, world_size=idr_torch.size)
            torch.cuda.set_device(idr_torch.local_rank)
            model = torch.nn.parallel.DistributedDataParallel(Net().cuda(), device_ids=[idr_torch.local_rank])
            """
        ),
        Example(
            # The flag is overwritten with a field of what the project's init helper returned.
            """
            import argparse
            import torch
            from project import parallel

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)
            args = parser.parse_args()
            env = parallel.init_data_parallel(backend="nccl")
            args.local_rank = env.local_device.index
            model = torch.nn.parallel.DistributedDataParallel(Net().cuda(), device_ids=[args.local_rank])
            """
        ),
        Example(
            # The script starts its processes itself and sets the attribute per process.
            """
            import argparse
            import torch
            from torch.multiprocessing import Process

            def run(cfg):
                torch.cuda.set_device(cfg.local_rank)

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)
            parser.add_argument("--procs", type=int, default=1)
            cfg = parser.parse_args()
            jobs = []
            for i in range(cfg.procs):
                cfg.local_rank = i
                jobs.append(Process(target=run, args=(cfg,)))
                jobs[-1].start()
            """
        ),
        Example(
            """
            import argparse
            import os
            import torch

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
            args = parser.parse_args()
            torch.cuda.set_device(args.local_rank)
            """
        ),
        Example(
            """
            import argparse
            import os
            import torch

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)
            args = parser.parse_args()
            if "LOCAL_RANK" in os.environ:
                args.local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(args.local_rank)
            """
        ),
        Example(
            """
            import argparse
            import os
            import torch
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, help="ignored: torch.distributed.launch passes it")
            args = parser.parse_args()
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            """
        ),
        Example(
            """
            import argparse
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=0)
            args = parser.parse_args()
            dist.init_process_group("gloo")
            if args.local_rank == 0:
                print("node leader")
            """
        ),
        Example(
            """
            import argparse
            import deepspeed
            import torch

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher passes it
            parser = deepspeed.add_config_arguments(parser)
            args = parser.parse_args()
            torch.cuda.set_device(args.local_rank)
            deepspeed.init_distributed()
            """
        ),
        Example(
            """
            import argparse
            import torch
            import torch.distributed as dist
            from myproject.envs import read_launcher_env

            parser = argparse.ArgumentParser()
            parser.add_argument("--local_rank", type=int, default=-1)
            args = parser.parse_args()
            # The helper (another module) reads LOCAL_RANK, RANK and WORLD_SIZE: the flag is overwritten.
            args.local_rank, args.rank, args.world_size = read_launcher_env()
            torch.cuda.set_device(args.local_rank)
            dist.init_process_group("nccl")
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if ctx.imports.imports_any(frameworks.PASSES_LOCAL_RANK_FLAG):
            return
        flags = _local_rank_flags(ctx)
        if not flags or _reads_local_rank_env(ctx) or _own_launcher(ctx) or _flag_overwritten(ctx):
            return
        torch = ctx.project.torch
        if torch is not None and torch.before_2 and any(_declares(flag, "--local_rank") for flag in flags):
            return  # the project runs torch 1.x, whose torch.distributed.launch passes --local_rank=N
        use = next((u for u in device_indices(ctx) if _from_flag(ctx, u.trace.value(u.index, u.step))), None)
        if use is None:
            return
        line = ctx.position(use.site).start.line
        for flag in flags:
            yield Report(
                flag,
                f"`--local_rank` selects the CUDA device (line {line}), but torchrun does not pass this "
                "flag: it sets the LOCAL_RANK environment variable, so every rank keeps the default. "
                'Read it: default=int(os.environ.get("LOCAL_RANK", 0)).',
            )


def _declares(flag: cst.Call, name: str) -> bool:
    return any(
        arg.keyword is None and isinstance(arg.value, cst.SimpleString) and arg.value.evaluated_value == name
        for arg in flag.args
    )


def _local_rank_flags(ctx: LintContext) -> list[cst.Call]:
    found: list[cst.Call] = []
    for node in ctx.nodes(cst.Call):
        func = node.func
        if not (isinstance(func, cst.Attribute) and func.attr.value == "add_argument"):
            continue
        if any(
            arg.keyword is None and isinstance(arg.value, cst.SimpleString) and arg.value.evaluated_value in FLAGS
            for arg in node.args
        ):
            found.append(node)
    return found


def _reads_local_rank_env(ctx: LintContext) -> bool:
    """Any mention of "LOCAL_RANK" that is not `os.environ["LOCAL_RANK"] = ...` (a write)."""
    written: set[int] = set()
    for node in ctx.nodes(cst.Assign):
        for target in node.targets:
            if isinstance(target.target, cst.Subscript):
                for element in target.target.slice:
                    if isinstance(element.slice, cst.Index):
                        written.add(id(element.slice.value))
    for node in ctx.nodes(cst.SimpleString):
        if node.evaluated_value == ENV_NAME and id(node) not in written:
            return True
    return any(ENV_NAME in node.value for node in ctx.nodes(cst.FormattedStringText))


def _flag_overwritten(ctx: LintContext) -> bool:
    """The script overwrites the parsed flag with what a helper of another module returns
    (`args.local_rank, args.rank, args.world_size = get_envs()`): such helpers read LOCAL_RANK
    where this file cannot see it, so the flag's default is not what selects the device."""
    helper_results = {
        name
        for node in ctx.nodes(cst.Assign)
        if _external_helper_call(ctx, node.value)
        for target in node.targets
        if (name := names.dotted(target.target)) is not None
    }
    for node in ctx.nodes(cst.Assign):
        value = node.value
        if not _external_helper_call(ctx, value):
            # Or a field of such a result (`env = init_parallel()` ... `args.local_rank =
            # env.local_device.index`).
            text = names.dotted(value) if isinstance(value, cst.Attribute) else None
            if text is None or "local_rank" in text or text.split(".", 1)[0] not in helper_results:
                continue
        for target in syntax.assigned_targets(node):
            if isinstance(target, cst.Attribute) and target.attr.value == "local_rank":
                if names.dotted(target.value) not in (None, "self"):
                    return True
    return False


def _external_helper_call(ctx: LintContext, value: cst.BaseExpression) -> bool:
    """A call to a function of another module that is not a known library's."""
    if not isinstance(value, cst.Call):
        return False
    callee = names.dotted(value.func)
    qualified = ctx.qualname(value.func) or ""
    if callee is None or callee.rsplit(".", 1)[-1] in ("parse_args", "parse_known_args"):
        return False  # the parsed flags themselves
    return callee not in ctx.info.functions and qualified.split(".", 1)[0] not in KNOWN_LIBRARIES


# Callees whose result is known not to be a helper's reading of LOCAL_RANK.
KNOWN_LIBRARIES = frozenset({"torch", "horovod", "os", "argparse", "int", "builtins"})


def _own_launcher(ctx: LintContext) -> bool:
    """The script starts its worker processes itself (`Process(target=...)`, `mp.spawn`) and
    sets `args.local_rank` itself (`args.local_rank = i` in the loop that starts them): the
    flag is a fallback for a single process, not what torchrun would have to pass."""
    starts = any(
        (ctx.qualname(node.func) or "") in SPAWNERS or (ctx.qualname(node.func) or "").endswith(".multiprocessing.spawn")
        for node in ctx.nodes(cst.Call)
    )
    if not starts:
        return False
    for node in ctx.nodes(cst.Assign):
        for target in node.targets:
            if isinstance(target.target, cst.Attribute) and target.target.attr.value in ("local_rank", "local-rank"):
                return True
    return False


def _from_flag(ctx: LintContext, value: kinds.Value | None) -> bool:
    """A value read from the parsed `--local_rank` argument (`args.local_rank`, or a name or
    attribute it was copied to), not an attribute of an imported module (`idr_torch.local_rank`,
    which reads Slurm's environment)."""
    return (
        value is not None
        and value.kind == kinds.LOCAL_RANK
        and value.origin == "attr"
        and value.name.rsplit(".", 1)[-1] == "local_rank"
        and not value.name.startswith("self.")
        and not (isinstance(value.node, cst.Attribute) and ctx.qualname(value.node) is not None)
    )
