"""DD102 ddp-module-bypass: a training forward through `ddp.module`, past the wrapper's hooks."""

from __future__ import annotations

import re

from collections.abc import Iterable

import libcst as cst

from distdoctor.lint.analysis import frameworks, kinds, syntax
from distdoctor.lint.analysis.context import LintContext, _assigned_names
from distdoctor.lint.analysis.trace import Step, Trace
from distdoctor.lint.analysis.kinds import Value
from distdoctor.lint.analysis.names import dotted
from distdoctor.lint.rule import Example, Report, Rule


class DDPModuleBypass(Rule):
    """
    ## What it does
    Flags a forward pass through the module *inside* a `DistributedDataParallel` wrapper
    (`ddp_model.module(x)`, or `net(x)` where `net` was wrapped by `DDP(net)`) whose result
    reaches `backward()`, a training step that computes its loss with a method of the inner
    module (`ddp.module.train_step(batch)`) and never calls the wrapper (unless the file freezes
    parameters, or its optimizers are all given other models' parameters: the method may run only
    frozen parts, a CLIP beside a trained generator), and a wrapper dropped as soon as it is
    built (`model = DDP(model, device_ids=[i]).module`, or a bare `DDP(model)` statement whose
    result nothing keeps). Forwards under `torch.no_grad()` /
    `inference_mode()` and forwards whose result never reaches a backward pass (evaluation,
    logging, EMA) stay silent.

    ## Why is this bad?
    DDP synchronises gradients from hooks that its own `forward` arms. A forward that goes
    around the wrapper produces gradients that are never all-reduced: each replica steps with its
    own gradients and the model copies silently drift apart, while the loss still goes down.

    ## Example
    ```python
    model = DDP(net, device_ids=[local_rank])
    loss = criterion(model.module(images), labels)
    loss.backward()
    ```

    ## Use instead
    ```python
    loss = criterion(model(images), labels)
    loss.backward()
    ```

    ## Fix safety
    No autofix: custom methods (`model.module.encode(x)`) have no drop-in replacement through
    the wrapper; route them through the wrapper's `forward` instead.
    """

    code = "DD102"
    name = "ddp-module-bypass"
    severity = "error"
    summary = "training forward through ddp.module: gradients are never all-reduced"
    requires = (frameworks.DDP_WORDS,)

    invalid = (
        Example(
            # The wrapper is built and thrown away: the loop trains the plain model.
            """
            import torch
            import torch.distributed as dist
            import torchvision


            def main(args, loader):
                dist.init_process_group("nccl", init_method=f"tcp://{args.master}:{args.port}", rank=args.rank, world_size=args.world_size)
                torch.cuda.set_device(args.local_rank)
                model = torchvision.models.resnet50().cuda()
                torch.nn.parallel.DistributedDataParallel(model, device_ids=[args.local_rank])  # expect: DD102
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                for images, labels in loader:
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(model(images.cuda()), labels.cuda()).backward()
                    optimizer.step()
            """
        ),
        Example(
            # The wrapper stored on the instance from outside the class, bypassed inside a method.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP


            class Trainer:
                def __init__(self, net):
                    self.net = net

                def fit(self, batches, optimizer):
                    for x in batches:
                        self.net.module(x).sum().backward()  # expect: DD102
                        optimizer.step()


            def worker(rank):
                torch.distributed.init_process_group("nccl", rank=rank, world_size=2)
                trainer = Trainer(Net().cuda(rank))
                trainer.net = DDP(trainer.net, device_ids=[rank])
                trainer.fit(batches(), torch.optim.SGD(trainer.net.parameters(), lr=0.1))


            torch.multiprocessing.spawn(worker, nprocs=2)
            """
        ),
        Example(
            # A method of the inner module computes the loss: no DDP forward at all.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            class Trainer:
                def __init__(self, model, gpu):
                    self.model = DDP(model.cuda(gpu), device_ids=[gpu])

                def train(self, loader, optimizer):
                    for batch in loader:
                        results = self.model.module.train_step(batch)  # expect: DD102
                        results["loss"].backward()
                        optimizer.step()
                        optimizer.zero_grad()
            """
        ),
        Example(
            # The distributed branch of the conditional is the bare module.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = Net().cuda()
            ddp_net = DDP(net, device_ids=[local_rank])
            model = ddp_net.module if args.distributed else net
            for batch in loader:
                loss = model(batch).mean()  # expect: DD102
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            for images, labels in loader:
                logits = model.module(images)  # expect: DD102
                loss = criterion(logits, labels)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
            """
        ),
        Example(
            """
            import torch.nn as nn

            def compute_loss(net, batch):
                out = net(batch["x"])  # expect: DD102
                return ((out - batch["y"]) ** 2).mean()

            def main(local_rank):
                net = Regressor().to(local_rank)
                ddp = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank])
                for batch in loader:
                    loss = compute_loss(net, batch)
                    loss.backward()
                    opt.step()
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel

            class Trainer:
                def __init__(self, model, gpu):
                    self.model = DistributedDataParallel(model, device_ids=[gpu])

                def step(self, x, y):
                    with torch.autocast("cuda"):
                        pred = self.model.module(x)  # expect: DD102
                        loss = torch.nn.functional.cross_entropy(pred, y)
                    self.scaler.scale(loss).backward()
            """
        ),
        Example(
            """
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel


            class Trainer:
                def __init__(self, model, rank):
                    dist.init_process_group("nccl")
                    torch.cuda.set_device(rank)
                    self.model = DistributedDataParallel(model.cuda(), device_ids=[rank]).module  # expect: DD102

                def step(self, batch, optimizer):
                    loss = self.model(batch).mean()
                    loss.backward()
                    optimizer.step()
            """
        ),
    )
    valid = (
        Example(
            # The model read past its wrapper is a frozen CLIP: the only optimizer trains the generator,
            # whose gradients go through its own wrapper.
            """
            import os

            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP


            def train(generator, model, loader, optimizer):
                model.eval()
                for images, tokens in loader:
                    text = model.module.encode_text(tokens.cuda())  # the frozen CLIP, read past its wrapper
                    noise = generator(text)
                    loss = -torch.nn.functional.cosine_similarity(model.module.encode_image(images.cuda() + noise), text).mean()
                    optimizer.zero_grad()
                    loss.backward()
                    optimizer.step()


            def main(clip, generator, loader):
                dist.init_process_group("nccl")
                local_rank = int(os.environ["LOCAL_RANK"])
                torch.cuda.set_device(local_rank)
                model = DDP(clip.cuda(), device_ids=[local_rank])
                generator = DDP(generator.cuda(), device_ids=[local_rank])
                optimizer = torch.optim.Adam(generator.parameters(), lr=1e-3)
                train(generator, model, loader, optimizer)
            """
        ),
        Example(
            # The wrapper is stored on the instance from outside the class (`trainer.model =
            # DDP(trainer.model)`): the methods called afterwards see it as `self.model`.
            """
            import torch
            import torch.distributed as dist
            import torch.multiprocessing as mp
            from torch.nn.parallel import DistributedDataParallel as DDP


            class EmbeddingTrainer:
                def __init__(self, device):
                    self.model = EmbeddingModel().to(device)
                    self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=2e-5)

                def train(self, loader):
                    for input_ids, mask in loader:
                        embeddings = self.model(input_ids, mask)
                        loss = contrastive_loss(embeddings)
                        self.optimizer.zero_grad()
                        loss.backward()
                        self.optimizer.step()


            def worker(rank, world_size):
                dist.init_process_group("nccl", rank=rank, world_size=world_size)
                torch.cuda.set_device(rank)
                trainer = EmbeddingTrainer(rank)
                trainer.model = DDP(trainer.model, device_ids=[rank])
                trainer.train(make_loader(rank, world_size))


            if __name__ == "__main__":
                mp.spawn(worker, args=(torch.cuda.device_count(),), nprocs=torch.cuda.device_count())
            """
        ),
        Example(
            # The forward goes through the wrapper; the inner module's method only scores it.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            def train(model, gpu, loader, optimizer):
                ddp = DDP(model.cuda(gpu), device_ids=[gpu])
                for images, targets in loader:
                    outputs = ddp(images)
                    loss = ddp.module.compute_loss(outputs, targets)
                    loss.backward()
                    optimizer.step()
                    optimizer.zero_grad()
            """
        ),
        Example(
            # `x if not is_ddp else x_ddp`: a multi-process job takes the wrapper.
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            class Trainer:
                def __init__(self, is_ddp=False):
                    self.is_ddp = is_ddp
                    self.net = Net().cuda()
                    if self.is_ddp:
                        self.net_ddp = DDP(self.net)

                def train(self, loader, optimizer):
                    model = self.net if not self.is_ddp else self.net_ddp
                    for batch in loader:
                        loss = model(batch).mean()
                        optimizer.zero_grad()
                        loss.backward()
                        optimizer.step()
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            for images, labels in loader:
                loss = criterion(model(images), labels)
                loss.backward()
                optimizer.step()
            model.eval()
            with torch.no_grad():
                preds = model.module(val_images)
            """
        ),
        Example(
            """
            from torch.nn.parallel import DistributedDataParallel as DDP

            model = DDP(Net().cuda(), device_ids=[local_rank])
            if rank == 0:
                sample = model.module(noise)  # a preview: nothing is trained on it
                save_image(sample, "preview.png")
            """
        ),
        Example(
            """
            import torch
            from torch.nn.parallel import DistributedDataParallel as DDP

            @torch.no_grad()
            def evaluate(model, loader):
                return [model.module(x) for x in loader]

            model = DDP(Net().cuda(), device_ids=[local_rank])
            for x, y in loader:
                loss = criterion(model(x), y)
                loss.backward()
            evaluate(model, val_loader)
            """
        ),
    )

    def check(self, ctx: LintContext) -> Iterable[Report]:
        if not ctx.may_call(frameworks.DDP):
            return  # every finding needs a DDP wrapper, built by a DistributedDataParallel(...) call
        yield from _discarded_wrappers(ctx)
        for trace in ctx.traces:
            for step, call in trace.calls():
                method = _inner_method_call(trace, step, call)
                if method is not None:
                    report = _method_bypass(ctx, trace, step, call, *method)
                    if report is not None:
                        yield report
                    continue
                wrapper = _bypassed_wrapper(trace, step, call)
                if wrapper is None or ctx.grad_disabled(step):
                    continue
                if not _reaches_backward(ctx, trace, step, call):
                    continue
                # Name the wrapper by what the code wrote (`ddp_net.module(x)`); `wrapper.name` is
                # the module it wraps (`DDP(net)`), which is not the thing to call.
                called = dotted(call.func) or ""
                if called.endswith(".module"):
                    holder = called[: -len(".module")]
                    where, advice = f"wrapper `{holder}`", f"Call the wrapper itself: `{holder}(...)`."
                else:
                    where = f"wrapper of `{wrapper.name}`" if wrapper.name else "wrapper"
                    advice = "Call the wrapper itself, not its `.module`."
                yield Report(
                    call,
                    f"this forward goes around the DistributedDataParallel {where} and its result "
                    f"reaches backward(): its gradients are never all-reduced and the replicas drift apart. "
                    f"{advice}",
                )


def _discarded_wrappers(ctx: LintContext) -> Iterable[Report]:
    """`model = DistributedDataParallel(model, ...).module`, or a bare `DistributedDataParallel(model)`
    statement: the wrapper is dropped the moment it is built, so no forward can ever go through it."""
    calls = [call for _, _, call in ctx.calls(frameworks.DDP)]
    wrappers = {id(call) for call in calls}
    if ctx.may_call_method("backward"):
        for call in calls:
            if isinstance(ctx.parent(call), cst.Expr):
                yield Report(
                    call,
                    "the DistributedDataParallel wrapper built here is thrown away (its result is not assigned): "
                    "training runs on the plain model, so gradients are never all-reduced and every rank trains "
                    "its own copy. Keep it: `model = DistributedDataParallel(model, ...)`.",
                )
    # The `.module` attributes of a wrapper call on the code path (looked up from the attributes,
    # not through a parent map of every node of the file).
    for node in ctx.nodes(cst.Attribute):
        if node.attr.value == "module" and id(node.value) in wrappers:
            yield Report(
                node,
                "`.module` of the DistributedDataParallel wrapper just built keeps the plain model and drops "
                "the wrapper: no forward goes through DDP, so gradients are never all-reduced and every rank "
                "trains its own copy. Keep the wrapper (`model = DDP(model, ...)`) and reach `.module` only "
                "to save or inspect the weights.",
            )


# Methods of the inner module that run no forward computation.
_NOT_FORWARD = frozenset({
    "state_dict", "load_state_dict", "parameters", "named_parameters", "buffers", "named_buffers",
    "modules", "named_modules", "children", "named_children", "train", "eval", "to", "cuda", "cpu",
    "half", "float", "bfloat16", "zero_grad", "requires_grad_", "apply", "register_buffer",
    "get_parameter", "get_submodule", "save_pretrained", "generate",
})


def _inner_method_call(trace: Trace, step: Step, call: cst.Call) -> tuple[Value, str] | None:
    """`ddp.module.train_step(batch)`: a method of the wrapped module, called past the wrapper."""
    func = call.func
    if not (isinstance(func, cst.Attribute) and isinstance(func.value, cst.Attribute) and func.value.attr.value == "module"):
        return None
    if func.attr.value in _NOT_FORWARD:
        return None
    outer = trace.value(func.value.value, step)
    if outer is None or outer.kind != kinds.DDP:
        return None
    return outer, func.attr.value


def _method_bypass(ctx: LintContext, trace: Trace, step: Step, call: cst.Call, wrapper: Value, method: str) -> Report | None:
    """A training step that computes its loss with a method of the inner module and never calls
    the wrapper: no forward of DDP arms the gradient all-reduce. (`loss_fn(ddp(x))` followed by
    `ddp.module.compute_loss(...)` has had its DDP forward and stays silent.)"""
    if not step.loops or ctx.grad_disabled(step) or not _reaches_backward(ctx, trace, step, call):
        return None
    if _freezes_parameters(ctx):
        return None  # the method may run only frozen parts (a CLIP text tower): nothing to all-reduce
    names = {dotted(call.func.value.value) or "", wrapper.name or ""}  # type: ignore[union-attr]
    if isinstance(wrapper.node, cst.Call):
        # The wrapper as its builder named it (`policy_net = DDP(policy_net)`), wherever it is
        # called `model` later.
        names.add(ctx.code(syntax.argument(wrapper.node, 0, "module") or wrapper.node))
        assign = ctx.parent(wrapper.node)
        if isinstance(assign, cst.Assign):
            names.update(dotted(target.target) or "" for target in assign.targets)
    if _optimised_elsewhere(ctx, {name for name in names if name}):
        return None  # the optimizers train other models (a generator): this wrapper's model is frozen
    loop = step.loops[-1]
    for other in trace.steps:
        if other.in_loop(loop):
            for inner in syntax.own_calls(other.node):
                value = trace.value(inner.func, other)
                if value is not None and value.kind == kinds.DDP and value.same_object(wrapper):
                    return None
    holder = dotted(call.func.value.value) or "the wrapper"  # type: ignore[union-attr]
    return Report(
        call,
        f"this training step computes its loss with `{holder}.module.{method}()`, past the "
        f"DistributedDataParallel wrapper, and never calls the wrapper: no DDP forward runs, so the "
        f"gradients are never all-reduced and the replicas drift apart. Route the step through the "
        f"wrapper's forward (`{holder}(batch)` calling `{method}` inside `forward`).",
    )


def _optimised_elsewhere(ctx: LintContext, names: set[str]) -> bool:
    """Whether the file builds optimizers and none of them is given the parameters of the
    wrapper or its module, under any of `names` (`Adam(generator.parameters())` while the
    bypassed `model` is a frozen CLIP)."""
    built = [call for _, _, call in ctx.optimizer_calls()]
    if not built or not names:
        return False
    word = re.compile("|".join(rf"(?<![\w.]){re.escape(name)}(?!\w)" for name in sorted(names)))
    return not any(call.args and word.search(ctx.code(call.args[0].value)) for call in built)


def _freezes_parameters(ctx: LintContext) -> bool:
    """`p.requires_grad_(False)` or `p.requires_grad = False` somewhere in the file."""
    for call in ctx.nodes(cst.Call):
        func = call.func
        if isinstance(func, cst.Attribute) and func.attr.value == "requires_grad_" and call.args:
            if isinstance(call.args[0].value, cst.Name) and call.args[0].value.value == "False":
                return True
    for node in ctx.nodes(cst.Assign):
        if isinstance(node.value, cst.Name) and node.value.value == "False" and any(
            isinstance(target.target, cst.Attribute) and target.target.attr.value == "requires_grad" for target in node.targets
        ):
            return True
    return False


def _bypassed_wrapper(trace: Trace, step: Step, call: cst.Call) -> Value | None:
    """The DDP wrapper whose inner module `call` calls directly, if any."""
    func = call.func
    if isinstance(func, cst.Attribute) and func.attr.value == "module":
        outer = trace.value(func.value, step)
        if outer is not None and outer.kind == kinds.DDP:
            return outer
        return None
    if not isinstance(func, (cst.Name, cst.Attribute)) or dotted(func) is None:
        return None
    value = trace.value(func, step)
    if value is None or value.kind in (kinds.DDP, kinds.CONST, kinds.TUPLE) or value.node is None:
        return None
    for other in step.env.values():
        if other.kind == kinds.DDP and other.inner is not None and other.inner.same_object(value):
            return other
    return None


def _reaches_backward(ctx: LintContext, trace: Trace, step: Step, call: cst.Call) -> bool:
    if any(ctx.is_backward(other) for other in syntax.own_calls(step.node)):
        return True
    seeds = {(step.frame.id, name) for name in _assigned_names(step.node)}
    if isinstance(step.node, cst.Return) and step.frame.call is not None:
        # `return net(x)` in a helper: follow the call site instead.
        caller = next((s for s in trace.steps[step.index :] if any(c is step.frame.call for c in syntax.own_calls(s.node))), None)
        if caller is None:
            return False
        if any(ctx.is_backward(other) for other in syntax.own_calls(caller.node)):
            return True
        seeds = {(caller.frame.id, name) for name in _assigned_names(caller.node)}
        step = caller
    if not seeds:
        return False
    for later, uses in ctx.data_flow(trace, step, seeds):
        if uses and any(ctx.is_backward(other) for other in syntax.own_calls(later.node)):
            return True
    return False
