"""Reading live Python stacks with py-spy (an optional extra: `pip install 'distdoctor[stacks]'`).

`py-spy dump --nonblocking` reads the target's memory (process_vm_readv) without attaching to it:
the job is never stopped, signalled or traced, so nothing in it can change course (no EINTR in a
gloo or NCCL socket wait, no stall of a rank in the middle of a collective). The price is that a
rank that is running while it is read may give a torn stack or torn locals; the ranks that matter
here are the stuck ones, whose stacks do not move, and the verdict compares several samples anyway.
Measured on this project's CPU jobs: over 10 non-blocking reads of a busy rank, every stack was
right (same frames and lines as the code ran) and 4 of 10 had one torn local ('?' or a stale
value); a blocking read stops every thread of the rank (ptrace) for the time of the read: 20 reads
of a busy loop, 0.2 s apart, on a loaded 2-core machine, raised the loop's 10th-longest stall to
40 ms (52 ms at most), against 24 ms with non-blocking reads and 16 ms with none.
Native frames (`--native`) need the blocking read: they are read once, only for a rank that waits
inside backward where the Python stack cannot say whether DDP's gradient all-reduce is what it
waits on (the C++ reducer shows it), and `--no-native` turns even that off.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from distdoctor.probe.stacks.analysis import Frame

EXITED, PERMISSION, NOT_PYTHON, TIMEOUT, FAILED = "exited", "permission", "not-python", "timeout", "failed"

PTRACE_HINT = (
    "run distdoctor as the job's user or as root; in a container, add the SYS_PTRACE capability "
    "(`docker run --cap-add SYS_PTRACE`, Kubernetes `securityContext.capabilities.add: [\"SYS_PTRACE\"]`); "
    "where /proc/sys/kernel/yama/ptrace_scope is above 0, run as root or set it to 0"
)


INSTALL = "Install it with `pip install 'distdoctor[stacks]'` (or `pip install py-spy`)."


class SamplerMissing(Exception):
    """py-spy cannot be found (exit status 2 in the CLI)."""


@dataclass(frozen=True)
class ThreadStack:
    name: str
    tid: int
    active: bool | None
    frames: tuple[Frame, ...]


@dataclass
class Read:
    """One py-spy read of one process: its threads, or why there are none."""

    pid: int
    threads: list[ThreadStack] = field(default_factory=list)
    error: str | None = None
    kind: str | None = None  # EXITED, PERMISSION, NOT_PYTHON, TIMEOUT, FAILED

    def main_thread(self) -> ThreadStack | None:
        for thread in self.threads:
            if thread.tid == self.pid:
                return thread
        named = [t for t in self.threads if t.name == "MainThread"]
        return named[0] if named else (self.threads[0] if self.threads else None)


def find_py_spy(explicit: str | None = None) -> str:
    """The py-spy binary: `explicit`, $DISTDOCTOR_PY_SPY, PATH, or beside this Python (a venv not activated)."""
    candidates = [explicit, os.environ.get("DISTDOCTOR_PY_SPY"), shutil.which("py-spy"),
                  str(Path(sys.executable).parent / "py-spy")]
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
        if candidate and candidate in (explicit, os.environ.get("DISTDOCTOR_PY_SPY")):
            raise SamplerMissing(f"py-spy not found at {candidate} (no executable file there). {INSTALL}")
    raise SamplerMissing(f"py-spy is not installed: `distdoctor stacks` reads live stacks with it. {INSTALL}")


def py_spy_version(binary: str) -> str:
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10)
        return out.stdout.strip().replace("py-spy ", "") or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def parse_dump(text: str) -> list[ThreadStack]:
    """py-spy's `dump --json` output -> threads (frames innermost first). ValueError if it is not that."""
    data = json.loads(text)
    if not isinstance(data, list):
        raise ValueError("py-spy JSON is not a list of threads")
    threads = []
    for thread in data:
        frames = []
        for raw in thread.get("frames") or ():
            line = int(raw.get("line") or 0)
            native = line == 0 and raw.get("module") is not None
            locals_ = tuple((str(v.get("name")), str(v.get("repr"))) for v in raw.get("locals") or () if v.get("repr") is not None)
            frames.append(Frame(str(raw.get("name", "?")), str(raw.get("filename", "?")), line, locals_, native))
        active = thread.get("active")
        threads.append(ThreadStack(str(thread.get("thread_name") or ""), int(thread.get("os_thread_id") or thread.get("thread_id") or 0),
                                   bool(active) if active is not None else None, tuple(frames)))
    return threads


def _classify_error(pid: int, stderr: str) -> tuple[str, str]:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.strip()[0].isdigit()]
    message = next((ln for ln in lines if ln.startswith("Error:")), lines[0] if lines else "py-spy failed")
    low = stderr.lower()
    if not os.path.exists(f"/proc/{pid}") or "no such process" in low or "check that the process is running" in low:
        return EXITED, f"pid {pid} exited while it was being read"
    if "permission denied" in low or "operation not permitted" in low or "eperm" in low:
        return PERMISSION, f"no permission to read the memory of pid {pid}: {PTRACE_HINT}"
    if "python version" in low or "python interpreter" in low or "not a python" in low:
        return NOT_PYTHON, f"pid {pid} is not a Python process (py-spy: {message.removeprefix('Error: ')})"
    return FAILED, f"py-spy could not read pid {pid}: {message.removeprefix('Error: ')}"


def dump(binary: str, pid: int, timeout_s: float, native: bool = False, with_locals: bool = True) -> Read:
    """One read of one process; never raises for the process's own faults. A non-blocking read of a
    running rank can fail on memory that changed under it: such a failure is retried once."""
    read = _dump_once(binary, pid, timeout_s, native, with_locals)
    if read.kind == FAILED and os.path.exists(f"/proc/{pid}"):
        read = _dump_once(binary, pid, timeout_s, native, with_locals)
    return read


def _dump_once(binary: str, pid: int, timeout_s: float, native: bool, with_locals: bool) -> Read:
    cmd = [binary, "dump", "--pid", str(pid), "--json"]
    if with_locals:
        cmd.append("--locals")
    cmd.append("--native" if native else "--nonblocking")
    env = {k: v for k, v in os.environ.items() if k != "RUST_BACKTRACE"}
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        return Read(pid, error=f"pid {pid} did not answer within {timeout_s:g} s", kind=TIMEOUT)
    except OSError as exc:
        return Read(pid, error=f"cannot run py-spy ({binary}): {exc}", kind=FAILED)
    if out.returncode != 0:
        kind, message = _classify_error(pid, out.stderr)
        return Read(pid, error=message, kind=kind)
    try:
        return Read(pid, parse_dump(out.stdout))
    except (ValueError, TypeError, KeyError) as exc:
        if not os.path.exists(f"/proc/{pid}"):
            return Read(pid, error=f"pid {pid} exited while it was being read", kind=EXITED)
        return Read(pid, error=f"py-spy gave unreadable output for pid {pid}: {exc}", kind=FAILED)


def dump_many(binary: str, pids: Sequence[int], timeout_s: float, jobs: int, native: bool = False) -> dict[int, Read]:
    """Read every pid in parallel, at most `jobs` at a time, each bounded by `timeout_s`."""
    if not pids:
        return {}
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(pids)))) as pool:
        reads = pool.map(lambda pid: dump(binary, pid, timeout_s, native=native), pids)
        return dict(zip(pids, reads))
