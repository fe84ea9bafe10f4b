"""Finding the training jobs on this machine, and each rank's identity, from /proc.

A rank is a Python process whose environment names its rank (what the launcher set before exec):
torchrun's workers (RANK, LOCAL_RANK, WORLD_SIZE, GROUP_RANK, TORCHELASTIC_RUN_ID), Horovod's ranks
(HOROVOD_RANK...), MPI ranks (OMPI_COMM_WORLD_RANK, PMI_RANK), Slurm tasks (SLURM_PROCID...), or
any launcher that sets RANK and WORLD_SIZE. torch.multiprocessing.spawn children carry no rank in
their environment: they are found by their command line (`multiprocessing.spawn`) under a parent
that is not a rank, and their index is read from their stack afterwards. A process below a rank
with the same identity (a DataLoader worker, a compile worker) is that rank's child, not a rank.
Launchers (torchrun's agent, horovodrun, mpirun, srun) are never ranks themselves; a PID given by
the user may be a rank, a rank's child, or any ancestor of ranks (an agent, a launcher, a shell).
"""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from distdoctor.probe.stacks.flight import dump_path

PROC = "/proc"
_PYTHON = re.compile(r"python|pypy|pt_main_thread|pt_elastic", re.I)
_LAUNCHERS = ("torch.distributed.run", "torch.distributed.launch", "torchrun", "horovodrun", "mpirun", "mpiexec", "srun",
              "accelerate", "deepspeed", "deepspeed.launcher.launch")


class DiscoveryError(Exception):
    """A PID that cannot be diagnosed (exit status 2 in the CLI)."""


@dataclass
class Proc:
    pid: int
    ppid: int
    uid: int
    state: str
    comm: str
    argv: tuple[str, ...]
    env: dict[str, str] | None = None
    env_error: str | None = None

    @property
    def is_python(self) -> bool:
        first = os.path.basename(self.argv[0]) if self.argv else ""
        return bool(_PYTHON.search(first) or _PYTHON.search(self.comm))

    @property
    def is_launcher(self) -> bool:
        words = self.argv[:4]
        return any(any(name == w or w.endswith("/" + name) or w == name for w in words) for name in _LAUNCHERS)

    @property
    def is_spawn_child(self) -> bool:
        joined = " ".join(self.argv)
        return "multiprocessing.spawn" in joined or "--multiprocessing-fork" in joined

    @property
    def command(self) -> str:
        return " ".join(self.argv) or f"[{self.comm}]"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def read_proc(pid: int, root: str = PROC, with_env: bool = True) -> Proc | None:
    """One process from /proc, or None when it is gone. The environment is read for Python processes."""
    base = f"{root}/{pid}"
    try:
        stat = _read(f"{base}/stat").decode(errors="replace")
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        state, ppid = fields[0], int(fields[1])
        argv = tuple(a.decode(errors="replace") for a in _read(f"{base}/cmdline").split(b"\0") if a)
        uid = 0
        for line in _read(f"{base}/status").decode(errors="replace").splitlines():
            if line.startswith("Uid:"):
                uid = int(line.split()[1])
                break
    except (OSError, ValueError, IndexError):
        return None
    proc = Proc(pid, ppid, uid, state, comm, argv)
    if with_env and proc.is_python:
        try:
            raw = _read(f"{base}/environ")
            proc.env = dict(item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item)
        except PermissionError:
            proc.env_error = "permission"
        except OSError:
            proc.env_error = "gone"
    return proc


def process_table(root: str = PROC) -> dict[int, Proc]:
    table = {}
    try:
        names = os.listdir(root)
    except OSError as exc:
        raise DiscoveryError(f"cannot list {root}: {exc} (distdoctor stacks needs Linux /proc)") from None
    for name in names:
        if name.isdigit():
            proc = read_proc(int(name), root)
            if proc is not None and proc.state != "Z":
                table[proc.pid] = proc
    return table


@dataclass(frozen=True)
class Identity:
    """Who a rank is, from its environment: the launcher, the job it belongs to, rank numbers."""

    launcher: str
    job: str
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    node_rank: int | None = None
    host: str = ""


def _int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "").strip()
        if re.fullmatch(r"-?\d+", value):
            return int(value)
    return None


def hostname() -> str:
    return socket.gethostname()


def identity_of(proc: Proc, host: str | None = None) -> Identity | None:
    """The rank identity in a Python process's environment; None for a launcher or a plain process."""
    env = proc.env
    if not env or not proc.is_python or proc.is_launcher:
        return None
    host = host or hostname()
    endpoint = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    if "TORCHELASTIC_RUN_ID" in env and "RANK" in env:
        return Identity("torchrun", f"torchrun:{env['TORCHELASTIC_RUN_ID']}@{endpoint}", _int(env, "RANK"),
                        _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE"), _int(env, "GROUP_RANK"), host)
    if "HOROVOD_RANK" in env:
        where = f"{env.get('HOROVOD_GLOO_RENDEZVOUS_ADDR', '')}:{env.get('HOROVOD_GLOO_RENDEZVOUS_PORT', '')}"
        return Identity("horovod", f"horovod:{where}", _int(env, "HOROVOD_RANK"), _int(env, "HOROVOD_LOCAL_RANK"),
                        _int(env, "HOROVOD_SIZE"), _int(env, "HOROVOD_CROSS_RANK"), host)
    if "OMPI_COMM_WORLD_RANK" in env:
        job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_hnp_uri", "")
        return Identity("mpi", f"mpi:{job}", _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                        _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_NODE_RANK"), host)
    if "PMI_RANK" in env:
        return Identity("mpi", f"mpi:{env.get('PMI_PORT') or env.get('PMI_FD') or env.get('HYDI_CONTROL_FD', '')}",
                        _int(env, "PMI_RANK"), _int(env, "MPI_LOCALRANKID"), _int(env, "PMI_SIZE"), None, host)
    if "SLURM_PROCID" in env and "SLURM_JOB_ID" in env:
        return Identity("slurm", f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}", _int(env, "SLURM_PROCID"),
                        _int(env, "SLURM_LOCALID"), _int(env, "SLURM_NTASKS", "SLURM_NPROCS"), _int(env, "SLURM_NODEID"),
                        env.get("SLURMD_NODENAME") or host)
    if "RANK" in env and "WORLD_SIZE" in env:
        return Identity("env", f"env:{endpoint}", _int(env, "RANK"), _int(env, "LOCAL_RANK"), _int(env, "WORLD_SIZE"),
                        _int(env, "GROUP_RANK", "NODE_RANK"), host)
    return None


@dataclass
class RankProc:
    """A rank found on this machine: its process, identity, and its own child processes."""

    pid: int
    identity: Identity
    children: list[int] = field(default_factory=list)
    flight_dump: str | None = None  # where its Flight Recorder dump would be written
    started_at: float = 0.0  # seconds since the epoch


def started_at(pid: int, root: str = PROC) -> float:
    """When a process started (seconds since the epoch), 0.0 when unknown."""
    try:
        ticks = int(_read(f"{root}/{pid}/stat").decode().rsplit(")", 1)[1].split()[19])
        boot = next(int(line.split()[1]) for line in _read(f"{root}/stat").decode().splitlines() if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return 0.0


@dataclass
class Job:
    key: str
    launcher: str
    ranks: list[RankProc]
    agents: list[int] = field(default_factory=list)  # torchrun agents / launchers above the ranks

    @property
    def world_size(self) -> int | None:
        sizes = {r.identity.world_size for r in self.ranks if r.identity.world_size is not None}
        return max(sizes) if sizes else None


def _ancestors(table: dict[int, Proc], pid: int) -> Iterable[int]:
    seen = set()
    parent = table[pid].ppid if pid in table else 0
    while parent in table and parent not in seen:
        seen.add(parent)
        yield parent
        parent = table[parent].ppid


def _ranks(table: dict[int, Proc], host: str) -> tuple[dict[int, Identity], dict[int, int]]:
    """(pid -> identity of every rank, pid -> rank pid of every rank's child process)."""
    ids: dict[int, Identity] = {}
    for pid, proc in table.items():
        identity = identity_of(proc, host)
        if identity is not None:
            ids[pid] = identity
    # torch.multiprocessing.spawn children: no rank in the environment; index read from the stack later.
    # A spawn child above ranks found by their environment is a launcher's helper, not a rank
    # (horovodrun starts each slot's `sh -c env HOROVOD_RANK=... python` from a multiprocessing child).
    above_ranks = {ancestor for pid in ids for ancestor in _ancestors(table, pid)}
    for pid, proc in table.items():
        if pid in ids or pid in above_ranks or not proc.is_python or not proc.is_spawn_child:
            continue
        parent = table.get(proc.ppid)
        if parent is None or proc.ppid in ids or not parent.is_python or parent.is_spawn_child:
            continue
        env = proc.env or {}
        ids[pid] = Identity("mp.spawn", f"mp.spawn:{proc.ppid}", None, None, _int(env, "WORLD_SIZE"), None, host)
    children: dict[int, int] = {}
    for pid, identity in list(ids.items()):
        for ancestor in _ancestors(table, pid):
            if ancestor in ids and (ids[ancestor].job == identity.job or identity.launcher == "mp.spawn"):
                children[pid] = ancestor
                break
    for pid in children:
        ids.pop(pid, None)
    # A child of a child (a worker's own subprocess) belongs to the rank above both.
    for pid, proc in table.items():
        if pid in ids or pid in children:
            continue
        for ancestor in _ancestors(table, pid):
            if ancestor in ids:
                children[pid] = ancestor
                break
    return ids, children


def _jobs(table: dict[int, Proc], ids: dict[int, Identity], children: dict[int, int], rank_pids: Iterable[int],
          root: str = PROC) -> list[Job]:
    jobs: dict[str, Job] = {}
    for pid in sorted(set(rank_pids)):
        identity = ids[pid]
        job = jobs.setdefault(identity.job, Job(identity.job, identity.launcher, []))
        job.ranks.append(RankProc(pid, identity, sorted(c for c, r in children.items() if r == pid),
                                  dump_path(table[pid].env or {}, identity.rank), started_at(pid, root)))
        for ancestor in _ancestors(table, pid):
            if table[ancestor].is_launcher and ancestor not in job.agents:
                job.agents.append(ancestor)
    for job in jobs.values():
        job.ranks.sort(key=lambda r: (r.identity.rank if r.identity.rank is not None else 1 << 30, r.pid))
    return sorted(jobs.values(), key=lambda j: min(r.pid for r in j.ranks))


def find_jobs(pids: Sequence[int] = (), root: str = PROC, host: str | None = None) -> list[Job]:
    """The jobs on this machine (no `pids`), or the jobs of the given PIDs. Raises DiscoveryError."""
    host = host or hostname()
    table = process_table(root)
    ids, children = _ranks(table, host)
    if not pids:
        jobs = _jobs(table, ids, children, ids, root)
        hidden = [p for p in table.values() if p.env_error == "permission"]
        if not jobs and hidden:
            raise DiscoveryError(f"no training job found, and the environment of {len(hidden)} Python process"
                                 f"{'es' if len(hidden) != 1 else ''} of other users could not be read "
                                 f"(e.g. pid {hidden[0].pid}, uid {hidden[0].uid}): run distdoctor as that user or as root")
        return jobs
    chosen: set[int] = set()
    for pid in pids:
        chosen |= _ranks_for(pid, table, ids, children, root)
    # A rank given by itself stands for its job's ranks under the same launcher (its node's part
    # of the job: on a machine that runs two torchrun agents of one job, each agent is a node).
    wanted = {(ids[p].job, _launcher_of(table, p)) for p in chosen if p in ids}
    everyone = [p for p, identity in ids.items() if (identity.job, _launcher_of(table, p)) in wanted]
    plain = [p for p in chosen if p not in ids]
    jobs = _jobs(table, ids, children, everyone, root)
    for pid in sorted(plain):  # a Python process with no rank identity: read as it is
        jobs.append(Job(f"process:{pid}", "process", [RankProc(pid, Identity("process", f"process:{pid}", host=host), [])]))
    return jobs


def _launcher_of(table: dict[int, Proc], pid: int) -> int | None:
    """The nearest launcher (torchrun agent, horovodrun, mpirun, srun) above a rank, if any."""
    return next((a for a in _ancestors(table, pid) if table[a].is_launcher), None)


def _ranks_for(pid: int, table: dict[int, Proc], ids: dict[int, Identity], children: dict[int, int], root: str) -> set[int]:
    if pid <= 0:
        raise DiscoveryError(f"{pid} is not a process id")
    proc = table.get(pid)
    if proc is None:
        alive = read_proc(pid, root, with_env=False)
        if alive is not None and alive.state == "Z":
            raise DiscoveryError(f"pid {pid} has exited (a zombie: {alive.command})")
        raise DiscoveryError(f"no process with pid {pid} on this machine")
    if pid in ids:
        return {pid}
    if pid in children:
        return {children[pid]}
    below = {p for p in ids if pid in _ancestors(table, p)}
    if below:
        return below
    if proc.env_error == "permission":
        raise DiscoveryError(f"cannot read the environment of pid {pid} ({proc.command}), owned by uid {proc.uid}: "
                             "run distdoctor as that user or as root")
    if proc.is_python:
        return {pid}
    raise DiscoveryError(f"pid {pid} ({proc.command}) is not a Python process and runs no training ranks")
