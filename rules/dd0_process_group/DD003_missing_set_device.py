"""DD003 missing-set-device: GPU training that never gives each process its own device."""

from __future__ import annotations

import re
from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, syntax

from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.devices import (
    INIT_PROCESS_GROUP,
    current_device_uses,
    selects_device_explicitly,
)
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.analysis.scope import is_spawn
from distdoctor.lint.rule import Example, Report, Rule

HVD_INIT = "horovod.torch.init"
# Launch helpers of other modules (`utils.init_distributed_mode(args)`) usually pick the device.
SETUP_HELPER = re.compile(r"(init|setup|set_?up).*(dist|device|gpu|ddp|cuda|process|env|backend)|set_device", re.IGNORECASE)
# The device may be pinned from outside: one visible GPU per task.
# Where the device is pinned outside the script, or each process runs on its own machine
# (SageMaker's `current_host` among `hosts`).
OUTSIDE_PINNING = ("CUDA_VISIBLE_DEVICES", "SLURM", "current_host")


class MissingSetDevice(Rule):
    """
    ## What it does
    Flags a distributed GPU script (it calls `init_process_group` or `hvd.init()` itself) that
    never selects a device per process — no `torch.cuda.set_device(...)`, no
    `init_process_group(device_id=...)`, no `with torch.cuda.device(...)`, no explicit index
    such as `.to(local_rank)`, `.cuda(gpu)` or `f"cuda:{local_rank}"` — while it puts work on
    the *current* device: a bare `.cuda()`, `.to("cuda")`, `.to(torch.device("cuda"))`. The
    finding points at the first such call. `DDP(model.cuda(), device_ids=[local_rank])` does not
    select a device: the model is already on GPU 0, and DDP refuses it on every other rank.

    Only calls on the same code path as the initialisation (before or after it) count. Deliberately
    conservative: silent when the device may be chosen elsewhere — a launch helper
    from another module (`utils.init_distributed_mode(args)`, `setup_distributed()`), a framework
    (accelerate, Lightning, DeepSpeed), `CUDA_VISIBLE_DEVICES` or SLURM's per-task GPU binding, a
    project base class's method called through `super()`, or a helper that nothing in the file
    calls (a utils module's `distributed_init(opts)`, whose caller may select the device first) —
    and for current-device calls that run on rank 0 only. The process group must surely run NCCL
    (`backend="nccl"`, or no backend): a backend the user chooses (`backend=args.backend`, gloo
    by default) is the mark of examples run one process per pod or host (Kubeflow's PyTorchJob,
    SageMaker's `current_host`), where `"cuda"` is the process's only GPU. Silent too when each
    process is started by the project's own launcher with a rank from the command line or Slurm
    (`init_process_group(init_method=..., rank=args.rank, ...)`, no torchrun environment, no
    `mp.spawn` here, no Horovod): such launchers often give each process one visible GPU.

    ## Why is this bad?
    Every process starts with GPU 0 as its current device. Without `set_device`, all ranks of a
    node allocate on GPU 0: it runs out of memory, the other GPUs idle, and NCCL, which maps each
    rank to its current device, may hang or fail with duplicate GPU errors.

    ## Example
    ```python
    dist.init_process_group("nccl")
    model = Net().cuda()
    model = DDP(model)
    ```

    ## Use instead
    ```python
    dist.init_process_group("nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    model = Net().cuda()
    model = DDP(model, device_ids=[local_rank])
    ```
    (Horovod: `torch.cuda.set_device(hvd.local_rank())` after `hvd.init()`.)

    ## Fix safety
    No fix is offered: where the local rank comes from depends on the launcher.
    """

    code = "DD003"
    name = "missing-set-device"
    severity = "warning"
    summary = "GPU training never selects a device per process"
    requires = (frameworks.DISTRIBUTED_WORDS, frozenset({"init_process_group", "horovod"}))

    invalid = (
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            def main():
                dist.init_process_group(backend="nccl")
                model = Net().cuda()  # expect: DD003
                model = DDP(model)


            if __name__ == "__main__":
                main()
            """
        ),
        Example(
            """
            import torch
            import horovod.torch as hvd

            hvd.init()
            model = Net()
            model.cuda()  # expect: DD003
            optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel

            class Trainer:
                def __init__(self, model):
                    dist.init_process_group("nccl")
                    self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
                    self.model = DistributedDataParallel(model.to(self.device))  # expect: DD003


            trainer = Trainer(Net())
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            local_rank = int(os.environ["LOCAL_RANK"])
            dist.init_process_group("nccl", init_method="env://")
            model = Net().cuda()  # expect: DD003
            model = DDP(model, device_ids=[local_rank], output_device=local_rank)
            """
        ),
    )
    valid = (
        Example(
            # The process group and the device are set up by a helper of another package
            # (`initialize_backends(...)`), as its name says.
            """
            import torch
            import torch.distributed as dist
            from benchlib.pytorch import initialize_backends

            try:
                import horovod.torch as hvd
            except ImportError:
                hvd = None


            def measure(size, use_horovod):
                tensor = torch.rand(size).cuda()
                if use_horovod:
                    hvd.init()
                    return hvd.allreduce(tensor)
                dist.all_reduce(tensor)
                return tensor


            if __name__ == "__main__":
                with initialize_backends(comm_backend="nccl", use_cuda=True) as (rank, world_size):
                    measure(1 << 20, use_horovod=hvd is not None)
            """
        ),
        Example(
            # Each process is started by the project's own launcher with a command-line rank (no
            # torchrun, no spawn here): that launcher may give each one GPU of its own, which this file
            # cannot see.
            """
            import argparse

            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            # run_workers.sh starts one process per GPU, each seeing only its own: train.py --rank $i ...
            parser = argparse.ArgumentParser()
            parser.add_argument("--rank", type=int, required=True)
            parser.add_argument("--world-size", type=int, required=True)
            parser.add_argument("--master", default="10.0.0.1:29500")
            args = parser.parse_args()
            dist.init_process_group("nccl", init_method=f"tcp://{args.master}", rank=args.rank, world_size=args.world_size)
            model = DDP(torch.nn.Linear(16, 4).cuda())
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            for step in range(100):
                optimizer.zero_grad()
                model(torch.randn(8, 16).cuda()).sum().backward()
                optimizer.step()
            """
        ),
        Example(
            # A process group of one process, written as such (world_size=1, rank=0): its current
            # device is its own.
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl", init_method="tcp://127.0.0.1:9999", world_size=1, rank=0)
            model = torch.nn.parallel.DistributedDataParallel(Net().cuda())
            """
        ),
        Example(
            """
            import argparse
            import torch
            import torch.distributed as dist

            parser = argparse.ArgumentParser()
            parser.add_argument("--backend", choices=["gloo", "nccl", "mpi"], default="gloo")
            args = parser.parse_args()
            dist.init_process_group(backend=args.backend)  # one replica per pod, one GPU each
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = torch.nn.parallel.DistributedDataParallel(Net().to(device))
            """
        ),
        Example(
            """
            import os
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            dist.init_process_group(backend="nccl")
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
            model = DDP(Net().cuda())
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            import torch.multiprocessing as mp
            from torch.nn.parallel import DistributedDataParallel as DDP

            def worker(rank, world_size):
                dist.init_process_group("nccl", rank=rank, world_size=world_size)
                model = Net().to(rank)
                model = DDP(model, device_ids=[rank])

            mp.spawn(worker, args=(2,), nprocs=2)
            """
        ),
        Example(
            """
            import torch
            import utils
            import torch.distributed as dist

            def main(args):
                utils.init_distributed_mode(args)
                model = Net().cuda()
                model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.gpu])
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("gloo")
            model = Net()
            if dist.get_rank() == 0:
                model.cuda()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            dist.init_process_group("nccl", device_id=torch.device(f"cuda:{local_rank}"))
            model = Net().cuda()
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP
            from myproject.training import Trainer  # its _init_model selects this process's GPU


            class DDPTrainer(Trainer):
                def _init_model(self, model):
                    dist.init_process_group("nccl")
                    model = super()._init_model(model)
                    return DDP(model.cuda())
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist


            def distributed_init(opts):
                # A helper of a utils module: its caller (another file) selects the device first.
                dist.init_process_group("nccl", init_method=opts.dist_url, world_size=opts.world_size, rank=opts.rank)
                if torch.cuda.is_available():
                    dist.all_reduce(torch.zeros(1).cuda())
                return opts.rank
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.is_distributed or ctx.imports.imports_any(frameworks.SELECTS_DEVICE) or ctx.one_process_group:
            return  # (`init_process_group(..., world_size=1)`: one process, whose GPU 0 is its own)
        if not _initialises_here(ctx) or _external_setup(ctx) or any(word in ctx.source for word in OUTSIDE_PINNING):
            return
        if selects_device_explicitly(ctx) or _started_by_own_launcher(ctx):
            return
        started = _initialising_traces(ctx)
        uses = [
            (ctx.position(call).start.line, call)
            for trace, step, call, _ in current_device_uses(ctx)
            if id(trace) in started and not ctx.under_rank_zero(trace, step, uncertain=True)
        ]
        if not uses:
            return
        _, call = min(uses, key=lambda item: item[0])
        helper = "hvd.local_rank()" if any(True for _ in ctx.calls(HVD_INIT)) else 'int(os.environ["LOCAL_RANK"])'
        yield Report(
            call,
            f"`{_short(ctx.code(call))}` uses the current CUDA device, and no process ever selects its "
            f"own: every rank piles onto GPU 0. Call torch.cuda.set_device({helper}) right after "
            "initialising the process group (and pass device_ids to DDP).",
        )


# Environment variables that carry the rank torchrun (or torch.distributed.launch) gives each
# process; neither launcher sets CUDA_VISIBLE_DEVICES per process.
_TORCHRUN_RANKS = frozenset({"RANK", "LOCAL_RANK"})


def _started_by_own_launcher(ctx: LintContext) -> bool:
    """Whether each process is started by the project's own launcher, which may well give it one
    visible GPU (`CUDA_VISIBLE_DEVICES=$i python train.py --rank $i`): no Horovod, no workers
    started by this file, and every `init_process_group` handed a rank that neither torchrun's
    environment nor a spawn index provides (a command-line `--rank`, Slurm's SLURM_PROCID)."""
    if any(True for _ in ctx.calls(HVD_INIT)) or any(is_spawn(q) or q.endswith(".Process") for q in ctx.called_qualnames):
        return False
    calls = list(ctx.calls(INIT_PROCESS_GROUP))
    if not calls:
        return False
    for trace, step, call in calls:
        rank = syntax.argument(call, 4, "rank")
        if rank is None:
            return False  # env:// reads RANK from torchrun
        value = trace.value(rank, step)
        if value is None or not value.is_rank_like or (value.origin == "env" and value.name in _TORCHRUN_RANKS):
            return False
    return True


def _initialises_here(ctx: LintContext) -> bool:
    """Horovod, or a torch process group that surely runs NCCL: `backend="nccl"` or no backend
    (torch picks NCCL for CUDA). A backend the user chooses (`backend=args.backend`, gloo by
    default in the Kubeflow and SageMaker examples, one process per pod or host) cannot be decided."""
    if any(True for _ in ctx.calls(HVD_INIT)):
        return True
    for _, _, call in ctx.calls(INIT_PROCESS_GROUP):
        backend = syntax.argument(call, 0, "backend")
        if backend is None:
            return True
        known, value = syntax.const_value(backend)
        if known and isinstance(value, str) and "nccl" in value.lower():
            return True
    return False


def _initialising_traces(ctx: LintContext) -> set[int]:
    """id() of the traces that initialise the process group and are entry points of this file.
    Only current-device calls on such a code path count: a library module whose helpers initialise
    in one function and allocate in another says nothing about the script that calls them, and a
    helper nothing here calls (`def distributed_init(opts): ...` in a utils module) may be called
    after its caller selected the device."""
    return {id(trace) for trace, _, _ in ctx.calls(INIT_PROCESS_GROUP, HVD_INIT) if ctx.is_entry(trace)}


def _external_setup(ctx: LintContext) -> bool:
    """Whether a function from another module that sounds like distributed setup is called, or a
    method of a base class this file does not define (`super()._init_model(model)`): the device
    may well be selected there."""
    if _calls_super_of_unseen_base(ctx):
        return True
    for node in ctx.nodes(cst.Call):
        text = dotted(node.func)
        if text is None:
            continue
        last = text.rsplit(".", 1)[-1]
        if last in ctx.info.functions or last == "init_process_group":
            continue
        qual = ctx.qualname(node.func) or ""
        if qual.startswith(("torch.", "horovod.")) and last != "set_device":
            continue
        if isinstance(node.func, cst.Attribute) and dotted(node.func.value) == "self":
            continue
        if SETUP_HELPER.search(last):
            return True
    return False


def _calls_super_of_unseen_base(ctx: LintContext) -> bool:
    """`super().method(...)` inside a class with a base of the project that this file does not
    define (torch's own bases, such as `nn.Module`, select no device). Each class is searched
    without the classes nested in it, which are searched as their own: the innermost class counts."""
    if "super" not in ctx.index.callees:
        return False
    for cls in ctx.nodes(cst.ClassDef):
        if not _has_unseen_base(ctx, cls):
            continue
        for node in syntax.walk(cls, skip=(cst.ClassDef,)):
            if type(node) is not cst.Call:
                continue
            func = node.func
            if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Call) and dotted(func.value.func) == "super":
                return True
    return False


def _has_unseen_base(ctx: LintContext, cls: cst.ClassDef) -> bool:
    for base in cls.bases:
        text = dotted(base.value)
        qual = ctx.qualname(base.value) or ""
        if text in (None, "object") or qual.startswith(("torch.", "horovod.", "typing.", "abc.")):
            continue  # nn.Module and the like select no device
        if text.rsplit(".", 1)[-1] not in ctx.info.classes:
            return True
    return False


def _short(text: str) -> str:
    text = " ".join(text.split())
    return text if len(text) <= 60 else text[:57] + "..."
