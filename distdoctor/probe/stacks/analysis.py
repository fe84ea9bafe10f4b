"""What a rank is doing, read from its stack: one pure analysis for `distdoctor stacks` and for the
probe's own stall diagnosis (`probe/script/watch.py`), so both speak the same language.

A stack is a list of `Frame`s, innermost first (the order of py-spy and of faulthandler). From it:
- `classify()` says whether the rank waits in a collective (torch.distributed c10d calls, DDP's
  reducer in backward, FSDP all-gather / reduce-scatter, Horovod ops) and which one, or what else it
  does (loading data, writing a checkpoint, compiling, computing, idle), and from which line of the
  user's code (`user_frame()`: the first frame outside torch, site-packages, the standard library
  and distdoctor);
- `step_of()` reads the training step from a local of the user's frames, where the sampler read them;
- `rank_guard()` finds the `if rank == ...` that encloses the user's line;
- `diagnose()` groups ranks by identical stacks, the odd group first, and gives the verdict.
Nothing here reads a process: the inputs are plain data, so the verdicts are tested on recorded
stacks.
"""

from __future__ import annotations

import ast
import linecache
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache

# --- frames ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Frame:
    """One frame: function, file, line; `locals` as (name, repr) where the sampler read them."""

    func: str
    file: str
    line: int
    locals: tuple[tuple[str, str], ...] = ()
    native: bool = False  # a C/C++ frame (py-spy --native): file is the shared library

    @property
    def site(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def name(self) -> str:
        """The function's own name, without its class or `<locals>` prefix."""
        return self.func.rsplit(".", 1)[-1]

    def to_json(self) -> dict:
        out: dict = {"func": self.func, "file": self.file, "line": self.line}
        if self.native:
            out["native"] = True
        return out

    @classmethod
    def from_json(cls, data: dict) -> Frame:
        return cls(str(data["func"]), str(data["file"]), int(data["line"]), native=bool(data.get("native")))


def python_frames(frames: Iterable[Frame]) -> list[Frame]:
    return [f for f in frames if not f.native]


def signature(frames: Iterable[Frame]) -> tuple[tuple[str, int, str], ...]:
    """What two ranks must share to stand at the same place: every Python frame's file, line, name."""
    return tuple((f.file, f.line, f.func) for f in frames if not f.native)


_STDLIB = re.compile(r"[/\\]lib(?:64)?[/\\]python\d+(?:\.\d+)?[/\\](?!site-packages|dist-packages)")
_DISTDOCTOR = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep


def is_library(path: str) -> bool:
    """torch, site-packages, the standard library, frozen or generated code, distdoctor itself."""
    if not path or path.startswith("<") or path.startswith("/frozen"):
        return True
    norm = path.replace("\\", "/")
    if "/site-packages/" in norm or "/dist-packages/" in norm:
        return True
    return bool(_STDLIB.search(path)) or os.path.abspath(path).startswith(_DISTDOCTOR)


def user_frame(frames: Sequence[Frame], roots: Sequence[str] = ()) -> Frame | None:
    """The innermost frame of the user's own code: under one of `roots` when given (the probed
    script's folder), else the first one outside the libraries; None when every frame is library."""
    python = python_frames(frames)
    if roots:
        prefixes = tuple(os.path.abspath(r) + os.sep for r in roots)
        for frame in python:
            if frame.file.startswith(prefixes):
                return frame
    return next((f for f in python if not is_library(f.file)), None)


def user_frames(frames: Sequence[Frame]) -> list[Frame]:
    return [f for f in python_frames(frames) if not is_library(f.file)]


# --- what a stack is doing -----------------------------------------------------------------------

COLLECTIVE, GPU_WAIT, DATA, CHECKPOINT, COMPILE, BACKWARD, COMPUTE, IDLE, UNKNOWN = (
    "collective", "gpu-wait", "data", "checkpoint", "compile", "backward", "compute", "idle", "unknown")
# NCCL collectives return to Python once queued on the GPU: a rank whose peer never joins blocks
# later, where the CPU waits for the stream (`.item()`, `.cpu()`, a synchronize). Native frames show it.
_GPU_SYNC = re.compile(r"cudaStreamSynchronize|cudaDeviceSynchronize|cudaEventSynchronize|cuStreamSynchronize|"
                       r"cuEventSynchronize|cudaMemcpy(?!Async)|cuMemcpyDtoH(?!Async)|hipStreamSynchronize|"
                       r"hipDeviceSynchronize|_local_scalar_dense|c10::cuda::\w*[Ss]ynchroni[sz]e")

# Public torch.distributed calls that wait for the other ranks (distributed_c10d.py).
C10D_OPS = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "reduce_scatter", "reduce_scatter_tensor", "broadcast", "broadcast_object_list",
    "reduce", "gather", "gather_object", "scatter", "scatter_object_list", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "send_object_list", "recv_object_list",
    "batch_isend_irecv", "init_process_group", "new_group", "new_subgroups", "destroy_process_group",
    "_store_based_barrier", "_all_gather_base", "_reduce_scatter_base", "all_gather_single",
    "reduce_scatter_single", "split_group", "new_subgroups_by_enumeration", "shrink_group",
})
# torch.distributed._functional_collectives (also what compiled code calls).
FUNCTIONAL_OPS = frozenset({
    "all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single", "broadcast",
    "wait_tensor", "all_reduce_coalesced", "all_gather_into_tensor_coalesced", "permute_tensor",
})
# Horovod: horovod/torch/mpi_ops.py, optimizer.py, functions.py (and the TensorFlow / Keras twins).
HOROVOD_OPS = frozenset({
    "allreduce", "allreduce_", "grouped_allreduce", "allgather", "grouped_allgather", "broadcast", "broadcast_",
    "alltoall", "reducescatter", "grouped_reducescatter", "join", "barrier", "synchronize",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object",
    "broadcast_variables", "broadcast_global_variables",
})
# DDP's own waits, in torch/nn/parallel/distributed.py and torch/distributed/utils.py.
DDP_OPS = {
    "_sync_buffers": "broadcast (DDP buffer sync before forward)",
    "_sync_module_buffers": "broadcast (DDP buffer sync before forward)",
    "_default_broadcast_coalesced": "broadcast (DDP buffer sync)",
    "_sync_module_states": "broadcast (DDP construction: parameters from rank 0)",
    "_sync_params_and_buffers": "broadcast (DDP construction: parameters from rank 0)",
    "_verify_param_shape_across_processes": "all_gather (DDP construction: parameter shapes)",
    "_check_global_requires_backward_grad_sync": "all_reduce (DDP join)",
    "_rebuild_buckets": "broadcast (DDP bucket rebuild)",
}
_FSDP_GATHER = re.compile(r"all_gather|unshard|_pre_forward|pre_forward", re.I)
_FSDP_REDUCE = re.compile(r"reduce|post_backward|_finalize", re.I)
_RENDEZVOUS_FILES = ("torch/distributed/rendezvous.py", "torch/distributed/elastic/rendezvous/")


@dataclass(frozen=True)
class Activity:
    """What a stack is doing. `op` names the collective where `kind` is COLLECTIVE; `via` the layer
    that called it (DDP, FSDP, Horovod...); `user` the user's frame that led there; `inner` the
    innermost Python frame (where it blocks or runs)."""

    kind: str
    op: str | None = None
    via: str | None = None
    user: Frame | None = None
    inner: Frame | None = None

    @property
    def in_collective(self) -> bool:
        """Waiting on the other ranks: in a collective, or (NCCL) for the GPU stream that holds one."""
        return self.kind in (COLLECTIVE, GPU_WAIT)

    def describe(self) -> str:
        """'all_reduce' / 'all_reduce (DDP backward)' / 'loading data (DataLoader)' ..."""
        if self.kind == COLLECTIVE:
            return f"{self.op}" + (f" ({self.via})" if self.via else "")
        if self.kind == GPU_WAIT:
            return f"a wait for the GPU ({self.op}: with NCCL, a queued collective whose peer never came)"
        text = {
            DATA: "loading data", CHECKPOINT: "writing a checkpoint", COMPILE: "compiling (torch.compile)",
            BACKWARD: "waiting inside backward (without native frames, whether on DDP's all-reduce cannot be told)",
            COMPUTE: "computing", IDLE: "idle (asleep, or blocked on I/O, a lock or a native call)", UNKNOWN: "no Python stack",
        }[self.kind]
        if self.op:
            text += f" ({self.op})"
        return text


def _norm(path: str) -> str:
    return path.replace("\\", "/")


def _in(frame: Frame, *parts: str) -> bool:
    path = _norm(frame.file)
    return any(part in path for part in parts)


def classify(frames: Sequence[Frame], active: bool | None = None, roots: Sequence[str] = ()) -> Activity:
    """What this stack (innermost first) is doing; `active` is the sampler's word on whether the
    thread was running (True) or waiting in the kernel (False), where known."""
    python = python_frames(frames)
    if not python:
        return Activity(UNKNOWN)
    user = user_frame(frames, roots)
    inner = python[0]
    # Only the frames between the innermost one and the user's frame say what the user's call does.
    depth = python.index(user) if user is not None else len(python)
    library = python[:depth]
    outward = list(reversed(library))  # from the user's call inwards

    op, via = _collective(outward, library, frames)
    if op is not None:
        return Activity(COLLECTIVE, op, via, user, inner)
    for frame in outward:
        if _in(frame, "torch/utils/data/"):
            what = "waiting for a DataLoader worker" if "MultiProcessing" in "".join(f.func for f in library) else "DataLoader"
            return Activity(DATA, what, None, user, inner)
        if _in(frame, "torch/serialization.py", "safetensors/", "torch/distributed/checkpoint/"):
            writing = frame.name in ("save", "_save", "_legacy_save", "save_file", "save_state_dict", "async_save")
            if writing or not frame.name.startswith("load"):
                return Activity(CHECKPOINT, frame.name, None, user, inner)
            return Activity(DATA, f"reading a checkpoint ({frame.name})", None, user, inner)
        # torch._dynamo.disable wrappers (eval_frame.py) sit in every FSDP2 forward: not compiling.
        if _in(frame, "torch/_dynamo/", "torch/_inductor/") and not _in(frame, "torch/_dynamo/eval_frame.py"):
            return Activity(COMPILE, None, None, user, inner)
    gpu = next((f for f in frames if f.native and _GPU_SYNC.search(f.func)), None)
    if gpu is not None and active is not True:
        return Activity(GPU_WAIT, _GPU_SYNC.search(gpu.func).group(0), None, user, inner)
    if any(_in(f, "torch/autograd/") and f.name in ("_engine_run_backward", "backward", "grad") for f in library):
        if active is False:
            return Activity(BACKWARD, None, None, user, inner)
        return Activity(COMPUTE, "backward", None, user, inner)
    if active is False:
        return Activity(IDLE, None, None, user, inner)
    return Activity(COMPUTE, None, None, user, inner)


def _collective(outward: list[Frame], library: list[Frame], frames: Sequence[Frame]) -> tuple[str | None, str | None]:
    """(op, via) of the collective this library call waits in, or (None, None)."""
    via = None
    for frame in outward:
        if _in(frame, "torch/distributed/fsdp/", "torch/distributed/_composable/fsdp"):
            via = via or "FSDP"
        elif _in(frame, "torch/nn/parallel/distributed.py"):
            via = via or "DDP"
        elif _in(frame, "horovod/"):
            via = via or "Horovod"
        elif _in(frame, "deepspeed/"):
            via = via or "DeepSpeed"
        elif _in(frame, "torch/distributed/checkpoint/"):
            via = via or "distributed checkpoint"
    # The c10d call nearest the user is what the user (or DDP/FSDP on their behalf) asked for.
    for frame in outward:
        if _in(frame, "torch/distributed/distributed_c10d.py") and frame.name in C10D_OPS:
            return frame.name.lstrip("_"), _via_detail(via, library)
        if _in(frame, "torch/distributed/_functional_collectives.py") and frame.name in FUNCTIONAL_OPS:
            return frame.name, _via_detail(via or "functional collectives", library)
        if _in(frame, "horovod/") and frame.name in HOROVOD_OPS:
            return f"hvd.{frame.name}", "Horovod"
        if _in(frame, *_RENDEZVOUS_FILES):
            return "rendezvous", "init_process_group"
    for frame in outward:
        if _in(frame, "torch/nn/parallel/distributed.py", "torch/distributed/utils.py") and frame.name in DDP_OPS:
            return DDP_OPS[frame.name], None
        if _in(frame, "torch/distributed/fsdp/", "torch/distributed/_composable/fsdp"):
            if frame.name.startswith("wait") or "all_gather" in frame.name or "reduce" in frame.name:
                kind = "reduce_scatter" if _FSDP_REDUCE.search(frame.name) and not _FSDP_GATHER.search(frame.name) else "all_gather"
                return kind, f"FSDP {frame.name}"
    # DDP's gradient all-reduce runs in the autograd engine (C++ reducer hooks): only native frames show it.
    native = [f for f in frames if f.native]
    if any("c10d::Reducer" in f.func for f in native):
        return "all_reduce", "DDP backward, gradient buckets"
    if any(("c10d::" in f.func or "gloo::" in f.func) and ("wait" in f.func.lower() or "Work" in f.func) for f in native):
        return "wait", "c10d work"
    if any("horovod" in f.func.lower() and "wait" in f.func.lower() for f in native):
        return "hvd.synchronize", "Horovod"
    return None, None


def _via_detail(via: str | None, library: list[Frame]) -> str | None:
    """'FSDP _all_gather_flat_param' rather than 'FSDP': the FSDP function says which collective."""
    if via in ("FSDP", "DeepSpeed"):
        # The innermost FSDP function with a real name (not a wrapper, __call__ or private helper).
        layer = [f.name for f in library if _in(f, "torch/distributed/fsdp/", "torch/distributed/_composable/fsdp", "deepspeed/")
                 and f.name not in ("wrapper", "decorate_context", "__call__")]
        names = [n for n in layer if not n.startswith("_")] or layer
        if names:
            return f"{via} {names[0]}"
    if via == "DDP":
        names = [f.name for f in library if _in(f, "torch/nn/parallel/distributed.py")]
        if names:
            return f"DDP {names[0]}"
    if via is None and any(_in(f, "torch/autograd/") for f in library):
        return "in backward, from a hook"
    return via


# --- step, guard, source -------------------------------------------------------------------------

STEP_NAMES = ("global_step", "step", "iteration", "train_step", "step_idx", "iter_num", "batch_idx", "it")


def step_of(frames: Sequence[Frame]) -> int | None:
    """The training step, from a local of the user's frames (innermost first) named like one."""
    for frame in user_frames(frames):
        local = dict(frame.locals)
        for name in STEP_NAMES:
            value = local.get(name)
            if value is not None and re.fullmatch(r"-?\d+", value.strip()):
                return int(value)
    return None


_RANKISH = re.compile(r"\b(?:\w*rank\w*|RANK|is_main\w*|is_master\w*|main_process\w*|process_index|is_rank_zero|master_process)\b", re.I)


@dataclass(frozen=True)
class Guard:
    """An `if` on the rank that encloses a line: its test, its line, and whether we are in `else`."""

    test: str
    line: int
    orelse: bool = False

    def describe(self, where: str | None = None) -> str:
        where = where or f"line {self.line}"
        return f"in the else branch of `if {self.test}` ({where})" if self.orelse else f"under `if {self.test}` ({where})"


@lru_cache(maxsize=256)
def _tree(path: str, mtime: float) -> tuple[ast.AST, str] | None:
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        return ast.parse(source), source
    except (OSError, SyntaxError, ValueError):
        return None


def rank_guard(path: str, line: int) -> Guard | None:
    """The innermost `if` whose test mentions the rank and whose body (or else) holds `line`."""
    try:
        parsed = _tree(path, os.path.getmtime(path))
    except OSError:
        return None
    if parsed is None:
        return None
    tree, source = parsed
    found = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not node.body:
            continue
        test = ast.get_source_segment(source, node.test) or ""
        if not _RANKISH.search(test):
            continue
        in_body = node.body[0].lineno <= line <= (node.body[-1].end_lineno or 0)
        in_else = bool(node.orelse) and node.orelse[0].lineno <= line <= (node.orelse[-1].end_lineno or 0)
        if (in_body or in_else) and (found is None or node.lineno > found.line):
            found = Guard(" ".join(test.split()), node.lineno, orelse=in_else and not in_body)
    return found


def guard_of(frames: Sequence[Frame]) -> tuple[Frame, Guard] | None:
    """The innermost user frame whose line sits under a rank guard, with that guard."""
    for frame in user_frames(frames):
        guard = rank_guard(frame.file, frame.line)
        if guard is not None:
            return frame, guard
    return None


def source_line(frame: Frame | None) -> str:
    if frame is None or frame.native:
        return ""
    return linecache.getline(frame.file, frame.line).strip()


def short_path(path: str, root: str | None = None) -> str:
    """A path relative to `root` (or the working directory) when it lies below it; an installed
    package's path from the package on (torch/distributed/distributed_c10d.py)."""
    norm = path.replace("\\", "/")
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in norm:
            return norm.split(marker, 1)[1]
    stdlib = _STDLIB.search(path)
    if stdlib:
        return path[stdlib.end():]
    for base in (root, os.getcwd()):
        if base:
            base = os.path.abspath(base) + os.sep
            if path.startswith(base):
                return path[len(base):]
    return path


def site_text(frame: Frame | None, root: str | None = None) -> str:
    if frame is None:
        return "?"
    return f"{short_path(frame.file, root)}:{frame.line} in {frame.func}"


# --- ranks and the verdict -----------------------------------------------------------------------


@dataclass
class RankStacks:
    """One rank as read: who it is, its main thread's stacks over the samples, and the verdict's inputs."""

    pid: int
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    host: str = ""
    samples: list[list[Frame]] = field(default_factory=list)  # main-thread stacks, oldest first
    active: list[bool | None] = field(default_factory=list)  # per sample
    native: list[Frame] | None = None  # a native read of the last stack, where one was made
    other_threads: dict[str, list[Frame]] = field(default_factory=dict)
    children: list[tuple[int, list[Frame]]] = field(default_factory=list)  # e.g. DataLoader workers
    error: str | None = None
    error_kind: str | None = None  # sampler.EXITED, PERMISSION, NOT_PYTHON, TIMEOUT, FAILED
    flight: str | None = None  # the rank's Flight Recorder dump, summarised, where the job writes one

    @property
    def frames(self) -> list[Frame]:
        """The last stack read, with native frames where a native read was made."""
        if self.native is not None:
            return self.native
        return self.samples[-1] if self.samples else []

    @property
    def steps(self) -> list[int | None]:
        return [step_of(s) for s in self.samples]

    @property
    def step(self) -> int | None:
        return next((s for s in reversed(self.steps) if s is not None), None)

    @property
    def moved(self) -> bool:
        """The stack or the step changed between samples: the rank is making progress."""
        sigs = {signature(s) for s in self.samples}
        steps = {s for s in self.steps if s is not None}
        return len(sigs) > 1 or len(steps) > 1

    @property
    def activity(self) -> Activity:
        last_active = self.active[-1] if self.active else None
        return classify(self.frames, last_active)

    def threads_in_collectives(self) -> dict[str, Activity]:
        """Threads other than the main one that wait in a collective (a background checkpoint, a
        side stream of work): they hold the job as surely as the main thread."""
        found = {}
        for name, frames in self.other_threads.items():
            activity = classify(frames, False)
            if activity.in_collective:
                found[name] = activity
        return found

    @property
    def label(self) -> str:
        return f"rank {self.rank}" if self.rank is not None else f"pid {self.pid}"


@dataclass(frozen=True)
class Group:
    """Ranks that stand at the same place (identical Python stacks), with what that place is."""

    ranks: tuple[RankStacks, ...]
    activity: Activity
    moved: bool
    guard: tuple[Frame, Guard] | None
    in_hung_job: bool = False

    @property
    def names(self) -> str:
        return ranks_text([r.rank if r.rank is not None else r.pid for r in self.ranks], self.ranks[0].rank is None)

    def describe(self, root: str | None = None) -> str:
        a = self.activity
        verb = "is" if len(self.ranks) == 1 else "are"
        steps = sorted({r.step for r in self.ranks if r.step is not None})
        span = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}" if steps else ""
        if self.moved and not self.in_hung_job:
            return f"{self.names} {verb} progressing" + (f" ({span})" if span else "")
        if self.moved:
            still = "its stack moves" if len(self.ranks) == 1 else "their stacks move"
            head = (f"{self.names} {verb} not in a collective: {a.describe()} ({still}"
                    + (f", {span} does not advance" if span and not any(len({x for x in r.steps if x is not None}) > 1 for r in self.ranks) else "")
                    + ")")
            if a.in_collective:
                head = f"{self.names} {verb} moving ({still}), last seen in {a.describe()}"
        elif a.in_collective:
            head = f"{self.names} {'waits' if len(self.ranks) == 1 else 'wait'} in {a.describe()}"
        else:
            head = f"{self.names} {verb} not in a collective: {a.describe()}"
        if a.user is not None:
            head += f", from {site_text(a.user, root)}"
        elif a.inner is not None:
            head += f", at {site_text(a.inner, root)}"
        if self.guard is not None:
            head += f", {self.guard_text(root)}"
        return head

    def guard_text(self, root: str | None = None) -> str | None:
        """'under `if rank == 0` (line 30)', with the file and function when not the user's frame."""
        if self.guard is None:
            return None
        frame, guard = self.guard
        if frame == self.activity.user:
            return guard.describe()
        return guard.describe(f"{short_path(frame.file, root)}:{guard.line} in {frame.func}")


def ranks_text(ids: Sequence[int], pids: bool = False) -> str:
    """'rank 1', 'ranks 0,2,3', 'ranks 0-7,9' ('pid'/'pids' for processes without a rank)."""
    word = "pid" if pids else "rank"
    ids = sorted(set(ids))
    if len(ids) == 1:
        return f"{word} {ids[0]}"
    runs: list[list[int]] = []
    for i in ids:
        if runs and not pids and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)
    return f"{word}s {text}"


@dataclass(frozen=True)
class Verdict:
    """The job's verdict: `hung` when a rank waits in a collective and its stack did not move."""

    hung: bool
    summary: str  # the whole verdict in one line
    groups: tuple[Group, ...]
    unread: tuple[RankStacks, ...] = ()
    headline: str = ""  # its first words, for the text report above the groups


def group_ranks(ranks: Sequence[RankStacks], hung: bool = False) -> list[Group]:
    """Ranks with identical Python stacks together, the odd group first.

    Ranks whose stacks move form one "progressing" group in a job that runs; in a hung job they are
    grouped by what they do and where (a rank spinning in a loop while the others wait), and come
    first: a rank that moves but never reaches the collective the others wait in is the usual cause."""
    buckets: dict[object, list[RankStacks]] = {}
    for rank in ranks:
        if rank.moved:
            a = rank.activity
            key: object = ("moved", a.kind, a.user.site if a.user else None) if hung else "moved"
        else:
            key = signature(rank.frames)
        buckets.setdefault(key, []).append(rank)
    groups = []
    for members in buckets.values():
        first = members[0]
        guard = guard_of(first.frames) if hung or not first.moved else None
        groups.append(Group(tuple(sorted(members, key=_rank_order)), first.activity, first.moved, guard, hung))

    def order(group: Group) -> tuple:
        # The usual cause first: a rank elsewhere (moving, or stuck outside any collective), then a
        # collective under a rank guard, then the smaller group (the odd one).
        elsewhere = not group.activity.in_collective or group.moved
        return (not (hung and group.moved), not elsewhere, group.guard is None, len(group.ranks), _rank_order(group.ranks[0]))

    return sorted(groups, key=order)


def _rank_order(rank: RankStacks) -> tuple[int, int]:
    return (rank.rank if rank.rank is not None else 1 << 30, rank.pid)


def diagnose(ranks: Sequence[RankStacks], world_size: int | None = None, root: str | None = None) -> Verdict:
    """Group the ranks that were read and say whether, and where, the job parted."""
    read = [r for r in ranks if r.samples and r.error is None]
    unread = tuple(r for r in ranks if r not in read)
    if not read:
        return Verdict(False, "no rank could be read", (), unread, "no rank could be read")
    hung = any(r.activity.in_collective and not r.moved for r in read)
    groups = group_ranks(read, hung)
    if not hung:
        if all(g.moved for g in groups):
            summary = f"all {len(read)} ranks progressing: nothing hung"
        else:
            summary = "no rank waits in a collective: nothing hung (" + "; ".join(g.describe(root) for g in groups) + ")"
        headline = f"all {len(read)} ranks progressing" if all(g.moved for g in groups) else "no rank waits in a collective"
        return Verdict(False, summary, tuple(groups), unread, headline)
    parts = [g.describe(root) for g in groups]
    if len(groups) == 1:
        missing = ""
        if world_size and world_size > len(read):
            missing = (f"; only {len(read)} of {world_size} ranks are on this machine: the rank that did not "
                       "arrive is elsewhere (run `distdoctor stacks --format json` on every node, then `--merge`)")
        summary = f"every rank read waits at the same place: {parts[0]}{missing}"
        headline = "every rank read waits at the same place" + missing
    else:
        step = _parting_step(read)
        headline = "ranks parted" + (f" at step {step}" if step is not None else "")
        summary = headline + ": " + "; ".join(parts)
        headline += "; the likely cause first"
    return Verdict(True, summary, tuple(groups), unread, headline)


def _parting_step(ranks: Sequence[RankStacks]) -> int | None:
    steps = [r.step for r in ranks if r.step is not None]
    return min(steps) if steps else None
