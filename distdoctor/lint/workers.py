"""Lint many files on several processes, supervised: a worker that dies costs only its own file.

Small files travel in batches (`_batches`); each worker still says which file it is on.

A process pool breaks as a whole when one worker dies (a crash in a native parser, the kernel's
out-of-memory killer), and the futures it held say nothing of which file did it. Here each worker
writes the index of the file it is analysing into its own slot of a shared array, so after a break
the files in flight are known: each is retried alone in a fresh process, and the one that kills its
process again is reported as a DD000 finding on that file; every other file is resubmitted to a
new pool. Results already received are never lost.

Workers ignore SIGINT: on Ctrl-C the parent stops them (`terminate`) and exits promptly.
"""

from __future__ import annotations

import gc
import multiprocessing
import signal
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from distdoctor.lint.guard import GC_THRESHOLD

Job = tuple[str, str, tuple[str, ...]]  # path, source, rule codes

_slots: Any = None
_slot = -1


def _init_worker(slots: Any, counter: Any) -> None:
    global _slots, _slot
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.set_threshold(*GC_THRESHOLD)
    with counter.get_lock():
        _slot = counter.value
        counter.value += 1
    _slots = slots


def _run(function: Callable[[Job], Any], index: int, job: Job) -> Any:
    if _slots is not None and 0 <= _slot < len(_slots):
        _slots[_slot] = index
    try:
        return function(job)
    finally:
        if _slots is not None and 0 <= _slot < len(_slots):
            _slots[_slot] = -1


def _run_batch(function: Callable[[Job], Any], batch: list[tuple[int, Job]]) -> list[Any]:
    """Several small files in one task (each in its slot while it runs): a task's round trip
    costs about a millisecond, more than answering most files."""
    return [_run(function, index, job) for index, job in batch]


# A task holds files up to this many characters of source, or this many files.
BATCH_CHARS = 64 * 1024
BATCH_FILES = 16


def _batches(jobs: Sequence[Job], indices: list[int]) -> list[list[tuple[int, Job]]]:
    batches: list[list[tuple[int, Job]]] = []
    current: list[tuple[int, Job]] = []
    size = 0
    for index in indices:
        job = jobs[index]
        if current and (size + len(job[1]) > BATCH_CHARS or len(current) == BATCH_FILES):
            batches.append(current)
            current, size = [], 0
        current.append((index, job))
        size += len(job[1])
    if current:
        batches.append(current)
    return batches


class _Pool:
    """A process pool and the shared slots saying which file each of its workers holds."""

    def __init__(self, workers: int) -> None:
        context = multiprocessing.get_context()
        # A replacement worker takes a new slot, so there is room for a few generations.
        self.slots = context.Array("l", [-1] * (workers * 4), lock=False)
        counter = context.Value("i", 0)
        self.executor = ProcessPoolExecutor(
            max_workers=workers, mp_context=context, initializer=_init_worker, initargs=(self.slots, counter)
        )

    def in_flight(self) -> set[int]:
        return {index for index in self.slots if index >= 0}

    def stop(self) -> None:
        """End the workers now, whatever they are doing (Ctrl-C, or a broken pool)."""
        processes = list((getattr(self.executor, "_processes", None) or {}).values())
        self.executor.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive():
                process.terminate()
        for process in processes:
            process.join(timeout=5)


def run_supervised(
    function: Callable[[Job], Any],
    jobs: Sequence[Job],
    workers: int,
    on_crash: Callable[[Job], Any],
) -> list[Any]:
    """`function(job)` for every job, on `workers` processes; `on_crash(job)` stands for the result
    of a job whose process died twice, once among others and once alone. Order is kept."""
    results: dict[int, Any] = {}
    remaining = list(range(len(jobs)))
    while remaining:
        pool = _Pool(workers)
        suspects: set[int] = set()
        try:
            futures: dict[Future, list[int]] = {
                pool.executor.submit(_run_batch, function, batch): [index for index, _ in batch]
                for batch in _batches(jobs, remaining)
            }
            pending = set(futures)
            while pending:
                done, pending = wait(pending, return_when=FIRST_EXCEPTION)
                broken = False
                for future in done:
                    try:
                        results.update(zip(futures[future], future.result()))
                    except BrokenProcessPool:
                        broken = True
                if broken:
                    # No slot set (a worker died between files): every unfinished file is a suspect.
                    suspects = pool.in_flight() or {i for batch in futures.values() for i in batch if i not in results}
                    break
        except BaseException:
            pool.stop()
            raise
        if suspects:
            pool.stop()
        else:
            pool.executor.shutdown(wait=True)
        unfinished = [index for index in remaining if index not in results]
        for index in sorted(suspects & set(unfinished)):
            results[index] = _run_alone(function, jobs[index], on_crash)
        remaining = [index for index in unfinished if index not in results]
    return [results[index] for index in range(len(jobs))]


def _run_alone(function: Callable[[Job], Any], job: Job, on_crash: Callable[[Job], Any]) -> Any:
    pool = _Pool(1)
    try:
        return pool.executor.submit(_run, function, 0, job).result()
    except BrokenProcessPool:
        return on_crash(job)
    finally:
        pool.stop()
