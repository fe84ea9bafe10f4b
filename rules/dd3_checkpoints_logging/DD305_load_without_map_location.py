"""DD305 load-without-map-location: torch.load restores tensors onto the device they were saved from."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.finding import Edit, Fix
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

LOAD = "torch.load"
SAVE = "torch.save"
# Tensor methods that keep a CPU tensor on the CPU.
CPU_KEEPING = frozenset({"detach", "clone", "contiguous", "float", "half", "double", "long", "int", "bfloat16"})
GPU_WORDS = re.compile(r"\bcuda\b|\.cuda\(|nccl|device_ids|set_device")


class LoadWithoutMapLocation(Rule):
    """
    ## What it does
    Flags `torch.load(...)` without `map_location` (keyword, or the second positional argument)
    in a distributed script that trains on GPUs.

    It stays silent where no rank can pile onto another's GPU:
    - the load runs under a rank-0 (or local-rank-0) condition only, here or at the call site of
      the helper that loads ("restore on the first worker, then broadcast", as in Horovod's
      ImageNet example): one process reads the file onto the GPU it owns;
    - the other branch of the same `if` loads with `map_location` (`if args.gpu is None:
      torch.load(f)` / `else: torch.load(f, map_location=f"cuda:{args.gpu}")`): the script maps
      where it runs one process per GPU, and the unmapped branch is its one-process-per-node or
      single-process path, where restoring onto the saved devices is intended;
    - the file is one the script itself writes from the CPU (`torch.save(feats.cpu(),
      os.path.join(d, "feats.pth"))`, matched by the file name): CPU tensors load onto the CPU.

    ## Why is this bad?
    Without `map_location`, `torch.load` puts every tensor back on the device it was saved from,
    usually `cuda:0` (the rank that wrote the checkpoint). Every rank of the job then allocates a
    full copy of the checkpoint on GPU 0: the first GPU runs out of memory or is slowed down by
    N-1 foreign contexts, and the process on it can be killed.

    ## Example
    ```python
    checkpoint = torch.load(args.resume)
    model.load_state_dict(checkpoint["model"])
    ```

    ## Use instead
    ```python
    checkpoint = torch.load(args.resume, map_location="cpu")
    model.load_state_dict(checkpoint["model"])
    ```

    ## Why it is off by default
    Whether a `torch.load` puts tensors on GPU 0 depends on what the file holds, which the source
    does not say: on real training code most loads without `map_location` read CPU tensors (cached
    features, preprocessed datasets, checkpoints the repository saves from `.cpu()` copies, pickled
    scheduler or argument objects, buffers inside `broadcast_object` helpers), and load nothing
    onto a GPU. Measured on the real-world corpus, about two in five of its findings were true (the
    figure is printed above). Select it (`--extend-select DD305`) where checkpoints are saved
    straight from CUDA tensors.

    ## Fix safety
    Safe for the usual use, which the fix assumes: the loaded tensors are copied into a model or
    optimizer with `load_state_dict`. `map_location="cpu"` is the choice that is right on every
    rank whatever the script calls its device variable: `Module.load_state_dict` copies into the
    parameters on their own device, and `Optimizer.load_state_dict` casts its state to the device
    of the parameters, so nothing else changes but the transient host copy. A device-specific
    `map_location=f"cuda:{local_rank}"` also works, but needs a name the fixer cannot know. If the
    script uses the loaded tensors directly in GPU computations, move them with `.to(device)`
    after the fix.
    """

    code = "DD305"
    name = "load-without-map-location"
    severity = "warning"
    default_on = False
    summary = "torch.load without map_location in a distributed GPU script: every rank loads onto GPU 0"
    requires = (frameworks.DISTRIBUTED_WORDS, frozenset({"load"}))  # GPU_WORDS may be in a comment

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume)  # expect: DD305
            model.load_state_dict(checkpoint["model"])
            """,
            fixed="""
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume, map_location="cpu")  # expect: DD305
            model.load_state_dict(checkpoint["model"])
            """,
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def resume(model, optimizer, path):
                state = torch.load(path, weights_only=True)  # expect: DD305
                model.module.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])

            def main(local_rank):
                model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
                resume(model, optimizer, "last.pt")
            """,
            fixed="""
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def resume(model, optimizer, path):
                state = torch.load(path, weights_only=True, map_location="cpu")  # expect: DD305
                model.module.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])

            def main(local_rank):
                model = DDP(Net().cuda(local_rank), device_ids=[local_rank])
                resume(model, optimizer, "last.pt")
            """,
        ),
        Example(
            """
            import horovod.torch as hvd
            from torch import load as torch_load

            hvd.init()
            torch.cuda.set_device(hvd.local_rank())
            model = Net().cuda()
            model.load_state_dict(torch_load(  # expect: DD305
                "pretrained.pt",
            ))
            """,
            fixed="""
            import horovod.torch as hvd
            from torch import load as torch_load

            hvd.init()
            torch.cuda.set_device(hvd.local_rank())
            model = Net().cuda()
            model.load_state_dict(torch_load(  # expect: DD305
                "pretrained.pt", map_location="cpu",
            ))
            """,
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            if dist.get_rank() != 0:
                teacher = torch.load("teacher.pt")  # expect: DD305
            if use_ema:
                ema = torch.load("ema.pt")  # expect: DD305
            else:
                ema = torch.load("init.pt")  # expect: DD305
            feats = torch.load(os.path.join(cache, "feats.pt"))  # expect: DD305
            torch.save(feats, os.path.join(cache, "feats.pt"))  # saved from the GPU: no help
            """,
            fixed="""
            import os
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            local_rank = int(os.environ["LOCAL_RANK"])
            torch.cuda.set_device(local_rank)
            if dist.get_rank() != 0:
                teacher = torch.load("teacher.pt", map_location="cpu")  # expect: DD305
            if use_ema:
                ema = torch.load("ema.pt", map_location="cpu")  # expect: DD305
            else:
                ema = torch.load("init.pt", map_location="cpu")  # expect: DD305
            feats = torch.load(os.path.join(cache, "feats.pt"), map_location="cpu")  # expect: DD305
            torch.save(feats, os.path.join(cache, "feats.pt"))  # saved from the GPU: no help
            """,
        ),
    )
    valid = (
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            checkpoint = torch.load(args.resume, map_location="cpu")
            loc = f"cuda:{local_rank}"
            other = torch.load(args.pretrained, loc)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")  # CPU-only training
            state = torch.load("ckpt.pt")
            """
        ),
        Example(
            """
            import torch

            model = Net().cuda()  # single process: nothing to share GPU 0 with
            model.load_state_dict(torch.load("model.pt"))
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl")
            state = torch.load(path, **load_kwargs)  # map_location may be in there
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            def restore(net, opt, path):
                blob = torch.load(path)  # only the first worker reads the file
                net.load_state_dict(blob["net"])
                opt.load_state_dict(blob["opt"])

            hvd.init()
            torch.cuda.set_device(hvd.local_rank())
            net = Net().cuda()
            opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1 * hvd.size()))
            if start_epoch > 0 and hvd.rank() == 0:
                restore(net, opt, f"ckpt-{start_epoch}.pt")
            hvd.broadcast_parameters(net.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            def worker(device_index, cfg):
                dist.init_process_group("nccl", rank=cfg.rank, world_size=cfg.world_size)
                if cfg.resume:
                    if device_index is None:  # one process drives every GPU of the node
                        snap = torch.load(cfg.resume)
                    else:
                        snap = torch.load(cfg.resume, map_location=f"cuda:{device_index}")
                    model.load_state_dict(snap["model"])
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist

            def embed_all(encoder, loader, out_dir):
                feats = torch.cat([encoder(x.cuda()) for x, _ in loader])
                if dist.get_rank() == 0:
                    torch.save(feats.detach().cpu(), os.path.join(out_dir, "embeddings.pt"))
                return feats

            dist.init_process_group("nccl")
            if cache_dir:
                feats = torch.load(os.path.join(cache_dir, "embeddings.pt"))  # written from the CPU above
            else:
                feats = embed_all(encoder, loader, out_dir)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed or not GPU_WORDS.search(ctx.source):
            return
        cpu_files: set[str] | None = None
        reported: set[int] = set()
        for trace, step, call in ctx.calls(LOAD):
            if id(call) in reported or syntax.argument(call, 1, "map_location") is not None:
                continue
            if not call.args or any(arg.star for arg in call.args):
                continue
            if _rank_zero_only(ctx, trace, step) or _other_branch_maps(ctx, step):
                continue
            if cpu_files is None:
                cpu_files = _files_saved_on_cpu(ctx)
            name = _file_name(syntax.argument(call, 0, "f"))
            if name is not None and name in cpu_files:
                continue
            reported.add(id(call))
            last = call.args[-1]
            end = ctx.position(last.value).end
            fix = Fix(
                message='add map_location="cpu"',
                edits=(Edit(end.line, end.column + 1, end.line, end.column + 1, ', map_location="cpu"'),),
            )
            yield Report(
                call,
                "torch.load without map_location restores tensors onto the GPU they were saved from (usually "
                "cuda:0) on every rank: pass `map_location=\"cpu\"` (or this rank's device).",
                fix=fix,
            )


def _rank_zero_only(ctx: LintContext, trace: Trace, step: Step) -> bool:
    """The load runs on (local) rank 0 only: one process reads the file, onto the GPU it owns
    (restore on rank 0, then broadcast), so nothing piles onto another rank's GPU."""
    guards = ctx.rank_guards(trace, step, uncertain=True)
    return bool(guards) and all(guard.zero for guard in guards)


def _other_branch_maps(ctx: LintContext, step: Step) -> bool:
    """`if args.gpu is None: ckpt = torch.load(f)` / `else: ckpt = torch.load(f, map_location=loc)`:
    the script maps where it runs one process per GPU; the unmapped branch is its
    one-process-per-node (or single-process) path, where restoring to the saved devices is meant.
    The `if` is the one whose branch holds the loading statement."""
    if step.block is None:
        return False
    owner = step.block[0]
    other: cst.CSTNode | None = None
    if isinstance(owner, cst.If):
        other = owner.orelse
    elif isinstance(owner, cst.Else):
        other = next((node.body for node in ctx.nodes(cst.If) if node.orelse is owner), None)
    if other is None:
        return False
    return any(_maps(ctx, node) for node in syntax.walk(other) if isinstance(node, cst.Call))


def _maps(ctx: LintContext, call: cst.Call) -> bool:
    return ctx.qualname(call.func) == LOAD and syntax.argument(call, 1, "map_location") is not None


def _files_saved_on_cpu(ctx: LintContext) -> set[str]:
    """File names this script writes with `torch.save(x.cpu(), ...)`: tensors saved from the CPU
    load back onto the CPU, whatever map_location says (DINO's k-NN feature dumps)."""
    names: set[str] = set()
    for call in ctx.nodes(cst.Call):
        if ctx.qualname(call.func) != SAVE:
            continue
        obj = syntax.argument(call, 0, "obj")
        name = _file_name(syntax.argument(call, 1, "f"))
        if obj is not None and name is not None and _on_cpu(obj):
            names.add(name)
    return names


def _on_cpu(expr: cst.BaseExpression) -> bool:
    """`x.cpu()`, `x.detach().cpu()`, `x.cpu().clone()`: a tensor moved to the CPU last."""
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute):
        method = expr.func.attr.value
        if method == "cpu":
            return True
        if method not in CPU_KEEPING:
            return False
        expr = expr.func.value
    return False


def _file_name(path: cst.BaseExpression | None) -> str | None:
    """The file name a path expression ends with, when written literally: `"feats.pth"`,
    `os.path.join(d, "feats.pth")`, `f"{d}/feats.pth"`. None when it is not known."""
    if path is None:
        return None
    last: str | None = None
    for node in syntax.walk(path):
        if isinstance(node, cst.SimpleString):
            value = node.evaluated_value
            last = value if isinstance(value, str) else None
        elif isinstance(node, cst.FormattedStringText):
            last = node.value
    if not last:
        return None
    name = last.replace("\\", "/").rsplit("/", 1)[-1]
    return name if "." in name.strip(".") else None
