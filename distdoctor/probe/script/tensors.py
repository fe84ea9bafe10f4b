"""Reading tensors the way the probe must: never an operation a tensor subclass may reject.

Parameters and gradients under FSDP2 (`fully_shard`), tensor parallel (`parallelize_module`) and
HSDP are DTensors: `.tolist()`, `.item()` or a reduction over the whole tensor would either be
refused or start a collective that the other ranks never join. The probe reads only what this rank
holds: a DTensor's local shard (`to_local()`, no communication), and its mesh and placements, so the
launcher can tell which ranks must hold equal local values (a Replicate mesh dimension) and which
hold different shards of one tensor (a Shard mesh dimension).

Other tensor subclasses are read through the plain operations only, one tensor at a time when the
fused ones are refused; a tensor that cannot be read at all gets the checksum UNREADABLE, which the
launcher reports as not compared instead of as a difference.
"""

from __future__ import annotations

from typing import Any

import torch

# Norms are never negative: this value marks a tensor the probe could not read.
UNREADABLE = -1.0
_F64 = torch.float64
_dtensor_class: Any = None


def dtensor_class() -> type | None:
    """torch's DTensor class, or None on a torch without it."""
    global _dtensor_class
    if _dtensor_class is None:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:
            try:
                from torch.distributed._tensor import DTensor  # type: ignore[no-redef]
            except ImportError:
                DTensor = False  # type: ignore[assignment,misc]  # noqa: N806
        _dtensor_class = DTensor
    return _dtensor_class or None


def is_dtensor(t: Any) -> bool:
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`, detached: a DTensor's local shard, any other tensor itself."""
    if is_dtensor(t):
        return t.to_local().detach()  # type: ignore[attr-defined]
    return t.detach()


def placement_text(placements: Any) -> str:
    """'S0,R' for (Shard(0), Replicate()); 'P' for Partial; '?' for a kind unknown to the probe."""
    parts = []
    for p in placements:
        if p.is_shard() or "Shard" in type(p).__name__:  # _StridedShard (FSDP2 over tensor parallel)
            parts.append(f"S{getattr(p, 'dim', '')}")
        elif p.is_replicate():
            parts.append("R")
        elif p.is_partial():
            parts.append("P")
        else:
            parts.append("?")
    return ",".join(parts)


def mesh_of(t: Any) -> Any:
    return t.device_mesh if is_dtensor(t) else None


def describe_mesh(mesh: Any) -> dict[str, Any]:
    """The ranks of a DeviceMesh (nested lists), its dimension names and this rank's coordinate."""
    return {"ranks": mesh.mesh.tolist(), "names": list(mesh.mesh_dim_names or ()),
            "coord": mesh.get_coordinate()}


def flattened_by_fsdp1(t: Any) -> bool:
    """A FlatParameter of FSDP1 (FullyShardedDataParallel), or an original parameter it turned into
    a view of its local shard (use_orig_params=True): plain tensors, a different piece on each rank."""
    return bool(getattr(t, "_fsdp_flattened", False) or getattr(t, "_is_flat_param", False))


def _fsdp1_mesh() -> dict[str, Any]:
    """FSDP1's shards as a 1D mesh over the default group (each rank its own piece); hybrid
    sharding is taken as sharded too: not compared, never a false difference."""
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)
    return {"ranks": list(range(world)), "names": ["fsdp1"], "coord": [rank]}


def layouts(tensors: list[torch.Tensor]) -> tuple[list[Any] | None, list[dict[str, Any]]]:
    """Per tensor [mesh index, placements] (None for a plain tensor), and the meshes they index.

    Both are None/[] when no tensor is a DTensor or an FSDP1 shard, so plain DDP records do not grow.
    """
    if not any(is_dtensor(t) or flattened_by_fsdp1(t) for t in tensors):
        return None, []
    meshes: list[Any] = []
    out: list[Any] = []
    fsdp1: int | None = None
    described: list[dict[str, Any]] = []
    for t in tensors:
        mesh = mesh_of(t)
        if mesh is None and flattened_by_fsdp1(t):
            if fsdp1 is None:
                meshes.append(None)
                described.append(_fsdp1_mesh())
                fsdp1 = len(meshes) - 1
            out.append([fsdp1, "S0"])
            continue
        if mesh is None:
            out.append(None)
            continue
        for index, known in enumerate(meshes):
            if known is mesh:
                break
        else:
            meshes.append(mesh)
            described.append(describe_mesh(mesh))
            index = len(meshes) - 1
        out.append([index, placement_text(t.placements)])  # type: ignore[attr-defined]
    return out, described


def checksums(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """[L1, L2] norms of what this rank holds of each tensor, as 2n 0-dim float tensors.

    float32 accumulation (4x cheaper than float64 on CPU) is enough: the same tensor gives the same
    bits on every rank, and a real divergence moves a norm by far more than float32's precision.
    Half and bfloat16 are upcast, their own precision would hide small differences.
    """
    if not tensors:
        return []
    with torch.no_grad():
        held = [local(t) for t in tensors]
        plain = all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in held)
        try:
            if not plain:
                raise TypeError("tensor subclasses: one at a time")
            low = any(t.dtype in (torch.float16, torch.bfloat16) for t in held)
            kwargs = {"dtype": torch.float32} if low else {}
            ones = torch._foreach_norm(held, 1, **kwargs)
            twos = torch._foreach_norm(held, 2, **kwargs)
        except (RuntimeError, TypeError, NotImplementedError, ValueError):  # sparse, odd dtypes, subclasses
            ones, twos = [], []
            for t in held:
                one, two = _norms_one(t)
                ones.append(one)
                twos.append(two)
    out: list[torch.Tensor] = []
    for one, two in zip(ones, twos):
        out += [one, two]
    return out


def _norms_one(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        dense = t.to_dense() if t.is_sparse else t
        values = dense.to(_F64)
        one = values.abs().sum()
        two = torch.linalg.vector_norm(values)
        if type(one) is not torch.Tensor or type(two) is not torch.Tensor:  # a subclass all the way down
            raise TypeError(type(one).__name__)
        return one, two
    except Exception:  # noqa: BLE001 - any refusal means: this tensor cannot be read
        bad = torch.tensor(UNREADABLE, dtype=_F64, device=t.device if t.device.type != "meta" else "cpu")
        return bad, bad


def scalar(value: Any) -> float | bool | list[Any] | None:
    """A hyperparameter as JSON: a number, a bool, a tuple of numbers (betas); a CPU 0-dim tensor's
    value; None for what cannot be read without a device sync or at all."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, (tuple, list)) and len(value) <= 4:
        items = [scalar(v) for v in value]
        return None if any(v is None for v in items) else items
    if isinstance(value, torch.Tensor) and value.numel() == 1 and value.device.type == "cpu" and not is_dtensor(value):
        try:
            return float(value.detach().reshape(()).to(_F64).item())
        except Exception:  # noqa: BLE001
            return None
    return None
