"""What torchrun starts in place of the user's script: `-m distdoctor.probe.script.run SCRIPT ARGS`.

It installs the hooks, then runs the script unchanged, as `python SCRIPT ARGS` would: `__name__` is
`"__main__"`, `sys.argv` is `[SCRIPT, *ARGS]` and `sys.path[0]` is the script's folder. The script's
end (normal, `sys.exit`, exception) is recorded; `--steps` ends the rank from inside the hooks.
"""

from __future__ import annotations

import faulthandler
import os
import runpy
import signal
import socket
import sys
import threading


def _rank() -> int:
    for name in ("RANK", "HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if name in os.environ:
            return int(os.environ[name])
    return 0


def main(argv: list[str]) -> None:
    """Run `argv[0]` with `argv[1:]` under the probe's hooks."""
    from distdoctor.probe.launch.torchrun import STEPS_ENV
    from distdoctor.probe.script import protocol

    if not argv:
        sys.exit("usage: python -m distdoctor.probe.script.run SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    run_dir = os.environ.get(protocol.RUN_DIR_ENV)
    if not run_dir:
        sys.exit(f"{protocol.RUN_DIR_ENV} is not set: run the script through `distdoctor probe SCRIPT`")
    rank = _rank()
    # Where each rank waits when the launcher suspects a stall: dumped on SIGUSR1, no code of ours runs.
    stacks = open(protocol.stacks_path(run_dir, rank), "w")  # noqa: SIM115 - must outlive main()
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)

    from distdoctor.probe.script.hooks import Probe, RecordWriter, install_torch_hooks

    budget = int(os.environ.get(STEPS_ENV, "0") or 0)
    probe = Probe(RecordWriter(protocol.records_path(run_dir, rank)), rank, budget, script)
    probe.write(protocol.START, rank=rank, steps=budget, world=int(os.environ.get("WORLD_SIZE", "1")),
                local_rank=int(os.environ.get("LOCAL_RANK", "0")), pid=os.getpid(), host=socket.gethostname(),
                main_thread=threading.main_thread().ident, script=script)
    install_torch_hooks(probe)
    if os.environ.get(protocol.FRAMEWORK_ENV, "torch") == "horovod":
        from distdoctor.probe.script.horovod_hooks import install as install_horovod_hooks

        install_horovod_hooks(probe)

    sys.argv = [script, *argv[1:]]
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        # A framework that catches the script's exception, prints a hint and exits 1 (Hydra's
        # run_and_report) leaves the real exception as the SystemExit's context: that is the error.
        cause = exc.__context__
        if exc.code not in (0, None) and isinstance(cause, Exception):
            probe.error(cause, exit_code=exc.code)
        else:
            probe.finish(exc.code)
        raise
    except BaseException as exc:
        probe.error(exc)
        raise
    probe.finish(0)


if __name__ == "__main__":
    main(sys.argv[1:])
