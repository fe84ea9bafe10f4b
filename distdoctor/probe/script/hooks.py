"""Rank-side observation of an unchanged training script, through hooks torch already offers.

What is observed, and where it is hooked:
- optimizer steps: the global step pre/post hooks of `torch.optim` (gradient checksums before the
  update, parameter checksums before the first update and after every update);
- backward passes: `torch.autograd.backward` (`Tensor.backward` calls it): the count, the call site
  and the value of the scalar whose backward ran (the loss);
- what reaches the model: a forward pre-hook on each top-level module with parameters (found with a
  global forward hook until the first step, then removed: it costs on every submodule call);
- DDP construction (which parameters DDP covers), `DistributedSampler` iteration (epoch, shuffle),
  and the collectives the script itself calls on the default group (count, op, call site).

Nothing here talks to the other ranks: every observation is appended to this rank's record file
(`instrument.protocol`) and compared by the launcher. Checksums stay on the device until the step's
record is written; on CUDA that is one step later, so the probe adds no host-device sync of its own.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import linecache
import json
import multiprocessing
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from distdoctor.probe.script import protocol
from distdoctor.probe.script.tensors import checksums as _checksums
from distdoctor.probe.script.tensors import layouts, local, placement_text, scalar

_F64 = torch.float64
# Frames in these folders are not "the user's code" when a call site is named.
_SKIP_PREFIXES = (
    os.path.dirname(torch.__file__),
    os.path.dirname(os.path.dirname(os.path.abspath(__file__))),  # distdoctor itself
    os.path.dirname(functools.__file__),  # the standard library (runpy, contextlib, ...)
    "<",
)
# Collectives counted for `desync` (point-to-point send/recv differ per rank by design).
COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
    "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
    "scatter_object_list",
)
# Optimizer param-group entries compared across ranks by `hparams` (numbers, bools, betas).
HPARAM_FIELDS = ("lr", "betas", "momentum", "weight_decay", "eps", "dampening", "nesterov", "alpha", "rho",
                 "lr_decay", "amsgrad", "maximize", "initial_lr")


def user_site(skip: int = 2) -> str:
    """`file:line` of the innermost frame outside torch, distdoctor and the standard library."""
    frame = sys._getframe(skip)
    while frame is not None:
        if not frame.f_code.co_filename.startswith(_SKIP_PREFIXES):
            return f"{frame.f_code.co_filename}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class RecordWriter:
    """Appends one JSON object per line to this rank's record file, one write call per record."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self._file = open(path, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - lives as long as the rank
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            self._file.write(line)


class _DeviceValues:
    """0-dim tensors to bring to the host as floats, without a sync on CUDA until they are read."""

    def __init__(self, values: list[torch.Tensor]) -> None:
        self._ready: list[float] | None = None
        self._host: torch.Tensor | None = None
        self._event: Any = None
        if not values:
            self._ready = []
            return
        device = values[0].device
        stacked = torch.stack([v.to(device=device, dtype=_F64) for v in values])
        if device.type == "cuda":
            self._host = torch.empty(stacked.shape, dtype=_F64, pin_memory=True)
            self._host.copy_(stacked, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._ready = stacked.tolist()

    def get(self) -> list[float]:
        if self._ready is None:
            self._event.synchronize()
            self._ready = self._host.tolist()  # type: ignore[union-attr]
        return self._ready


def _input_tensors(obj: Any, depth: int = 0) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 3 and isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _input_tensors(item, depth + 1)
    elif depth < 3 and isinstance(obj, dict):
        for item in obj.values():
            yield from _input_tensors(item, depth + 1)


def _input_hash(args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[torch.Tensor] | None:
    """Two float64 numbers that identify the tensors reaching forward (position-weighted sums)."""
    tensors = [local(t) for t in _input_tensors((args, kwargs))]
    if not tensors:
        return None
    total = torch.zeros((), dtype=_F64, device=tensors[0].device)
    square = torch.zeros((), dtype=_F64, device=tensors[0].device)
    for k, t in enumerate(tensors, start=1):
        values = t if t.is_floating_point() else t.to(_F64)
        total = total + k * values.sum(dtype=_F64).to(total.device)
        square = square + k * torch.linalg.vector_norm(values, dtype=_F64).to(total.device)
    return [total, square]


class Probe:
    """Everything one rank observes; its hooks are bound methods of the one instance per rank."""

    def __init__(self, writer: RecordWriter, rank: int, stop_after: int, script: str) -> None:
        self.writer = writer
        self.rank = rank
        self.stop_after = stop_after
        self.script = script
        self.started = time.perf_counter()
        self.hook_s = 0.0  # time spent inside the probe's own hooks: the overhead, measured
        self.optimizers: list[Any] = []  # in the order of their first step; kept alive for id()
        self.step_counts: dict[int, int] = {}
        self.step_depth = 0
        self.backward_count = 0
        self.collective_count = 0
        self.collective_depth = 0
        self.losses: list[torch.Tensor] = []
        self.inputs: list[torch.Tensor] = []
        self.forward_depth = 0
        self.ddp_forwards = 0  # training forwards through a DDP wrapper: each prepares a reduction
        self.models: list[weakref.ref[torch.nn.Module]] = []
        self.model_ids: set[int] = set()
        self.ddp_modules: list[weakref.ref[torch.nn.Module]] = []
        self.ddp_param_ids: set[int] | None = None
        self.samplers: dict[int, int] = {}
        self.pending: tuple[dict[str, Any], _DeviceValues, list[tuple[str, int]]] | None = None
        self.pre_step: tuple[int, list[torch.Tensor], list[int], bool, str] | None = None
        self.global_hooks: list[Any] = []
        self.first_step_at: float | None = None
        self.finished = False
        self.disabled: set[str] = set()  # observations whose hook failed: never tried again
        self.total_steps = 0  # steps of every optimizer: a sampler pass that spans one fed training
        self.last_hparams: dict[int, list[dict[str, Any]]] = {}
        self.clips: list[dict[str, Any]] = []  # clipping calls since the last step
        self.scaler: Any = None  # the GradScaler whose step() is running
        self.scaled: tuple[torch.Tensor, Any] | None = None  # (scaler.scale(loss), loss), the last one

    # --- the probe's own failures --------------------------------------------------------------

    def guarded(self, what: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        """`hook`, made unable to raise into the user's code: its first failure disables the
        observation `what` (one of OBSERVATIONS) for the rest of the run and is recorded."""

        @functools.wraps(hook)
        def safe(*args: Any, **kwargs: Any) -> Any:
            if what in self.disabled:
                return None
            try:
                return hook(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the probe's problem, never the script's
                self.disable(what, getattr(hook, "__name__", what), exc)
                return None

        return safe

    def disable(self, what: str, hook: str, exc: BaseException) -> None:
        self.disabled.add(what)
        if what == "steps":
            self.pre_step, self.pending = None, None
        try:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            self.write(protocol.PROBE_ERROR, what=what, hook=hook, type=type(exc).__name__,
                       message=str(exc)[:500], traceback=text[-3000:], step=self.step_counts.get(0, 0))
        except Exception:  # noqa: BLE001, S110 - nowhere left to say it; the script goes on
            pass

    # --- recording -----------------------------------------------------------------------------

    def write(self, kind: str, **fields: Any) -> None:
        fields["e"] = kind
        fields["t"] = round(time.time(), 4)
        self.writer.write(fields)

    def flush_pending(self) -> None:
        """Write the last step's record once its device values are on the host."""
        if self.pending is None:
            return
        record, values, layout = self.pending
        self.pending = None
        floats = values.get()
        pos = 0
        for key, count in layout:
            record[key] = floats[pos : pos + count]
            pos += count
        if "scale" in record:
            record["scale"] = record["scale"][0]
        for key in ("grad", "param", "param0", "fwd"):
            if key in record:
                flat = record[key]
                record[key] = [flat[i : i + 2] for i in range(0, len(flat), 2)]
        if "grad_mask" in record:  # parameters without a gradient: null in place
            grads = iter(record.pop("grad"))
            record["grad"] = [next(grads) if has else None for has in record.pop("grad_mask")]
        self.writer.write(record)

    # --- optimizer -----------------------------------------------------------------------------

    def _optimizer_index(self, optimizer: Any) -> int:
        for index, known in enumerate(self.optimizers):
            if known is optimizer:
                return index
        self.optimizers.append(optimizer)
        return len(self.optimizers) - 1

    def _param_names(self, params: list[torch.Tensor]) -> list[str]:
        modules = [m for ref in (*self.ddp_modules, *self.models) if (m := ref()) is not None]
        unique: list[torch.nn.Module] = []
        for module in modules:
            inner = getattr(module, "module", module) if isinstance(module, _ddp_class()) else module
            if all(inner is not seen for seen in unique):
                unique.append(inner)
        names: dict[int, str] = {}
        for module in unique:
            prefix = f"{type(module).__name__}:" if len(unique) > 1 else ""
            for name, param in module.named_parameters():
                # torch.compile's OptimizedModule puts its own attribute into every name
                names.setdefault(id(param), prefix + name.replace("_orig_mod.", ""))
        return [names.get(id(p), f"<{tuple(p.shape)} param #{i}>") for i, p in enumerate(params)]

    def on_step_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.step_depth:  # an optimizer stepping inside another's step (ZeRO): not a step of its own
            self.step_depth += 1
            return
        self.step_depth = 1
        self._observe_step_pre(optimizer)

    def _observe_step_pre(self, optimizer: Any) -> None:
        if "steps" in self.disabled:
            return
        try:
            self.observe_step_pre(optimizer)
        except Exception as exc:  # noqa: BLE001 - see `guarded`
            self.disable("steps", "optimizer step pre-hook", exc)

    def observe_step_pre(self, optimizer: Any) -> None:
        began = time.perf_counter()
        self.flush_pending()
        index = self._optimizer_index(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        first = index not in self.step_counts
        site = user_site(3)
        if first:
            in_ddp = None if self.ddp_param_ids is None else [id(p) in self.ddp_param_ids for p in params]
            spec, meshes = layouts(params)
            extra = {"spec": spec, "meshes": meshes} if spec is not None else {}
            self.write(protocol.OPTIMIZER, opt=index, cls=type(optimizer).__name__, site=site,
                       names=self._param_names(params), ddp=in_ddp, **extra)
            if self.first_step_at is None:
                self.first_step_at = time.perf_counter()
        grad_mask = [p.grad is not None for p in params]
        grads = [p.grad for p in params if p.grad is not None]
        values = _checksums(grads)
        if first:
            values += _checksums(params)
        extra = self._step_extras(optimizer, index, params)
        scale = getattr(self.scaler, "_scale", None)
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            extra["_scale"] = scale.detach().reshape(())
        self.pre_step = (index, params, grad_mask, first, site, extra)
        self._pre_values = values
        self.hook_s += time.perf_counter() - began

    def _step_extras(self, optimizer: Any, index: int, params: list[torch.Tensor]) -> dict[str, Any]:
        """What a step record carries besides checksums: the hyperparameters when they changed,
        the clipping calls since the last step, gradient placements that differ from the
        parameter's (a Partial gradient is not comparable across ranks)."""
        extra: dict[str, Any] = {}
        if "hparams" not in self.disabled:
            try:
                hparams = [{k: v for k in HPARAM_FIELDS if k in group and (v := scalar(group[k])) is not None}
                           for group in optimizer.param_groups]
                if hparams != self.last_hparams.get(index):
                    self.last_hparams[index] = hparams
                    extra["hp"] = hparams
                if self.clips:
                    extra["clip"], self.clips = self.clips, []
            except Exception as exc:  # noqa: BLE001 - see `guarded`
                self.disable("hparams", "hyperparameter reading", exc)
        moved = {}
        for j, p in enumerate(params):
            g = p.grad
            if g is not None and g is not p and hasattr(g, "placements") and hasattr(p, "placements") \
                    and tuple(g.placements) != tuple(p.placements):
                moved[str(j)] = placement_text(g.placements)
        if moved:
            extra["gpl"] = moved
        return extra

    def on_step_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.step_depth -= 1
        if self.step_depth:
            return
        # Counting and stopping do not depend on any observation: they go on when one failed.
        index = self._optimizer_index(optimizer)
        n = self.step_counts[index] = self.step_counts.get(index, 0) + 1
        self.total_steps += 1
        if self.pre_step is not None and "steps" not in self.disabled:
            try:
                self.observe_step_post(n)
            except Exception as exc:  # noqa: BLE001 - see `guarded`
                self.disable("steps", "optimizer step post-hook", exc)
        if index == 0 and n == 1:
            self._stop_discovering_models()
        if index == 0 and self.stop_after and n >= self.stop_after:
            self.stop()

    def observe_step_post(self, n: int) -> None:
        began = time.perf_counter()
        assert self.pre_step is not None
        index, params, grad_mask, first, site, extra = self.pre_step
        self.pre_step = None
        values = self._pre_values + _checksums(params)
        layout = [("grad", 2 * sum(grad_mask))]
        if first:
            layout.append(("param0", 2 * len(params)))
        layout.append(("param", 2 * len(params)))
        layout.append(("loss", len(self.losses)))
        values += self.losses
        layout.append(("fwd", len(self.inputs)))
        values += self.inputs
        if "_scale" in extra:
            layout.append(("scale", 1))
            values.append(extra.pop("_scale"))
        self.losses, self.inputs = [], []
        record = {"e": protocol.STEP, "t": round(time.time(), 4), "opt": index, "n": n,
                  "bwd": self.backward_count, "coll": self.collective_count, "dfwd": self.ddp_forwards,
                  "site": site, "grad_mask": grad_mask, **extra}
        self.pending = (record, _DeviceValues(values), layout)
        if not any(v.is_cuda for v in values[:1]):
            self.flush_pending()
        self.hook_s += time.perf_counter() - began

    # --- backward ------------------------------------------------------------------------------

    def wrap_backward(self, original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            self.backward_count += 1
            n = self.backward_count
            observe(tensors, n)
            result = original(tensors, *args, **kwargs)
            ended(n)
            return result

        def observe_backward(tensors: Any, n: int) -> None:
            began = time.perf_counter()
            first = tensors[0] if isinstance(tensors, (tuple, list)) and tensors else tensors
            if self.scaled is not None:  # scaler.scale(loss).backward(): the loss is the unscaled one
                scaled, loss = self.scaled
                self.scaled = None
                if first is scaled and isinstance(loss, torch.Tensor):
                    first = loss
            if isinstance(first, torch.Tensor) and first.numel() == 1:
                self.losses.append(local(first).reshape(()))
            self.write(protocol.BACKWARD, n=n, site=user_site(3))
            self.hook_s += time.perf_counter() - began

        def end_backward(n: int) -> None:
            self.write(protocol.BACKWARD_END, n=n)

        observe = self.guarded("backward", observe_backward)
        ended = self.guarded("backward", end_backward)

        return backward

    # --- forward -------------------------------------------------------------------------------

    def _add_model(self, module: torch.nn.Module, site: str) -> None:
        self.model_ids.add(id(module))
        self.models.append(weakref.ref(module))
        module.register_forward_pre_hook(self.on_model_forward, with_kwargs=True)  # guards itself
        self.write("model", index=len(self.models) - 1, cls=type(module).__name__,
                   inner=type(getattr(module, "module", module)).__name__, site=site)

    def on_global_forward_pre(self, module: torch.nn.Module, args: Any) -> None:
        self.forward_depth += 1
        if self.forward_depth == 1 and id(module) not in self.model_ids and not _in_backward():
            began = time.perf_counter()
            if next(iter(module.parameters()), None) is not None and "forward" not in self.disabled:
                # a loss module is not "the model"
                self._add_model(module, user_site(3))
                # The instance hook only runs from the next call, and a global pre-hook is not given
                # the keyword arguments: read them from Module._call_impl's frame (model(**batch)).
                self.on_model_forward(module, args, _call_kwargs(module))
            self.hook_s += time.perf_counter() - began

    def on_global_forward(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        self.forward_depth -= 1

    def on_model_forward(self, module: torch.nn.Module, args: Any, kwargs: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation may legitimately see the same data on every rank
        # Each of these prepares a gradient all-reduce in the backward pass; under no_sync() none does.
        if isinstance(module, _ddp_class()) and getattr(module, "require_backward_grad_sync", True):
            self.ddp_forwards += 1
        if "forward" in self.disabled:
            return
        try:
            began = time.perf_counter()
            hashed = _input_hash(args, kwargs)
            if hashed is not None:
                self.inputs += hashed
            self.hook_s += time.perf_counter() - began
        except Exception as exc:  # noqa: BLE001 - see `guarded`
            self.disable("forward", "model forward pre-hook", exc)

    def _stop_discovering_models(self) -> None:
        for handle in self.global_hooks:
            handle.remove()
        self.global_hooks = []

    # --- DDP, samplers, collectives ------------------------------------------------------------

    def on_ddp(self, ddp: torch.nn.Module, init_sync: bool) -> None:
        """Which parameters DDP covers, and the wrapper watched as a model."""
        module = ddp.module  # type: ignore[attr-defined]
        covered = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.ddp_param_ids = (self.ddp_param_ids or set()) | {id(p) for _, p in covered}
        self.ddp_modules.append(weakref.ref(ddp))
        self.write(protocol.DDP, site=user_site(3), cls=type(module).__name__,
                   names=[n for n, _ in covered], init_sync=init_sync)
        if id(ddp) not in self.model_ids:  # watched from its first forward, keyword arguments included
            self._add_model(ddp, user_site(3))

    def on_sampler_iter(self, sampler: Any) -> tuple[int, int]:
        index = self.samplers.setdefault(id(sampler), len(self.samplers))
        passes = getattr(sampler, "_distdoctor_passes", 0) + 1
        sampler._distdoctor_passes = passes
        site = user_site(3)
        self.write(protocol.SAMPLER_ITER, sampler=index, cls=type(sampler).__name__,
                   created=getattr(sampler, "_distdoctor_site", "?"), site=site, source=_source_line(site),
                   epoch=getattr(sampler, "epoch", None), shuffle=bool(getattr(sampler, "shuffle", False)),
                   set_epoch_calls=getattr(sampler, "_distdoctor_set_epoch", 0), passes=passes,
                   step=self.step_counts.get(0, 0))
        return index, passes

    def follow_pass(self, indices: Iterable[Any], sampler: int, passes: int) -> Iterator[Any]:
        """The sampler's indices, unchanged; the first time an optimizer step has happened since
        the pass began, the pass is recorded as one that fed training (a peek `next(iter(loader))`
        or an evaluation pass never is)."""
        start = self.total_steps
        fed = False
        for item in indices:
            if not fed and self.total_steps > start:
                fed = True
                with contextlib.suppress(Exception):
                    self.write(protocol.SAMPLER_FED, sampler=sampler, passes=passes, step=self.step_counts.get(0, 0))
            yield item

    def wrap_collective(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        try:
            group_pos = list(inspect.signature(original).parameters).index("group")
        except ValueError:
            group_pos = None

        began = self.guarded("collectives", functools.partial(self.write, protocol.COLLECTIVE))
        ended = self.guarded("collectives", functools.partial(self.write, protocol.COLLECTIVE_END))

        @functools.wraps(original)
        def collective(*args: Any, **kwargs: Any) -> Any:
            if self.collective_depth:
                return original(*args, **kwargs)
            group = kwargs.get("group", args[group_pos] if group_pos is not None and len(args) > group_pos else None)
            if group is not None and group is not dist.group.WORLD:
                return original(*args, **kwargs)  # subgroups may legitimately differ per rank
            self.collective_count += 1
            n = self.collective_count
            began(n=n, op=name, site=user_site(2))
            self.collective_depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self.collective_depth -= 1
                ended(n=n)

        return collective

    # --- hyperparameters, layouts ----------------------------------------------------------------

    def on_clip(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if name == "clip_grad_value_":
            limit = kwargs.get("clip_value", args[1] if len(args) > 1 else None)
            norm_type = None
        else:
            position = 0 if name.startswith("FSDP") else 1
            limit = kwargs.get("max_norm", args[position] if len(args) > position else None)
            norm_type = kwargs.get("norm_type", args[position + 1] if len(args) > position + 1 else 2.0)
        self.clips.append({"fn": name, "max": scalar(limit), "norm_type": scalar(norm_type), "site": user_site(3)})

    def note_scaled(self, result: Any, outputs: Any) -> None:
        if isinstance(result, torch.Tensor):
            self.scaled = (result, outputs)

    def on_tensor_parallel(self, device_mesh: Any) -> None:
        if device_mesh is None:
            from torch.distributed.device_mesh import _mesh_resources

            device_mesh = _mesh_resources.get_current_mesh()
        self.write(protocol.TENSOR_PARALLEL, ranks=device_mesh.mesh.flatten().tolist(), site=user_site(3))

    # --- end of the run ------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        now = time.perf_counter()
        since_first = now - self.first_step_at if self.first_step_at is not None else 0.0
        return {"steps": self.step_counts.get(0, 0), "hook_s": round(self.hook_s, 6),
                "wall_s": round(now - self.started, 4), "train_s": round(since_first, 4),
                "backward": self.backward_count, "coll": self.collective_count}

    def stop(self) -> None:
        """End this rank after the requested steps: no user code runs after the last step."""
        self.flush_pending()
        self.write(protocol.STOP, **self.summary())
        self.finished = True
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        for child in multiprocessing.active_children():  # DataLoader workers
            child.terminate()
        os._exit(0)

    def finish(self, code: Any) -> None:
        if self.finished:
            return
        self.finished = True
        self.flush_pending()
        self.write(protocol.EXIT, code=code if isinstance(code, int) or code is None else str(code), **self.summary())

    def error(self, exc: BaseException, exit_code: Any = None) -> None:
        if self.finished:
            return
        self.finished = True
        self.flush_pending()
        frames = traceback.extract_tb(exc.__traceback__)
        user = [f for f in frames if not f.filename.startswith(_SKIP_PREFIXES)]
        site = f"{user[-1].filename}:{user[-1].lineno}" if user else "?"
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        extra = {} if exit_code is None else {"exit_code": exit_code if isinstance(exit_code, int) else str(exit_code)}
        self.write(protocol.ERROR, type=type(exc).__name__, message=str(exc)[:2000], site=site,
                   traceback=text[-6000:], **extra, **self.summary())


def _in_backward() -> bool:
    """Whether autograd is running a backward pass (activation checkpointing re-runs forwards there:
    those modules are not models the script calls)."""
    try:
        return torch._C._current_graph_task_id() != -1
    except AttributeError:
        return False


def _source_line(site: str) -> str:
    path, _, line = site.rpartition(":")
    return linecache.getline(path, int(line)).strip()[:200] if line.isdigit() else ""


def _call_kwargs(module: torch.nn.Module) -> dict[str, Any]:
    """The keyword arguments `module` is being called with, from the frame of `Module._call_impl`
    (or its inner closure) that called the global forward pre-hooks; {} where it cannot be found."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        local = frame.f_locals
        if local.get("self") is module and isinstance(local.get("kwargs"), dict):
            return local["kwargs"]
        frame = frame.f_back
    return {}


def _ddp_class() -> type:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel


def install_torch_hooks(probe: Probe) -> None:
    """Hook torch so that `probe` sees the script's steps, backward passes, model inputs and data.

    Every hook either guards itself or is wrapped in `probe.guarded`: a failure of the probe's own
    code disables that observation and never reaches the script.
    """
    from torch.nn.modules import module as nn_module
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
    from torch.utils.data.distributed import DistributedSampler

    register_optimizer_step_pre_hook(probe.on_step_pre)
    register_optimizer_step_post_hook(probe.on_step_post)
    torch.autograd.backward = probe.wrap_backward(torch.autograd.backward)
    probe.global_hooks = [
        nn_module.register_module_forward_pre_hook(probe.guarded("forward", probe.on_global_forward_pre)),
        nn_module.register_module_forward_hook(probe.on_global_forward, always_call=True),
    ]

    ddp_class = _ddp_class()
    ddp_init = ddp_class.__init__
    on_ddp = probe.guarded("ddp", probe.on_ddp)
    ddp_begins = probe.guarded("ddp", lambda: probe.write(protocol.DDP_BEGIN, site=user_site(4)))

    @functools.wraps(ddp_init)
    def init(self: Any, module: Any, *args: Any, **kwargs: Any) -> None:
        ddp_begins()
        ddp_init(self, module, *args, **kwargs)
        on_ddp(self, bool(kwargs.get("init_sync", True)))

    ddp_class.__init__ = init  # type: ignore[method-assign]

    sampler_init = DistributedSampler.__init__
    sampler_iter = DistributedSampler.__iter__
    sampler_set_epoch = DistributedSampler.set_epoch
    on_sampler_iter = probe.guarded("sampler", probe.on_sampler_iter)

    @functools.wraps(sampler_init)
    def sampler_created(self: Any, *args: Any, **kwargs: Any) -> None:
        sampler_init(self, *args, **kwargs)
        with contextlib.suppress(Exception):
            self._distdoctor_site = user_site(2)

    @functools.wraps(sampler_iter)
    def sampler_iterated(self: Any) -> Any:
        seen = on_sampler_iter(self)
        indices = sampler_iter(self)
        return indices if seen is None else probe.follow_pass(indices, *seen)

    @functools.wraps(sampler_set_epoch)
    def epoch_set(self: Any, epoch: int) -> None:
        with contextlib.suppress(Exception):
            self._distdoctor_set_epoch = getattr(self, "_distdoctor_set_epoch", 0) + 1
        sampler_set_epoch(self, epoch)

    DistributedSampler.__init__ = sampler_created  # type: ignore[method-assign]
    DistributedSampler.__iter__ = sampler_iterated  # type: ignore[method-assign]
    DistributedSampler.set_epoch = epoch_set  # type: ignore[method-assign]

    for name in COLLECTIVES:
        original = getattr(dist, name, None)
        if original is not None:
            setattr(dist, name, probe.wrap_collective(name, original))

    init_pg = dist.init_process_group
    on_pg = probe.guarded("collectives", lambda: probe.write(
        "pg", backend=str(dist.get_backend()), world=dist.get_world_size(), rank=dist.get_rank()))

    @functools.wraps(init_pg)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        result = init_pg(*args, **kwargs)
        on_pg()
        return result

    dist.init_process_group = init_process_group
    _install_hparam_hooks(probe)
    _install_layout_hooks(probe)


def _install_hparam_hooks(probe: Probe) -> None:
    """Clipping calls (their max-norm) and GradScaler (its scale, and the unscaled loss)."""
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    record_clip = probe.guarded("hparams", probe.on_clip)
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        original = getattr(torch.nn.utils.clip_grad, name, None)
        if original is None:
            continue

        def clipper(original: Callable[..., Any] = original, name: str = name) -> Callable[..., Any]:
            @functools.wraps(original)
            def clip(*args: Any, **kwargs: Any) -> Any:
                record_clip(name, args, kwargs)
                return original(*args, **kwargs)

            return clip

        wrapped = clipper()
        setattr(torch.nn.utils.clip_grad, name, wrapped)
        setattr(torch.nn.utils, name, wrapped)
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        FullyShardedDataParallel = None  # type: ignore[assignment,misc]  # noqa: N806
    if FullyShardedDataParallel is not None:
        fsdp_clip = FullyShardedDataParallel.clip_grad_norm_

        @functools.wraps(fsdp_clip)
        def fsdp_clip_grad_norm_(self: Any, *args: Any, **kwargs: Any) -> Any:
            record_clip("FSDP.clip_grad_norm_", args, kwargs)
            return fsdp_clip(self, *args, **kwargs)

        FullyShardedDataParallel.clip_grad_norm_ = fsdp_clip_grad_norm_  # type: ignore[method-assign]

    try:
        from torch.amp import GradScaler
    except ImportError:
        return
    scaler_scale, scaler_step = GradScaler.scale, GradScaler.step
    note_scaled = probe.guarded("backward", probe.note_scaled)

    @functools.wraps(scaler_scale)
    def scale(self: Any, outputs: Any) -> Any:
        result = scaler_scale(self, outputs)
        note_scaled(result, outputs)
        return result

    @functools.wraps(scaler_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer, probe.scaler = probe.scaler, self
        try:
            return scaler_step(self, *args, **kwargs)
        finally:
            probe.scaler = outer

    GradScaler.scale = scale  # type: ignore[method-assign]
    GradScaler.step = step  # type: ignore[method-assign]


def _install_layout_hooks(probe: Probe) -> None:
    """`parallelize_module`: the ranks of a tensor-parallel group are meant to see the same batch."""
    try:
        import torch.distributed.tensor.parallel as tp
        from torch.distributed.tensor.parallel import api
    except ImportError:
        return
    original = api.parallelize_module
    on_tp = probe.guarded("forward", probe.on_tensor_parallel)

    @functools.wraps(original)
    def parallelize_module(module: Any, device_mesh: Any = None, *args: Any, **kwargs: Any) -> Any:
        result = original(module, device_mesh, *args, **kwargs)
        on_tp(device_mesh)
        return result

    api.parallelize_module = parallelize_module
    tp.parallelize_module = parallelize_module

