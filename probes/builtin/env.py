"""`env`: versions, devices per rank, launcher variables and NCCL settings.

Fails when two ranks on one host use the same GPU, when ranks run different torch/CUDA/NCCL/Horovod
builds, or when a rank sees another world size than the one launched (under Horovod: `hvd.size()`).
Warns on NCCL settings that turn off a fast transport. Planted fault: `same-gpu` (every rank on
GPU 0); it can only be observed on GPUs, so on CPU the verdict is tested on recorded evidence.
The Horovod worker records the same evidence with this `run` (its world size is `hvd.size()`).
"""

from __future__ import annotations

import os
import socket
from typing import Any

from distdoctor.probe.checks import Check, Evidence
from distdoctor.probe.report import CheckResult

ID = "env"
FAULTS = ("same-gpu",)
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                 "MASTER_PORT", "TORCHELASTIC_RUN_ID", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS",
                 "SLURM_JOB_ID", "SLURM_PROCID")
# NCCL settings that switch a transport off: legitimate for debugging, slow when forgotten.
SLOWING_NCCL = {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1", "NCCL_SHM_DISABLE": "1"}


def run(ctx) -> dict[str, Any]:
    import importlib.metadata

    import torch

    evidence: dict[str, Any] = {
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "backend": ctx.backend,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "launcher": {name: os.environ[name] for name in LAUNCHER_VARS if name in os.environ},
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }
    try:
        evidence["horovod"] = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        evidence["horovod"] = None
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        evidence["gpu_name"] = props.name
        evidence["gpu_uuid"] = str(getattr(props, "uuid", "")) or None
        nccl = torch.cuda.nccl.version()
        evidence["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    else:
        evidence["nccl"] = None
    return evidence


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    shown = {str(r): ev for r, ev in sorted(ranks.items())}
    problems: list[str] = []
    gpus: dict[tuple[str, str], list[int]] = {}
    for rank, ev in sorted(ranks.items()):
        if str(ev.get("device", "cpu")).startswith("cuda"):
            key = ev.get("gpu_uuid") or ev["device"]
            gpus.setdefault((ev.get("host", "?"), key), []).append(rank)
    for (host, gpu), sharing in sorted(gpus.items()):
        if len(sharing) > 1:
            problems.append(f"ranks {', '.join(map(str, sharing))} share one GPU ({gpu}) on {host}")
    seen = sorted({ev["world_size"] for ev in ranks.values() if "world_size" in ev} - {world_size})
    if seen:
        what = "hvd.size()" if evidence.framework == "horovod" else "WORLD_SIZE"
        problems.append(f"ranks disagree on {what}: {', '.join(map(str, seen))} instead of {world_size}")
    for key in ("torch", "cuda", "nccl") + (("horovod",) if evidence.framework == "horovod" else ()):
        builds = {str(ev.get(key)) for ev in ranks.values()}
        if len(builds) > 1:
            problems.append(f"ranks run different {key} versions: {', '.join(sorted(builds))}")
    if problems:
        return CheckResult(ID, "fail", "; ".join(problems), shown, {"problems": problems})
    slowing = sorted({f"{k}={v}" for ev in ranks.values() for k, v in ev.get("nccl_env", {}).items()
                      if SLOWING_NCCL.get(k) == v})
    first = ranks[min(ranks)] if ranks else {}
    what = f"torch {first.get('torch')}, {world_size} ranks on {first.get('device', '?').split(':')[0]}"
    if first.get("nccl"):
        what += f", NCCL {first['nccl']}"
    if evidence.framework == "horovod":
        what += f", Horovod {first.get('horovod')} (Gloo controller)"
    if slowing:
        return CheckResult(ID, "warn", f"{what}; transports disabled: {', '.join(slowing)}", shown,
                           {"slowing_nccl": slowing})
    return CheckResult(ID, "pass", f"{what}; one device per rank, same builds", shown, {})


CHECK = Check(
    id=ID,
    title="versions, devices per rank, launcher variables and NCCL settings",
    probe="builtin",
    frameworks=("torch", "horovod"),
    needs=("torch", "device"),
    verdict=verdict,
    faults=FAULTS,
    order=0,
    run=run,
)
