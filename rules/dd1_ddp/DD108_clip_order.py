"""DD108 clip-order: gradient clipping at a point where it cannot affect the update."""

from __future__ import annotations

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, names, syntax
from distdoctor.lint.analysis.context import LintContext
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.rule import Example, Report, Rule

CLIP = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad_norm")

BACKWARD, SCALED_BACKWARD, STEP, UNSCALE, ZERO = "backward", "scaled-backward", "step", "unscale", "zero_grad"


class ClipOrder(Rule):
    """
    ## What it does
    Flags `torch.nn.utils.clip_grad_norm_` / `clip_grad_value_` in a training loop when, in the
    same iteration, it runs before `backward()`, after the optimizer's `step()` (with no new
    backward in between), or after a `GradScaler`'s `scaler.scale(loss).backward()` without
    `scaler.unscale_(optimizer)` between the backward pass and the clip. A statement in a block
    that ends in `continue` (or `break`, `return`, `raise`) does not count as run before the clip:
    `if not finite: optimizer.zero_grad(); continue` skips the clip in that iteration.

    ## Why is this bad?
    Clipping acts on the `.grad` tensors present at that moment. Before `backward()` they are the
    previous iteration's (or zeros); after `step()` the update has already been applied. With a
    `GradScaler`, the gradients are still multiplied by the loss scale (often 2**16), so the norm
    is compared with `max_norm` on the wrong scale and clipping either does nothing useful or
    clips everything. In each case training runs without the clipping it was meant to have.

    ## Example
    ```python
    scaler.scale(loss).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    ```

    ## Use instead
    ```python
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(optimizer)
    ```

    ## Fix safety
    No autofix: which optimizer to unscale, and where the clip belongs, depend on the loop.
    """

    code = "DD108"
    name = "clip-order"
    severity = "warning"
    summary = "gradient clipping before backward, after step, or on scaled gradients"
    requires = (frameworks.CLIP_WORDS,)

    invalid = (
        Example(
            # The scaled backward in the fp16 branch, a plain one in the other: the clip still sees
            # scaled gradients under fp16.
            """
            import torch
            import torch.distributed as dist
            from torch.nn.utils import clip_grad_norm_


            def train(args, model, loader, optimizer, scaler):
                for batch in loader:
                    with torch.autocast("cuda", enabled=args.fp16):
                        loss = model(**batch).loss
                    if args.fp16:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    if args.grad_clip_norm > 0:
                        clip_grad_norm_(model.parameters(), args.grad_clip_norm)  # expect: DD108
                    if args.fp16:
                        scaler.step(optimizer)
                        scaler.update()
                    else:
                        optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        Example(
            # The flush after the loop clips the remainder's gradients still scaled.
            """
            import torch

            def train_epoch(model, loader, optimizer, scaler, accumulation):
                step = 0
                for step, batch in enumerate(loader, start=1):
                    scaler.scale(model(batch).loss / accumulation).backward()
                    if step % accumulation == 0:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad()
                if step % accumulation != 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: DD108
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()

            model = torch.nn.parallel.DistributedDataParallel(Net().cuda())
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
            scaler = torch.amp.GradScaler()
            for epoch in range(10):
                train_epoch(model, loader, optimizer, scaler, 8)
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            scaler = torch.cuda.amp.GradScaler()
            for x, y in loader:
                with torch.autocast("cuda"):
                    loss = criterion(model(x), y)
                optimizer.zero_grad()
                scaler.scale(loss).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # expect: DD108
                scaler.step(optimizer)
                scaler.update()
            """
        ),
        Example(
            """
            import torch.distributed as dist
            from torch.nn.utils import clip_grad_norm_

            dist.init_process_group("nccl")
            for batch in loader:
                optimizer.zero_grad()
                loss = model(batch).loss
                clip_grad_norm_(model.parameters(), max_norm=0.5)  # expect: DD108
                loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import torch.nn as nn
            from torch.nn.parallel import DistributedDataParallel as DDP

            class Trainer:
                def __init__(self, model, gpu):
                    self.model = DDP(model, device_ids=[gpu])

                def train_epoch(self):
                    for x, y in self.loader:
                        loss = self.criterion(self.model(x), y)
                        self.optimizer.zero_grad()
                        loss.backward()
                        self.optimizer.step()
                        nn.utils.clip_grad_value_(self.model.parameters(), 5.0)  # expect: DD108
            """
        ),
    )
    valid = (
        Example(
            # The generator's optimizer steps before the discriminator's clip; the discriminator's own
            # step comes after it.
            """
            import torch
            import torch.distributed as dist


            def train(gen, disc, loader, optimizer_g, optimizer_d):
                for real in loader:
                    fake = gen(noise())
                    loss_d = disc(fake.detach()).mean() - disc(real).mean()
                    loss_d.backward()
                    loss_g = -disc(fake).mean()
                    loss_g.backward()
                    torch.nn.utils.clip_grad_norm_(gen.parameters(), 5.0)
                    optimizer_g.step()
                    optimizer_g.zero_grad()
                    torch.nn.utils.clip_grad_norm_(disc.parameters(), 5.0)
                    optimizer_d.step()
                    optimizer_d.zero_grad()
            """
        ),
        Example(
            # The scaled backward and the plain clip sit on opposite sides of conditions written
            # alike.
            """
            import torch
            import torch.distributed as dist


            def train(args, model, loader, optim, scaler, use_native_amp):
                for batch in loader:
                    loss = model(batch)["loss"]
                    if args.fp16 and use_native_amp:
                        scaler.scale(loss).backward()
                    else:
                        loss.backward()
                    if args.clip_grad_norm > 0:
                        if args.fp16 and use_native_amp:
                            scaler.unscale_(optim)
                            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                        else:
                            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
                    if args.fp16 and use_native_amp:
                        scaler.step(optim)
                        scaler.update()
                    else:
                        optim.step()
                    optim.zero_grad()
            """
        ),
        Example(
            # A zero_grad() under a condition of its own between the backward and the clip: a NaN
            # skip, not a step.
            """
            import torch
            import torch.distributed as dist


            class Trainer:
                def __init__(self, network, local_rank):
                    dist.init_process_group("nccl")
                    torch.cuda.set_device(local_rank)
                    self.network = torch.nn.parallel.DistributedDataParallel(network.cuda(), device_ids=[local_rank])
                    self.optimizer = torch.optim.SGD(self.network.parameters(), lr=0.01)
                    self.scaler = torch.cuda.amp.GradScaler()

                def drop_bad_gradients(self):
                    valid = all(torch.isfinite(p.grad).all() for p in self.network.parameters() if p.grad is not None)
                    if not valid:
                        self.optimizer.zero_grad()

                def run(self, loader):
                    for x, y in loader:
                        self.optimizer.zero_grad()
                        with torch.autocast("cuda"):
                            loss = self.network(x, y)
                        self.scaler.scale(loss).backward()
                        self.scaler.unscale_(self.optimizer)
                        self.drop_bad_gradients()
                        torch.nn.utils.clip_grad_norm_(self.network.parameters(), 12)
                        self.scaler.step(self.optimizer)
                        self.scaler.update()


            if __name__ == "__main__":
                Trainer(build_network(), local_rank()).run(make_loader())
            """
        ),
        Example(
            # The step of the other branch does not run before this clip.
            """
            import torch

            class TrainLoop:
                def __init__(self, model, use_fp16):
                    self.model = torch.nn.parallel.DistributedDataParallel(model.cuda())
                    self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
                    self.use_fp16 = use_fp16

                def run_step(self, batch):
                    self.opt.zero_grad()
                    self.model(batch).mean().backward()
                    if self.use_fp16:
                        self.optimize_fp16()
                    else:
                        self.optimize_normal()

                def optimize_fp16(self):
                    self.opt.step()

                def optimize_normal(self):
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.opt.step()

                def run(self, loader):
                    for batch in loader:
                        self.run_step(batch)
            """
        ),
        Example(
            # The remainder of an accumulation window, flushed after the loop: its backward
            # passes came after the loop's last step.
            """
            import torch

            def train_epoch(model, loader, optimizer, scaler, accumulation):
                step = 0
                for step, batch in enumerate(loader, start=1):
                    scaler.scale(model(batch).loss / accumulation).backward()
                    if step % accumulation == 0:
                        scaler.unscale_(optimizer)
                        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                        scaler.step(optimizer)
                        scaler.update()
                        optimizer.zero_grad()
                if step % accumulation != 0:
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
                    optimizer.zero_grad()

            model = torch.nn.parallel.DistributedDataParallel(Net().cuda())
            optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)
            scaler = torch.amp.GradScaler()
            for epoch in range(10):
                train_epoch(model, loader, optimizer, scaler, 8)
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            scaler = torch.cuda.amp.GradScaler()
            for x, y in loader:
                optimizer.zero_grad()
                scaler.scale(criterion(model(x), y)).backward()
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            for step, batch in enumerate(loader):
                loss = model(batch) / accum
                loss.backward()
                if (step + 1) % accum == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            for x, y in loader:
                loss = criterion(model(x), y)
                if use_amp:
                    scaler.scale(loss).backward()
                    scaler.unscale_(optimizer)
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                optimizer.zero_grad()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist

            scaler = torch.cuda.amp.GradScaler()
            for x, y in loader:
                try:
                    loss = criterion(model(x), y)
                    scaler.scale(loss).backward()
                except RuntimeError:
                    optimizer.zero_grad()  # a failed batch: its gradients are dropped ...
                    continue  # ... and the clip below is not reached in that iteration
                if not torch.isfinite(loss):
                    optimizer.zero_grad()
                    continue
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(optimizer)
                scaler.update()
                optimizer.zero_grad()
            """
        ),
        Example(
            # Retries of one batch: the inner loop's `break` follows a fresh backward() and leads
            # to the clip; the zero_grad of a failed try is followed by another try, or by no step.
            """
            import torch
            import torch.distributed as dist

            optimizer = torch.optim.AdamW(model.parameters(), lr=5e-4)
            for batch in loader:
                computed = False
                for attempt in range(3):
                    try:
                        loss = model(batch).mean()
                        loss.backward()
                        computed = True
                        break
                    except RuntimeError:
                        optimizer.zero_grad()
                if computed:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        for trace, step, call in ctx.calls(*CLIP):
            if not step.loops:
                continue
            events = _events(ctx, trace, step.loops[-1])
            here = next((i for i, (s, c, _) in enumerate(events) if c is call and s is step), None)
            if here is None:
                continue
            # An event in a block that ends in `continue` (or leaves the loop) is not followed by
            # the clip in the same iteration: `if skipped: optimizer.zero_grad(); continue`.
            # An event in the other branch of an `if` the clip is in (`if fp16: optimize_fp16()
            # else: optimize_normal()`) does not run before it in the same pass.
            # A zero_grad() under a condition of its own (`if not valid_gradients:
            # optimizer.zero_grad()`, a NaN skip) drops this step's gradients on purpose; the
            # clip after it is still in its place for every other iteration.
            clip_guards = {id(guard.test) for guard in step.guards}
            # The optimizer that steps next, after the clip: a step or zero_grad of another one
            # before the clip (a GAN's generator, `opt_g.step()` ... clip(D) ... `opt_d.step()`)
            # did not use the gradients this clip acts on.
            following = next((_optimizer_text(c) for _, c, kind in events[here + 1 :] if kind == STEP), None)
            kept = [
                (s, kind)
                for s, c, kind in events[:here]
                if not _cut_off(ctx, s.node, call, step.loops[-1])
                and not s.excludes(step)
                and not (kind == ZERO and any(id(guard.test) not in clip_guards for guard in s.guards))
                and not (kind in (STEP, ZERO) and following and _optimizer_text(c) not in (None, following))
            ]
            before = [kind for _, kind in kept]
            after = [kind for _, _, kind in events[here + 1 :]]
            backward_kinds = (BACKWARD, SCALED_BACKWARD)
            last_backward = max((i for i, kind in enumerate(before) if kind in backward_kinds), default=None)
            last_step = max((i for i, kind in enumerate(before) if kind in (STEP, ZERO)), default=None)
            inner_backward = _inner_loop_backward(kept, last_step, step) if last_step is not None else None
            if last_step is not None and inner_backward is not None:
                # The step sits in an inner loop that also runs backward(), and the clip follows
                # that loop: when the loop's last iterations did not step (the remainder of a
                # gradient accumulation, flushed after the loop), that backward came last.
                before.insert(last_step + 1, inner_backward)
                last_backward = last_step + 1
            # The latest scaled backward since the last step, also when a plain one follows it in
            # the other branch of `if fp16: scaler.scale(loss).backward() else: loss.backward()`.
            # Positions in `kept`; the inner loop's backward inserted above counts as just after the step.
            scaled = [
                i
                for i, (s, kind) in enumerate(kept)
                if kind == SCALED_BACKWARD and (last_step is None or i > last_step) and not _other_side(ctx, s, step)
            ]
            if last_step is not None and inner_backward == SCALED_BACKWARD and not scaled:
                scaled = [last_step]
            message = None
            if last_backward is None and any(kind in backward_kinds for kind in after):
                message = (
                    "gradients are clipped before backward() computes them in this iteration: clipping acts on "
                    "stale gradients. Clip between backward() and optimizer.step()."
                )
            elif last_step is not None and (last_backward is None or last_step > last_backward):
                message = (
                    "gradients are clipped after optimizer.step() (or zero_grad()) has used them: the clip "
                    "changes nothing. Clip between backward() and optimizer.step()."
                )
            elif last_backward is not None and scaled and UNSCALE not in [kind for _, kind in kept[scaled[-1] + 1 :]]:
                message = (
                    "gradients are clipped while still multiplied by the GradScaler's loss scale: call "
                    "`scaler.unscale_(optimizer)` before clipping."
                )
            if message is not None:
                yield Report(call, message)


def _optimizer_text(call: cst.Call) -> str | None:
    """The optimizer a step or zero_grad call names: `opt.step()`, `scaler.step(opt)`,
    `opt.zero_grad()`."""
    if not isinstance(call.func, cst.Attribute):
        return None
    receiver = names.dotted(call.func.value)
    if call.func.attr.value == "step" and call.args and "scaler" in (receiver or "").lower():
        return names.dotted(call.args[0].value)
    return receiver


def _other_side(ctx: LintContext, first: Step, second: Step) -> bool:
    """The two steps sit on opposite sides of conditions written alike (`if fp16 and native_amp:
    scaler.scale(loss).backward()` ... `if fp16 and native_amp: unscale and clip` / `else:
    clip`): in one pass, only one of them runs."""
    sides = {ctx.code(guard.test): guard.negated for guard in first.guards}
    return any(sides.get(ctx.code(guard.test), guard.negated) != guard.negated for guard in second.guards)


def _inner_loop_backward(kept: list[tuple[Step, str | None]], index: int, clip_step: Step) -> str | None:
    """The kind of backward() run by the loop that holds the step or zero_grad at `index`, when
    that loop does not hold the clip; None otherwise."""
    inner = [loop for loop in kept[index][0].loops if loop not in clip_step.loops]
    if not inner:
        return None
    return next((kind for s, kind in kept if kind in (BACKWARD, SCALED_BACKWARD) and inner[0] in s.loops), None)


def _events(ctx: LintContext, trace: Trace, loop: cst.CSTNode) -> list[tuple[Step, cst.Call, str | None]]:
    """Backward passes, scaler unscales, optimizer steps and clips of one loop body, in order."""
    events: list[tuple[Step, cst.Call, str | None]] = []
    for step in trace.steps:
        if not step.in_loop(loop):
            continue
        for call in syntax.own_calls(step.node):
            kind = None
            if ctx.is_backward(call):
                receiver = call.func.value if isinstance(call.func, cst.Attribute) else None
                scaled = (
                    isinstance(receiver, cst.Call)
                    and isinstance(receiver.func, cst.Attribute)
                    and receiver.func.attr.value == "scale"
                    and _is_scaler(trace, step, receiver.func.value)
                )
                kind = SCALED_BACKWARD if scaled else BACKWARD
            elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "unscale_":
                kind = UNSCALE
            elif ctx.stepped_optimizer(trace, step, call) is not None or (
                isinstance(call.func, cst.Attribute) and call.func.attr.value == "step" and _is_optimizer(trace, step, call.func.value)
            ):
                kind = STEP
            elif isinstance(call.func, cst.Attribute) and call.func.attr.value == "zero_grad" and _is_optimizer(trace, step, call.func.value):
                kind = ZERO
            elif ctx.qualname(call.func) in CLIP:
                kind = "clip"
            if kind is not None:
                events.append((step, call, kind))
    return events


def _cut_off(ctx: LintContext, node: cst.CSTNode, clip: cst.Call, loop: cst.CSTNode) -> bool:
    """Whether the statement `node`, run before the clip in the loop body, sits in a block that
    ends in `continue`, `break`, `return` or `raise` and does not hold the clip: on the path that
    reaches the clip in this iteration, that statement did not run."""
    holds_clip: set[int] = set()
    cur: cst.CSTNode | None = clip
    while cur is not None:
        holds_clip.add(id(cur))
        cur = ctx.parent(cur)
    found: list[tuple[type, int]] = []  # (terminator, loops nested in `loop` passed before it was met)
    nested = 0
    reached_loop = False
    cur = node
    while True:
        parent = ctx.parent(cur)
        if parent is None or isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
            break  # a helper's body: its `return` goes back to the loop, which goes on
        if parent is loop:
            reached_loop = True
            break
        if isinstance(parent, (cst.For, cst.While)):
            nested += 1
        if isinstance(parent, cst.IndentedBlock) and id(parent) not in holds_clip and parent.body:
            last = parent.body[-1]
            if isinstance(last, cst.SimpleStatementLine):
                for small in last.body:
                    if isinstance(small, (cst.Continue, cst.Break, cst.Return, cst.Raise)):
                        found.append((type(small), nested))
        cur = parent
    for kind, loops_before in found:
        if kind is cst.Raise:
            return True
        if kind is cst.Return and reached_loop:
            return True
        # A `break` or `continue` met before an inner loop was passed belongs to that inner loop:
        # it leaves the inner loop towards the clip, not the iteration the clip is in.
        if kind in (cst.Continue, cst.Break) and reached_loop and loops_before == nested:
            return True
    return False


def _is_scaler(trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
    value = trace.value(expr, step)
    if value is not None and value.kind == kinds.SCALER:
        return True
    text = (names.dotted(expr) or "").lower()
    return "scaler" in text


def _is_optimizer(trace: Trace, step: Step, expr: cst.BaseExpression) -> bool:
    value = trace.value(expr, step)
    if value is not None and value.kind in (kinds.OPTIMIZER, kinds.HVD_OPTIMIZER):
        return True
    text = (names.dotted(expr) or "").lower()
    return "optim" in text and "sched" not in text
