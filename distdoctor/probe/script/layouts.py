"""Which ranks must hold equal values of a parameter: the launcher's reading of DTensor layouts.

A plain tensor (DDP, ZeRO, Horovod) is one replica per rank: every rank must hold the same values.
A DTensor (FSDP2, tensor parallel, HSDP) is laid out on a device mesh, one placement per mesh
dimension: ranks that differ only along Replicate dimensions hold the same local values (HSDP
replicas, tensor-parallel replicated parameters, DDP across a 2D mesh), ranks that differ along a
Shard dimension hold different pieces of one tensor, and Partial values are summed later, so they
differ by design. The ranks record each parameter's mesh (its ranks), its placements and their own
coordinate (`tensors.layouts`); nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

UNREADABLE = -1.0  # the checksum of a tensor the rank could not read (tensors.UNREADABLE)


def layout_key(record: Mapping[str, Any], index: int, placements: str | None = None) -> Any:
    """What ranks that must agree on parameter `index` have in common, from one rank's optimizer
    record: equal keys on two ranks mean equal local values are required there. `placements`
    overrides the parameter's (a gradient laid out differently). None: agrees with no other rank."""
    spec = record.get("spec")
    entry = spec[index] if spec and index < len(spec) else None
    if entry is None:
        return ("replica",)  # by position, as the optimizers list them: what DDP and ZeRO compare
    mesh_index, own = entry
    meshes = record.get("meshes") or []
    if mesh_index >= len(meshes):
        return None
    mesh = meshes[mesh_index]
    coord = mesh.get("coord")
    kinds = (placements or own).split(",")
    if coord is None or len(coord) != len(kinds) or any(k[:1] not in ("S", "R") for k in kinds):
        return None  # Partial, unknown placements, or this rank outside the mesh
    fixed = tuple(c if k.startswith("S") else "*" for c, k in zip(coord, kinds))
    # Meshes are matched by shape and dimension names, not by their ranks: the tensor-parallel
    # ranks of one FSDP2 dp group hold the same shard of a parameter laid out on that dp submesh
    # only (a norm tensor parallelism replicates). The name keeps apart pipeline stages' parameters.
    names = record.get("names") or []
    name = names[index] if index < len(names) else index
    shape = json.dumps(_shape(mesh.get("ranks")))
    return (shape, tuple(mesh.get("names") or ()), placements or own, fixed, name)


def comparison_groups(records: Mapping[int, Mapping[str, Any]], index: int,
                      placements: Mapping[int, str | None] | None = None) -> list[list[int]]:
    """The groups of ranks (two or more) that must hold equal values of parameter `index`."""
    groups: dict[Any, list[int]] = {}
    for rank in sorted(records):
        key = layout_key(records[rank], index, (placements or {}).get(rank))
        if key is not None:
            groups.setdefault(key, []).append(rank)
    return [members for members in groups.values() if len(members) > 1]


def describe(records: Mapping[int, Mapping[str, Any]], index: int) -> str:
    """'S0 on a mesh of 2' / 'R,S0 on a 2x2 mesh' / 'a replica' for parameter `index` (first rank)."""
    for rank in sorted(records):
        spec = records[rank].get("spec")
        entry = spec[index] if spec and index < len(spec) else None
        if entry is None:
            return "a replica"
        meshes = records[rank].get("meshes") or []
        if entry[0] < len(meshes):
            shape = _shape(meshes[entry[0]].get("ranks"))
            size = "x".join(map(str, shape))
            return f"{entry[1]} on a mesh of {size}" if len(shape) == 1 else f"{entry[1]} on a {size} mesh"
    return "unknown"


def _shape(nested: Any) -> list[int]:
    shape = []
    while isinstance(nested, list):
        shape.append(len(nested))
        nested = nested[0] if nested else None
    return shape


def unreadable(value: Any) -> bool:
    """A checksum pair the rank could not compute."""
    return isinstance(value, (list, tuple)) and bool(value) and value[0] == UNREADABLE
