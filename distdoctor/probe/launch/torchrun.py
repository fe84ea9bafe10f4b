"""Start ranks through torchrun (`torch.distributed.run`), bounded in time, leaving nothing behind.

torchrun is the engine: it does the rendezvous, starts one process per rank, watches them and
tears the group down when one fails. This module only wraps it so that a probe can rely on three
things torchrun alone does not promise:

- a wall-clock limit for the whole launch (a stalled collective must not hang the probe);
- no process survives, on timeout or on Ctrl-C: torchrun starts every worker in a session of its
  own, so killing torchrun's process group is not enough and the workers are tracked and killed
  one by one;
- per-rank exit codes and tracebacks, read back from torchrun's failure summary, its `--log-dir`
  (`--redirects`) files and the per-rank error files written by `@record`.

The first two hold for any launcher that starts ranks in sessions of their own: `run_process_tree`
is also what `distdoctor.probe.launch.horovodrun` runs horovodrun with, and `LaunchResult` what it returns.

It never imports torch in the launcher process: torchrun runs as a child.
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# Environment variable that tells ranks how long one collective may wait before it raises.
COLLECTIVE_TIMEOUT_ENV = "DISTDOCTOR_COLLECTIVE_TIMEOUT_S"
# How many training steps the ranks run, for every probe and launcher (the script probe: optimizer
# steps, 0 to let the script finish).
STEPS_ENV = "DISTDOCTOR_STEPS"
# The id all nodes of one multi-node launch agree on (c10d rendezvous needs the same on each).
DEFAULT_RDZV_ID = "distdoctor"
# How long ranks get to exit after SIGTERM before SIGKILL.
TERMINATE_GRACE_S = 3.0
_POLL_S = 0.25


class LaunchError(Exception):
    """A launch that cannot start, with a message meant for the user (no traceback)."""


@dataclass(frozen=True)
class LaunchSpec:
    """Where and how many ranks torchrun starts, and how long they may run."""

    nproc: int
    backend: str
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    timeout_s: float = 120.0
    env: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class TreeRun:
    """How one bounded run of a launcher's process tree ended, and everything it printed."""

    returncode: int  # -SIGKILL when the launcher had to be killed
    timed_out: bool
    interrupted: bool
    duration_s: float
    output: str


@dataclass(frozen=True)
class LaunchResult:
    """What one launch (torchrun, or horovodrun: `launcher`) did, as far as this process could observe it.

    `rank_exitcodes` and `rank_errors` are keyed by global rank as the launcher reports it (torchrun
    in its failure summary; on one node, global rank == local rank). A timed-out or interrupted
    launch has the ranks killed by this module, so their exit codes are not the launcher's to report.
    """

    returncode: int
    timed_out: bool
    interrupted: bool
    duration_s: float
    rank_exitcodes: dict[int, int]
    rank_errors: dict[int, str]
    output: str
    launcher: str = "torchrun"
    # Several nodes: this node and the rendezvous it had to reach, to name them when it could not.
    node_rank: int = 0
    rdzv_endpoint: str | None = None

    @classmethod
    def of(cls, run: TreeRun, rank_exitcodes: dict[int, int], rank_errors: dict[int, str], launcher: str,
           spec: LaunchSpec | None = None) -> LaunchResult:
        """The result of `run`, with the per-rank outcome the launcher's own output and logs give."""
        return cls(run.returncode, run.timed_out, run.interrupted, run.duration_s, rank_exitcodes, rank_errors,
                   run.output, launcher, spec.node_rank if spec else 0, spec.rdzv_endpoint if spec else None)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.interrupted

    def failure_message(self) -> str:
        """One paragraph saying why the launch did not succeed ('' when it did)."""
        if self.ok:
            return ""
        if self.interrupted:
            return "interrupted (Ctrl-C): every rank was stopped"
        if self.timed_out:
            # A torchrun launch has always been "the launch" to the user; another launcher is named.
            who = "the launch" if self.launcher == "torchrun" else self.launcher
            return f"{who} ran past its wall-clock limit after {self.duration_s:.1f} s: every rank was stopped"
        # The port hint names torchrun's --rdzv-endpoint: horovodrun picks its own ports.
        port_error = port_in_use_message(self.output) if self.launcher == "torchrun" else ""
        if port_error:
            return port_error
        if self.rdzv_endpoint and _RENDEZVOUS_FAILED.search(self.output):
            return (f"node {self.node_rank} could not rendezvous at {self.rdzv_endpoint}: is node 0 started with "
                    "the same --nnodes and --rdzv-endpoint, and is that address reachable from here?")
        failed = {rank: code for rank, code in self.rank_exitcodes.items() if code != 0}
        if failed:
            parts = [f"rank {rank} exited with {describe_exitcode(code)}" for rank, code in sorted(failed.items())]
            return f"{self.launcher} failed: " + "; ".join(parts)
        return f"{self.launcher} exited with status {self.returncode}"


def describe_exitcode(code: int) -> str:
    """'exit code 1' or 'signal 15 (SIGTERM)' for a negative code, as Popen reports signals."""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        return f"signal {-code} ({name})"
    return f"exit code {code}"


def torchrun_command(spec: LaunchSpec, target: Sequence[str]) -> list[str]:
    """The torchrun command line for `spec`, ending with `target`.

    `target` is `["script.py", *args]` or `["-m", "pkg.mod", *args]`. Output redirection and the
    log directory are added by `launch`, not here, so this is also the command a user can run.
    """
    if spec.nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {spec.nproc}")
    if spec.nnodes < 1 or not 0 <= spec.node_rank < spec.nnodes:
        raise LaunchError(f"node rank {spec.node_rank} is not in 0..{spec.nnodes - 1}")
    if not target:
        raise LaunchError("nothing to launch: the target is empty")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={spec.nproc}"]
    if spec.rdzv_endpoint is None:
        if spec.nnodes > 1:
            raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every node)")
        cmd.append("--standalone")
    else:
        _split_endpoint(spec.rdzv_endpoint)
        cmd += [
            f"--nnodes={spec.nnodes}",
            f"--node-rank={spec.node_rank}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint={spec.rdzv_endpoint}",
            f"--rdzv-id={DEFAULT_RDZV_ID}",
            # Node 0 hosts the rendezvous store because it is node 0, not because torchrun matched
            # the endpoint to one of its host names (an IP address or an alias does not match), and
            # a node that cannot join says so well inside the probe's wall clock.
            f"--rdzv-conf=is_host={int(spec.node_rank == 0)},join_timeout={rendezvous_timeout_s(spec.timeout_s)},"
            f"read_timeout={store_timeout_s(spec.timeout_s)}",
        ]
    # One attempt: a probe reports a failure, it does not hide it behind a restart.
    cmd.append("--max-restarts=0")
    cmd += list(target)
    return cmd


def launch(
    spec: LaunchSpec,
    target: Sequence[str],
    *,
    log_dir: Path | None = None,
    echo: bool = False,
) -> LaunchResult:
    """Run `target` on `spec.nproc` ranks through torchrun and wait, at most `spec.timeout_s`.

    Every rank's output is teed by torchrun into `log_dir` (a temporary directory when None, removed
    afterwards) and combined, prefixed by rank, into `LaunchResult.output`; `echo` also streams it to
    stderr. Raises `LaunchError` only when the launch cannot start (bad spec, port in use).
    """
    cmd = torchrun_command(spec, target)
    _check_rendezvous_port(spec)
    own_log_dir = log_dir is None
    logs = Path(tempfile.mkdtemp(prefix="distdoctor-launch-")) if log_dir is None else Path(log_dir)
    logs.mkdir(parents=True, exist_ok=True)
    # torchrun's options go before the target; insert them just after "torch.distributed.run".
    cmd[3:3] = [f"--log-dir={logs}", "--redirects=3", "--tee=3"]
    env = dict(os.environ)
    env.update(spec.env)
    env.setdefault(COLLECTIVE_TIMEOUT_ENV, f"{collective_timeout_s(spec.timeout_s):.1f}")
    env.setdefault("PYTHONUNBUFFERED", "1")
    try:
        run = run_process_tree(cmd, env, spec.timeout_s, echo=echo)
        rank_exitcodes = _exitcodes_from_summary(run.output)
        if run.returncode == 0 and not (run.timed_out or run.interrupted) and spec.nnodes == 1:
            rank_exitcodes = {rank: 0 for rank in range(spec.nproc)}
        return LaunchResult.of(run, rank_exitcodes, _rank_errors(logs, run.output, spec), "torchrun", spec)
    finally:
        if own_log_dir:
            shutil.rmtree(logs, ignore_errors=True)


def rendezvous_timeout_s(timeout_s: float) -> int:
    """How long nodes wait for each other at the rendezvous: a share of the wall clock, so a node
    that cannot be reached is reported before the whole probe times out."""
    return int(max(10.0, min(120.0, timeout_s * 0.4)))


def store_timeout_s(timeout_s: float) -> int:
    """The rendezvous store's connect timeout. torchrun's store client tries twice, with a random
    back-off of up to the timeout between the tries, so an unreachable node 0 costs up to twice this:
    half the rendezvous share keeps that failure inside the wall clock even on a loaded machine."""
    return int(max(5.0, rendezvous_timeout_s(timeout_s) / 2))


def collective_timeout_s(timeout_s: float) -> float:
    """The per-collective timeout for ranks: well inside the wall clock, so a stall is attributed.

    The ranks need time to start (import torch, rendezvous) before their first collective, and after
    a collective times out the error must still reach torchrun and this launcher.
    """
    return max(2.0, min(timeout_s * 0.5, timeout_s - 15.0))


def run_process_tree(cmd: list[str], env: Mapping[str, str], timeout_s: float, *, echo: bool = False) -> TreeRun:
    """Run the launcher `cmd` and wait, at most `timeout_s`; then leave no process it started alive.

    The launcher runs in a session of its own, so that Ctrl-C in the terminal reaches this process,
    which stops the ranks itself. Launchers (torchrun, horovodrun) start each rank in yet another
    session, so every process seen below the launcher is tracked while it runs and stopped one by
    one (SIGTERM, then SIGKILL after TERMINATE_GRACE_S) on timeout, on Ctrl-C and after a normal
    exit. stdout and stderr are combined into `output`; `echo` also streams them to stderr.
    """
    start = time.monotonic()
    chunks: list[str] = []
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Ctrl-C in the terminal reaches us, not the ranks: we stop them.
    )
    reader = threading.Thread(target=_pump, args=(proc.stdout, chunks, echo), daemon=True)
    reader.start()
    tracked: dict[int, int] = {}  # pid -> start time, of the launcher and everything it started
    timed_out = interrupted = False
    try:
        while True:
            tracked.update(_descendants(proc.pid))
            try:
                proc.wait(timeout=_POLL_S)
                break
            except subprocess.TimeoutExpired:
                if time.monotonic() - start > timeout_s:
                    timed_out = True
                    break
    except KeyboardInterrupt:
        interrupted = True
    finally:
        tracked.update(_descendants(proc.pid))
        _terminate(proc, tracked)
        reader.join(timeout=5.0)
    return TreeRun(
        returncode=proc.returncode if proc.returncode is not None else -signal.SIGKILL,
        timed_out=timed_out,
        interrupted=interrupted,
        duration_s=time.monotonic() - start,
        output="".join(chunks),
    )


def _pump(stream, chunks: list[str], echo: bool) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace")
        chunks.append(line)
        if echo:
            sys.stderr.write(line)
            sys.stderr.flush()
    stream.close()


# --- process tree ------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time) of a live process, from /proc; None when gone or not Linux."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode("ascii", errors="replace")
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    fields = data[data.rfind(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[1]), int(fields[19])


def _descendants(root: int) -> dict[int, int]:
    """pid -> start time of `root` and every live process below it (Linux /proc; {} elsewhere)."""
    try:
        pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    except OSError:
        return {}
    children: dict[int, list[int]] = {}
    starts: dict[int, int] = {}
    for pid in pids:
        stat = _proc_stat(pid)
        if stat is not None:
            children.setdefault(stat[0], []).append(pid)
            starts[pid] = stat[1]
    found: dict[int, int] = {}
    todo = [root]
    while todo:
        pid = todo.pop()
        if pid in starts and pid not in found:
            found[pid] = starts[pid]
            todo.extend(children.get(pid, []))
    return found


def _alive(tracked: dict[int, int]) -> list[int]:
    # A pid is the same process only if its start time matches: pids are reused.
    return [pid for pid, started in tracked.items() if (stat := _proc_stat(pid)) is not None and stat[1] == started]


def _signal_all(proc: subprocess.Popen, pids: list[int], sig: int) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except OSError:
            pass
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


def _terminate(proc: subprocess.Popen, tracked: dict[int, int]) -> None:
    """Stop the launcher and every process it started: SIGTERM, then SIGKILL after a grace period."""
    survivors = _alive(tracked)
    if proc.poll() is None or survivors:
        _signal_all(proc, survivors, signal.SIGTERM)
        deadline = time.monotonic() + TERMINATE_GRACE_S
        while time.monotonic() < deadline:
            proc.poll()
            survivors = _alive(tracked)
            if proc.returncode is not None and not survivors:
                break
            time.sleep(0.05)
        survivors = _alive(tracked)
        if proc.poll() is None or survivors:
            _signal_all(proc, survivors, signal.SIGKILL)
    try:
        proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL cannot be ignored
        pass


# --- rendezvous port --------------------------------------------------------------------------


def _split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise LaunchError(f"--rdzv-endpoint must be HOST:PORT, got {endpoint!r}")
    return host.strip("[]"), int(port)


def _is_local_host(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        address = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return False
    if address.is_loopback:
        return True
    try:
        local = {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        return False
    return str(address) in local


def _check_rendezvous_port(spec: LaunchSpec) -> None:
    """Fail early, with a message, when node 0 would host the rendezvous on a port already taken.

    Only node 0 checks: the other nodes are expected to find that port open by node 0's store.
    """
    if spec.rdzv_endpoint is None or spec.node_rank != 0:
        return
    host, port = _split_endpoint(spec.rdzv_endpoint)
    if not _is_local_host(host):
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: only a listening socket makes bind fail, not connections in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as exc:
            raise LaunchError(
                f"port {port} of --rdzv-endpoint {spec.rdzv_endpoint} is already in use ({exc.strerror}): "
                "choose a free port, or stop what listens there"
            ) from None


_RENDEZVOUS_FAILED = re.compile(r"RendezvousTimeoutError|RendezvousConnectionError|RendezvousClosedError|"
                                r"connection to the C10d store has failed", re.IGNORECASE)
_PORT_IN_USE = re.compile(r"(address already in use|EADDRINUSE)", re.IGNORECASE)


def port_in_use_message(output: str) -> str:
    """A clear message when torchrun's output shows its rendezvous store could not bind."""
    if _PORT_IN_USE.search(output):
        return "the rendezvous port is already in use: choose another --rdzv-endpoint port"
    return ""


# --- per-rank results ---------------------------------------------------------------------------

_SUMMARY_ENTRY = re.compile(
    r"rank\s*:\s*(?P<rank>\d+)\s*\(local_rank:\s*(?P<local>\d+)\)\s*\n\s*exitcode\s*:\s*(?P<code>-?\d+)"
)


def _exitcodes_from_summary(output: str) -> dict[int, int]:
    return {int(m["rank"]): int(m["code"]) for m in _SUMMARY_ENTRY.finditer(output)}


def _local_to_global(output: str, spec: LaunchSpec) -> dict[int, int]:
    mapping = {local: local + spec.node_rank * spec.nproc for local in range(spec.nproc)}
    mapping.update({int(m["local"]): int(m["rank"]) for m in _SUMMARY_ENTRY.finditer(output)})
    return mapping


def _rank_errors(logs: Path, output: str, spec: LaunchSpec) -> dict[int, str]:
    """Traceback per global rank: the `@record` error file if any, else the rank's stderr log."""
    to_global = _local_to_global(output, spec)
    errors: dict[int, str] = {}
    for attempt in sorted(logs.glob("*/attempt_*")):
        for rank_dir in attempt.iterdir():
            if not rank_dir.name.isdigit():
                continue
            text = _error_file_text(rank_dir / "error.json") or last_traceback(rank_dir / "stderr.log")
            if text:
                local = int(rank_dir.name)
                errors[to_global.get(local, local)] = text
    return errors


def _error_file_text(path: Path) -> str:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return ""
    message = data.get("message", {})
    if isinstance(message, dict):
        extra = message.get("extraInfo", {})
        return str(extra.get("py_callstack") or message.get("message") or "")
    return str(message)


def last_traceback(path: Path) -> str:
    """The last Python traceback in the log file `path` ('' when it has none or cannot be read)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    start = text.rfind("Traceback (most recent call last):")
    return text[start:].strip() if start >= 0 else ""
