"""Follow a probed job while it runs and end it, with each rank's stack, when it stalls.

A stalled collective only raises after the training's own timeout (30 minutes with gloo's default),
so the probe decides by itself: when no rank has recorded anything for a while, every live rank is
asked for its Python stacks (SIGUSR1, dumped by faulthandler, so it works while a rank is blocked
in C++), twice, a moment apart. Identical stacks on every live rank mean nobody is computing: the
job is stalled, where each rank waits is kept, and the ranks are ended. A rank still computing
(evaluation, a checkpoint) changes its stack and the job is left alone. Reaching the wall-clock
limit ends the job the same way, so the report still says where each rank was.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from distdoctor.probe.script import protocol
from distdoctor.probe.script.records import RankTrace, StallReport, short_site
from distdoctor.probe.stacks import analysis
from distdoctor.probe.stacks.analysis import Frame

# No record from any rank for this long (or 10 step durations, if longer) starts the stack check.
STALL_QUIET_S = 4.0
# Time between the two stack dumps that must be identical.
STACK_GAP_S = 1.0
_POLL_S = 0.2
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
_THREAD = re.compile(r"^(?:Current thread|Thread) 0x(?P<ident>[0-9a-fA-F]+)")


@dataclass
class _Follow:
    trace: RankTrace
    offset: int = 0
    last_step_t: float | None = None
    longest_step_s: float = 0.0
    stacks_offset: int = 0


@dataclass
class StallWatcher:
    """A thread that watches `run_dir` and ends the ranks when they stall or run out of time."""

    run_dir: Path
    script: str
    timeout_s: float
    quiet_s: float = STALL_QUIET_S
    report: StallReport | None = None
    _ranks: dict[int, _Follow] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._started = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="distdoctor-stall-watch", daemon=True)
        self._thread.start()

    def stop(self) -> StallReport | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        return self.report

    # --- following the record files ------------------------------------------------------------

    def _poll(self) -> bool:
        """Read what the ranks appended; True when anything was."""
        grew = False
        for path in self.run_dir.glob("rank*.jsonl"):
            rank = int(path.stem[4:])
            follow = self._ranks.setdefault(rank, _Follow(RankTrace(rank)))
            records, follow.offset = protocol.read_records(path, follow.offset)
            for record in records:
                follow.trace.add(record)
                if record.get("e") == protocol.STEP and record.get("opt") == 0:
                    t = float(record.get("t", 0.0))
                    if follow.last_step_t is not None:
                        follow.longest_step_s = max(follow.longest_step_s, t - follow.last_step_t)
                    follow.last_step_t = t
            grew = grew or bool(records)
        return grew

    def _alive(self) -> dict[int, int]:
        """rank -> pid of the ranks still running (and not merely zombies)."""
        alive = {}
        for rank, follow in self._ranks.items():
            pid = follow.trace.pid
            if pid is None or follow.trace.end is not None:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    state = f.read().rsplit(b")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if state != b"Z":
                alive[rank] = pid
        return alive

    # --- stacks --------------------------------------------------------------------------------

    def _dump_stacks(self, alive: dict[int, int]) -> dict[int, list[tuple[str, int, str]]]:
        """Each live rank's main-thread frames (innermost first), through faulthandler."""
        paths = {rank: protocol.stacks_path(self.run_dir, rank) for rank in alive}
        for rank, pid in alive.items():
            follow = self._ranks[rank]
            follow.stacks_offset = _size(paths[rank])
            try:
                os.kill(pid, signal.SIGUSR1)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        sizes: dict[int, int] = {}
        while time.monotonic() < deadline:  # until every dump has been written completely
            time.sleep(0.1)
            now = {rank: _size(p) for rank, p in paths.items()}
            if now == sizes and all(now[r] > self._ranks[r].stacks_offset for r in now):
                break
            sizes = now
        stacks = {}
        for rank, path in paths.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self._ranks[rank].stacks_offset)
                    text = f.read().decode("utf-8", errors="replace")
            except OSError:
                text = ""
            stacks[rank] = main_thread_frames(text, self._ranks[rank].trace.main_thread)
        return stacks

    def _waiting(self, frames: list[tuple[str, int, str]]) -> str:
        return waiting_site(frames, os.path.dirname(self.script))

    # --- deciding ------------------------------------------------------------------------------

    def _run(self) -> None:
        last_growth = time.monotonic()
        margin = min(5.0, self.timeout_s * 0.1)
        while not self._stop.wait(_POLL_S):
            now = time.monotonic()
            if self._poll():
                last_growth = now
            alive = self._alive()
            if now - self._started > self.timeout_s - margin:
                if alive:
                    self._conclude(alive, self._dump_stacks(alive), now - last_growth,
                                   f"the job ran past --timeout ({self.timeout_s:g} s)")
                return
            started = any(f.trace.steps or f.trace.backward_sites for f in self._ranks.values())
            longest = max((f.longest_step_s for f in self._ranks.values()), default=0.0)
            if not (started and alive) or now - last_growth < max(self.quiet_s, 10 * longest):
                continue
            first_dump = self._dump_stacks(alive)
            time.sleep(STACK_GAP_S)
            if self._poll():
                last_growth = time.monotonic()
                continue
            alive_now = self._alive()
            if not alive_now:
                continue
            second_dump = self._dump_stacks(alive_now)
            if all(first_dump.get(r) == second_dump[r] and second_dump[r] for r in alive_now):
                self._conclude(alive_now, second_dump, time.monotonic() - last_growth,
                               "no rank made progress and every live rank's stack stayed the same")
                return
            last_growth = time.monotonic()  # a rank is computing: look again after another quiet period

    def _conclude(self, alive: dict[int, int], stacks: dict[int, list[tuple[str, int, str]]], quiet: float,
                  reason: str) -> None:
        self._poll()
        root = os.path.dirname(self.script)
        waiting = {rank: self._waiting(frames) for rank, frames in stacks.items()}
        for rank, follow in self._ranks.items():
            waiting.setdefault(rank, follow.trace.where(root))
        self.report = StallReport(
            after_s=round(quiet, 1),
            reason=reason,
            waiting=waiting,
            stacks={rank: [f"{short_site(f'{fn}:{line}', root)} in {func}" for fn, line, func in frames]
                    for rank, frames in stacks.items()},
        )
        _end(list(alive.values()))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _end(pids: list[int]) -> None:
    """SIGTERM, then SIGKILL what is left: torchrun sees its workers fail and ends the launch."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and any(_running(pid) for pid in pids):
            time.sleep(0.05)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def main_thread_frames(dump: str, main_thread: int | None) -> list[tuple[str, int, str]]:
    """(file, line, function) of one thread in a faulthandler dump, innermost first."""
    threads: list[tuple[int, list[tuple[str, int, str]]]] = []
    for line in dump.splitlines():
        header = _THREAD.match(line)
        if header:
            threads.append((int(header["ident"], 16), []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append((frame["file"], int(frame["line"]), frame["func"].strip()))
    for ident, frames in threads:
        if ident == main_thread:
            return frames
    return threads[0][1] if threads else []


def waiting_site(frames: list[tuple[str, int, str]], root: str) -> str:
    """'train.py:45 in main: loss.backward() (blocked in _engine_run_backward, graph.py:979)' for a rank's stack.

    The user's frame and the collective come from the stack analysis `distdoctor stacks` uses."""
    if not frames:
        return "no Python stack (the rank did not answer)"
    import linecache

    stack = [Frame(func, fn, line) for fn, line, func in frames]
    user = analysis.user_frame(stack, roots=(root,)) or stack[0]
    root = os.path.abspath(root) + os.sep
    source = linecache.getline(user.file, user.line).strip()
    where = f"{short_site(f'{user.file}:{user.line}', root)} in {user.func}" + (f": {source}" if source else "")
    inner = stack[0]
    if inner != user:
        activity = analysis.classify(stack, roots=(root,))
        what = activity.describe() if activity.in_collective and activity.via else inner.func
        where += f" (blocked in {what}, {os.path.basename(inner.file)}:{inner.line})"
    return where
