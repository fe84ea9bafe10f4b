"""Flight Recorder dumps, where a job already writes them: the collective sequence numbers beside the stacks.

torch's Flight Recorder (TORCH_FR_BUFFER_SIZE, formerly TORCH_NCCL_TRACE_BUFFER_SIZE) keeps the last
collectives of every process group; NCCL's watchdog writes them on a timeout, and a job may write
them itself, to `<TORCH_FR_DUMP_TEMP_FILE><rank>` (formerly TORCH_NCCL_DEBUG_INFO_TEMP_FILE, default
/tmp/nccl_trace_rank_). The dump is a pickle of plain dicts and lists (or JSON); it is read here with
an unpickler that refuses every class, so a file in /tmp cannot run code. Nothing is required: a
job without dumps is read from its stacks alone.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import time
from dataclasses import dataclass
from typing import Any

PREFIX_VARS = ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
DEFAULT_PREFIX = "/tmp/nccl_trace_rank_"
MAX_BYTES = 64 << 20


def dump_path(env: dict[str, str], rank: int | None) -> str | None:
    """Where this rank's dump would be written."""
    if rank is None:
        return None
    prefix = next((env[v] for v in PREFIX_VARS if env.get(v)), DEFAULT_PREFIX)
    return f"{prefix}{rank}"


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refusing {module}.{name}: a Flight Recorder dump holds plain data only")


@dataclass(frozen=True)
class GroupRecord:
    """One process group's last collectives in a dump."""

    group: str
    last_seq: int  # the last collective this rank entered
    last_op: str
    last_state: str
    completed_seq: int | None  # the last one it saw complete

    def describe(self) -> str:
        done = f", last completed #{self.completed_seq}" if self.completed_seq is not None else ""
        return f"{self.group}: #{self.last_seq} {self.last_op} {self.last_state}{done}"


@dataclass(frozen=True)
class FlightDump:
    path: str
    groups: tuple[GroupRecord, ...]
    age_s: float

    def describe(self) -> str:
        return "; ".join(g.describe() for g in self.groups) + f" (dump written {self.age_s:.0f} s ago)"


def read_dump(path: str, since: float = 0.0, now: float | None = None) -> FlightDump | None:
    """The dump at `path`, summarised per process group; None when absent, empty, unreadable, or
    older than `since` (the rank's start: a dump of an earlier job is not this one's)."""
    try:
        size = os.path.getsize(path)
        if size == 0 or size > MAX_BYTES or os.path.getmtime(path) < since:
            return None
        with open(path, "rb") as f:
            raw = f.read()
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    data = _decode(raw)
    if not isinstance(data, dict) or not isinstance(data.get("entries"), list):
        return None
    groups: dict[str, dict[str, Any]] = {}
    for entry in data["entries"]:
        if not isinstance(entry, dict) or entry.get("is_p2p"):
            continue
        pg = entry.get("process_group")
        name = pg[1] if isinstance(pg, (list, tuple)) and len(pg) > 1 and pg[1] else str(entry.get("pg_id", "?"))
        seq = entry.get("collective_seq_id")
        if not isinstance(seq, int):
            continue
        group = groups.setdefault(name, {"last": None, "completed": None})
        if group["last"] is None or seq >= group["last"]["collective_seq_id"]:
            group["last"] = entry
        if entry.get("state") == "completed" and (group["completed"] is None or seq > group["completed"]):
            group["completed"] = seq
    records = tuple(
        GroupRecord(name, g["last"]["collective_seq_id"], str(g["last"].get("profiling_name", "?")),
                    str(g["last"].get("state", "?")), g["completed"])
        for name, g in sorted(groups.items()) if g["last"] is not None)
    if not records:
        return None
    return FlightDump(path, records, max(0.0, (now if now is not None else time.time()) - mtime))


def _decode(raw: bytes) -> Any:
    if raw[:1] in (b"{", b"["):
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return None
    try:
        return _PlainUnpickler(io.BytesIO(raw)).load()
    except Exception:  # noqa: BLE001 - any malformed or hostile pickle is simply not a dump we read
        return None
