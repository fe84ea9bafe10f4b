"""Start ranks through Horovod's own launcher, `horovodrun -np N --gloo` (Gloo controller, CPU).

Bounded by a wall-clock limit; on timeout or Ctrl-C every process horovodrun started is stopped
(horovodrun starts each rank in a session of its own: `run_process_tree`, the runner torchrun
launches use too), and the result is torchrun's `LaunchResult`, with per-rank exit codes and
tracebacks read from horovodrun's output and `--output-filename` logs.

Nothing here imports torch or horovod: whether Horovod is usable is decided from files.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import distdoctor
from distdoctor.probe.launch.torchrun import LaunchError, LaunchResult, last_traceback, run_process_tree

INSTALL_HINT = "run scripts/install-horovod.sh (it builds Horovod 0.28.1 with PyTorch and Gloo for the installed torch)"


class HorovodUnavailable(LaunchError):
    """Horovod (with PyTorch support) or horovodrun is missing: the message says how to install it."""


def horovod_missing_reason() -> str | None:
    """Why Horovod cannot be used here, or None when `horovod.torch` and `horovodrun` are available.

    Only files are looked at: importing `horovod.torch` loads torch and Horovod's extension, which
    the launcher process must not do.
    """
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return "Horovod is not installed"
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    if not list((package_dir / "torch").glob("mpi_lib_v2*.so")):
        return f"Horovod at {package_dir} was built without PyTorch support (no horovod/torch/mpi_lib_v2*.so)"
    if horovodrun_path() is None:
        return "horovodrun is not on PATH"
    return None


def require_horovod() -> None:
    """Raise `HorovodUnavailable` with the reason and the install command when Horovod is missing."""
    reason = horovod_missing_reason()
    if reason is not None:
        raise HorovodUnavailable(f"{reason}: {INSTALL_HINT}")


def horovodrun_path() -> str | None:
    """horovodrun next to this interpreter (a virtual environment's bin/) or else on PATH."""
    beside = Path(sys.executable).parent / "horovodrun"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which("horovodrun")


def horovodrun_command(nproc: int, target: Sequence[str], *, timeout_s: float = 120.0) -> list[str]:
    """`horovodrun -np N --gloo ... python TARGET`: the command a user could also run by hand.

    `target` is `["script.py", *args]` or `["-m", "pkg.mod", *args]`, run by this interpreter.
    """
    if nproc < 1:
        raise LaunchError(f"nproc must be at least 1, got {nproc}")
    if not target:
        raise LaunchError("nothing to launch: the target is empty")
    runner = horovodrun_path()
    if runner is None:
        raise HorovodUnavailable(f"horovodrun is not on PATH: {INSTALL_HINT}")
    start_timeout = max(10, int(timeout_s * 0.5))
    return [
        runner,
        "-np", str(nproc),
        "-H", f"localhost:{nproc}",
        "--gloo",
        "--start-timeout", str(start_timeout),
        "--gloo-timeout-seconds", str(start_timeout),
        sys.executable,
        *target,
    ]  # fmt: skip


def launch_horovod(
    nproc: int,
    target: Sequence[str],
    *,
    timeout_s: float = 120.0,
    env: Mapping[str, str] | None = None,
    echo: bool = False,
) -> LaunchResult:
    """Run `target` on `nproc` local ranks through horovodrun and wait, at most `timeout_s`.

    A collective that stalls is shut down by Horovod itself after about half the wall clock
    (HOROVOD_STALL_SHUTDOWN_TIME_SECONDS), so the stalled rank's error reaches the report.
    """
    require_horovod()
    logs = Path(tempfile.mkdtemp(prefix="distdoctor-horovod-"))
    cmd = horovodrun_command(nproc, target, timeout_s=timeout_s)
    cmd[1:1] = ["--output-filename", str(logs)]
    full_env = dict(os.environ)
    # Ranks import distdoctor from wherever this process imported it, installed or not.
    package_root = str(Path(distdoctor.__file__).resolve().parents[1])
    full_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, full_env.get("PYTHONPATH", "")) if p)
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    stall_s = max(5, int(timeout_s * 0.4))
    full_env.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(2, stall_s // 2)))
    full_env.setdefault("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", str(stall_s))
    full_env.update(env or {})
    try:
        run = run_process_tree(cmd, full_env, timeout_s, echo=echo)
        rank_exitcodes = _exitcodes(run.output, run.returncode, run.timed_out or run.interrupted)
        return LaunchResult.of(run, rank_exitcodes, _rank_errors(logs), "horovodrun")
    finally:
        shutil.rmtree(logs, ignore_errors=True)


_EXIT_LINE = re.compile(r"^Process (?P<rank>\d+) exit with status code (?P<code>-?\d+)\.", re.MULTILINE)


def _exitcodes(output: str, returncode: int, stopped: bool) -> dict[int, int]:
    codes = {int(m["rank"]): int(m["code"]) for m in _EXIT_LINE.finditer(output)}
    if returncode == 0 and not stopped:
        ranks = {int(r) for r in re.findall(r"^\[(\d+)\]<std", output, re.MULTILINE)}
        codes.update({rank: 0 for rank in ranks})
    return codes


def _rank_errors(logs: Path) -> dict[int, str]:
    """The last traceback in each rank's stderr (horovodrun --output-filename: rank.N/stderr)."""
    errors: dict[int, str] = {}
    for rank_dir in logs.glob("rank.*"):
        try:
            rank = int(rank_dir.name.split(".", 1)[1])
        except ValueError:
            continue
        text = last_traceback(rank_dir / "stderr")
        if text:
            errors[rank] = text
    return errors
