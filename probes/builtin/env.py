"""`env`: versions, devices per rank, launcher variables and NCCL/Gloo settings, compared across nodes.

Fails when two ranks on one host use the same GPU, when ranks run different torch/CUDA/NCCL/Python
(/Horovod) builds, when a rank sees another world size than the one launched (under Horovod:
`hvd.size()`), or when nodes disagree on a network setting that must agree. Every difference names
the hosts and their values, and the ranks are listed per host. Warns on NCCL settings that turn off
a fast transport, and on an interface chosen on some hosts and left to guess on others. Planted
fault: `same-gpu` (every rank on GPU 0); it can only be observed on GPUs, so on CPU the verdict is
tested on recorded evidence; a network mismatch is planted for real in the two-host tests (one host
started with `NCCL_IB_DISABLE=1`). The Horovod worker records the same evidence with this `run`
(its world size is `hvd.size()`).

Which network settings must agree across nodes, and which may not:
- MUST AGREE (`AGREE`, a difference fails): those that choose the transport, the address family, the
  algorithm or the protocol. NCCL ranks connect to each other with what they chose, so a node on
  sockets (`NCCL_IB_DISABLE=1`, `NCCL_NET=Socket`) and a node on InfiniBand cannot connect, an IPv4
  node cannot reach an IPv6 listener (`NCCL_SOCKET_FAMILY`), and ranks that pick different
  algorithms, protocols or buffer sizes (`NCCL_ALGO`, `NCCL_PROTO`, `NCCL_BUFFSIZE`) hang or fail
  in the first collective. `NCCL_P2P_DISABLE` / `NCCL_SHM_DISABLE` / `NCCL_NET_GDR_LEVEL` only
  change a node's own transports, but one node left with a debugging switch its peers lack makes
  the whole job run at that node's speed: a difference is almost always a forgotten `export`.
  `GLOO_DEVICE_TRANSPORT` selects Gloo's transport (tcp, uv, ibverbs) and must agree likewise.
- PER HOST (`PER_HOST`, shown, never compared by value): interface and device names
  (`NCCL_SOCKET_IFNAME`, `GLOO_SOCKET_IFNAME`, `NCCL_IB_HCA`) name hardware of that host, and two
  hosts legitimately call their NICs eth0 and ens5. What is suspicious is a name given on some
  hosts and not on others: the unset hosts let NCCL/Gloo pick an interface themselves (docker0 and
  the like), which is a warning.
- Logging and debugging (`NCCL_DEBUG*`, ...) and everything else: shown, not compared.
"""

from __future__ import annotations

import os
import platform
import socket
from collections.abc import Mapping
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
# Network settings every node must give the same value (unset counts as a value): see the module doc.
AGREE = ("NCCL_NET", "NCCL_IB_DISABLE", "NCCL_SOCKET_FAMILY", "NCCL_ALGO", "NCCL_PROTO", "NCCL_BUFFSIZE",
         "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_NET_GDR_LEVEL", "GLOO_DEVICE_TRANSPORT")
# Names of this host's hardware: may differ, but set on some hosts and not on others is suspicious.
PER_HOST = ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", "NCCL_IB_HCA")
# Builds every rank must share, and how a finding names them.
VERSIONS = {"torch": "torch", "cuda": "CUDA", "nccl": "NCCL", "python": "Python"}


def run(ctx) -> dict[str, Any]:
    import importlib.metadata

    import torch

    evidence: dict[str, Any] = {
        "host": socket.gethostname(),
        "node": os.environ.get("GROUP_RANK"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "backend": ctx.backend,
        "world_size": ctx.world_size,
        "device": str(ctx.device),
        "launcher": {name: os.environ[name] for name in LAUNCHER_VARS if name in os.environ},
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
        "gloo_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("GLOO_")},
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


def _setting(ev: Mapping[str, Any], name: str) -> str | None:
    return {**ev.get("nccl_env", {}), **ev.get("gloo_env", {})}.get(name)


def hosts_of(ranks: Mapping[int, Mapping[str, Any]]) -> dict[str, list[int]]:
    """host -> its ranks, in rank order. Two nodes with one host name (containers) stay apart."""
    nodes: dict[tuple[str, str], list[int]] = {}
    for rank, ev in sorted(ranks.items()):
        nodes.setdefault((str(ev.get("host", "?")), str(ev.get("node") or "")), []).append(rank)
    names = [host for host, _ in nodes]
    return {(host if names.count(host) == 1 or not node else f"{host} (node {node})"): members
            for (host, node), members in nodes.items()}


def _ranks(members: list[int]) -> str:
    return f"rank {members[0]}" if len(members) == 1 else "ranks " + ", ".join(map(str, members))


def _per_host(ranks: Mapping[int, Mapping[str, Any]], hosts: dict[str, list[int]], value) -> dict[str, str]:
    """host -> the value its ranks have ('a / b' when its own ranks differ)."""
    out = {}
    for host, members in hosts.items():
        values = sorted({str(value(ranks[r])) for r in members})
        out[host] = " / ".join(values)
    return out


def _differ(what: str, by_host: dict[str, str], hosts: dict[str, list[int]], shown=lambda v: v) -> str:
    """'NCCL_IB_DISABLE differs across hosts: unset on node-a (rank 0), 1 on node-b (rank 1)'."""
    groups: dict[str, list[str]] = {}
    for host, value in by_host.items():
        groups.setdefault(value, []).append(host)
    parts = [f"{shown(value)} on " + ", ".join(f"{h} ({_ranks(hosts[h])})" for h in names)
             for value, names in groups.items()]
    return f"{what} differs across hosts: " + "; ".join(parts)


def verdict(evidence: Evidence) -> CheckResult:
    ranks, world_size = evidence.ranks, evidence.world_size
    shown = {str(r): ev for r, ev in sorted(ranks.items())}
    hosts = hosts_of(ranks)
    details: dict[str, Any] = {"ranks_per_host": hosts}
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
    versions = dict(VERSIONS, **({"horovod": "Horovod"} if evidence.framework == "horovod" else {}))
    for key, name in versions.items():
        builds = {str(ev.get(key)) for ev in ranks.values() if key in ev or key != "python"}
        if len(builds) <= 1:
            continue
        by_host = _per_host(ranks, hosts, lambda ev: ev.get(key))
        if len(set(by_host.values())) > 1:
            problems.append(_differ(f"{name} version", by_host, hosts))
        else:  # one host runs two builds
            problems.append(f"ranks run different {name} versions: {', '.join(sorted(builds))}")
    mismatched: dict[str, dict[str, str | None]] = {}
    if len(hosts) > 1:
        for name in AGREE:
            by_host = _per_host(ranks, hosts, lambda ev: _setting(ev, name))
            if len(set(by_host.values())) > 1:
                mismatched[name] = by_host
                problems.append(_differ(name, by_host, hosts, lambda v: "unset" if v == "None" else f"{name}={v}"))
    if mismatched:
        details["network_mismatch"] = mismatched
    if problems:
        return CheckResult(ID, "fail", "; ".join(problems), shown, {**details, "problems": problems})
    warnings: list[str] = []
    slowing = sorted({f"{k}={v}" for ev in ranks.values() for k, v in ev.get("nccl_env", {}).items()
                      if SLOWING_NCCL.get(k) == v})
    if slowing:
        details["slowing_nccl"] = slowing
        warnings.append(f"transports disabled: {', '.join(slowing)}")
    if len(hosts) > 1:
        for name in PER_HOST:
            unset = [h for h, members in hosts.items() if all(_setting(ranks[r], name) is None for r in members)]
            if unset and len(unset) < len(hosts):
                details.setdefault("interface_unset", {})[name] = unset
                warnings.append(f"{name} is set on {', '.join(h for h in hosts if h not in unset)} but not on "
                                f"{', '.join(unset)}, which picks its interface itself")
    first = ranks[min(ranks)] if ranks else {}
    what = f"torch {first.get('torch')}, {world_size} ranks on {first.get('device', '?').split(':')[0]}"
    if first.get("nccl"):
        what += f", NCCL {first['nccl']}"
    if evidence.framework == "horovod":
        what += f", Horovod {first.get('horovod')} (Gloo controller)"
    if len(hosts) > 1:
        what += " on " + "; ".join(f"{h}: {_ranks(m)}" for h, m in hosts.items())
    if warnings:
        return CheckResult(ID, "warn", f"{what}; {'; '.join(warnings)}", shown, details)
    agree = "; builds and network settings agree across hosts" if len(hosts) > 1 else ""
    return CheckResult(ID, "pass", f"{what}; one device per rank, same builds{agree}", shown, details)


CHECK = Check(
    id=ID,
    title="versions, devices per rank, launcher variables and NCCL/Gloo settings, compared across nodes",
    probe="builtin",
    frameworks=("torch", "horovod"),
    needs=("torch", "device"),
    verdict=verdict,
    faults=FAULTS,
    order=0,
    run=run,
)
