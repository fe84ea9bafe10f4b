"""Rank-side hooks for Horovod scripts (`distdoctor probe train_hvd.py`, run under horovodrun).

The torch hooks (`distdoctor.probe.script.hooks.install_torch_hooks`) already see every optimizer step, backward
pass and model input. Horovod changes two things they rely on, handled here:

- `hvd.DistributedOptimizer` returns an instance of a class made on the fly (a subclass of the user's
  optimizer class) whose `step()` first waits for the gradient all-reduces (`synchronize()`) and
  then updates. torch's global step pre-hooks run *before* that `step()` body, so they would
  checksum local, still-reducing gradients. The dynamic class's `step` is therefore wrapped to do
  what Horovod's own `step` does first, `synchronize()`, and then to run the hooked step inside
  `skip_synchronize()`: the same all-reduces, once, in the same order, and the hooks see the
  averaged gradients the update uses. A step the script already synchronized is left untouched.
- Gradients changed in place while Horovod is still all-reducing them (clipping before
  `optimizer.synchronize()`, the documented pitfall) are recorded where it happens, since the
  averaged result can look consistent across ranks and still be wrong.

`hvd.broadcast_parameters` / `hvd.broadcast_optimizer_state` calls are recorded too, so that a
parameter divergence at the first step can say whether the broadcast happened.
Records are `{"e": "hvd", "what": ...}` lines in the rank's record file (`protocol.HOROVOD`), read
back as `RankTrace.horovod`. This module builds on `distdoctor.probe.script.hooks`; nothing there
imports it back (`distdoctor.probe.script.run` installs both).
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

from distdoctor.probe.script.hooks import user_site
from distdoctor.probe.script.protocol import HOROVOD

# Functions that change gradients in place: harmless after synchronize(), wrong before it.
GRADIENT_EDITORS = ("clip_grad_norm_", "clip_grad_value_")


def install(probe: Any) -> None:
    """Hook `horovod.torch` and the gradient clipping functions for `probe` (a `hooks.Probe`).

    Optimizer steps, backward passes and forward inputs are observed by the torch hooks; Horovod adds
    its own wrappers (its optimizer all-reduces gradients inside `step`/`synchronize`, and
    `broadcast_parameters` replaces DDP's initial broadcast), which are hooked here.
    """
    import horovod.torch as hvd
    import horovod.torch.optimizer as hvd_optimizer
    import torch.nn.utils
    import torch.nn.utils.clip_grad

    distributed: weakref.WeakSet[Any] = weakref.WeakSet()
    plain_synchronize = hvd_optimizer._DistributedOptimizer.__dict__["synchronize"]
    make_optimizer = hvd.DistributedOptimizer

    @functools.wraps(make_optimizer)
    def distributed_optimizer(optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        wrapped = make_optimizer(optimizer, *args, **kwargs)
        cls = type(wrapped)
        # Adasum's optimizer reduces after the local update: its step is left as it is.
        if cls.__dict__.get("synchronize") is plain_synchronize:
            _synchronize_before_step_hooks(cls)
            distributed.add(wrapped)
        probe.write(HOROVOD, what="optimizer", cls=type(optimizer).__name__, site=user_site(2),
                    op=str(kwargs.get("op", "Average")),
                    backward_passes_per_step=kwargs.get("backward_passes_per_step", 1))
        return wrapped

    def recorded(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            probe.write(HOROVOD, what=name, site=user_site(2), step=probe.step_counts.get(0, 0))
            return original(*args, **kwargs)

        return call

    def gradient_editor(name: str, original: Any) -> Any:
        @functools.wraps(original)
        def edit(*args: Any, **kwargs: Any) -> Any:
            in_flight = sum(_reducing(opt) for opt in list(distributed))
            if in_flight:
                probe.write(HOROVOD, what="unsynchronized_edit", op=name, site=user_site(2),
                            step=probe.step_counts.get(0, 0), reducing=in_flight)
            return original(*args, **kwargs)

        return edit

    for module in (hvd, hvd_optimizer):
        module.DistributedOptimizer = distributed_optimizer
    hvd.broadcast_parameters = recorded("broadcast_parameters", hvd.broadcast_parameters)
    broadcast_state = recorded("broadcast_optimizer_state", hvd.broadcast_optimizer_state)

    @functools.wraps(broadcast_state)
    def broadcast_optimizer_state(*args: Any, **kwargs: Any) -> Any:
        # A fresh optimizer gets its state from one step on zero gradients inside this call: not a
        # training step. The probe takes steps taken inside another step as part of it; so is this one.
        probe.step_depth += 1
        try:
            return broadcast_state(*args, **kwargs)
        finally:
            probe.step_depth -= 1

    hvd.broadcast_optimizer_state = broadcast_optimizer_state
    for name in GRADIENT_EDITORS:
        editor = gradient_editor(name, getattr(torch.nn.utils.clip_grad, name))
        setattr(torch.nn.utils.clip_grad, name, editor)
        setattr(torch.nn.utils, name, editor)
    import horovod

    probe.write(HOROVOD, what="init", version=horovod.__version__)


def _reducing(optimizer: Any) -> int:
    """How many gradient all-reduces `optimizer` has started and not yet waited for."""
    handles = getattr(optimizer, "_handles", {})
    return sum(1 for handle, _ in list(handles.values()) if handle is not None)


def _synchronize_before_step_hooks(cls: type) -> None:
    """Make `cls.step` synchronize first, then run the (hook-wrapped) step without synchronizing."""
    hooked_step = cls.step
    if getattr(hooked_step, "_distdoctor_synchronizes", False):
        return

    @functools.wraps(hooked_step)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._should_synchronize and not self._synchronized:
            self.synchronize()
            with self.skip_synchronize():
                return hooked_step(self, *args, **kwargs)
        return hooked_step(self, *args, **kwargs)

    step.hooked = True  # type: ignore[attr-defined]  # torch must not wrap it in its step hooks again
    step._distdoctor_synchronizes = True  # type: ignore[attr-defined]
    cls.step = step  # type: ignore[method-assign]
